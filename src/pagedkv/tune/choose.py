"""The plan: a K and a V codec per layer minimising the summed sensitivity within a bits budget.

Greedy knapsack: every (layer, side) starts on the ladder's cheapest codec; each step takes,
among all moves of one (layer, side) to any more precise rung that still fits the budget, the
one with the largest error drop per added bit (ties: lower layer, then K before V, then the
cheaper rung), until no move fits or helps. Bits are averaged over every stored K and V element
(layers weighted by kv heads x head_dim), plus the recent window's tail when the plan has one
(as held at the end of `context` tokens). Deterministic for given errors and budget.

`choose_window` adds the high-precision window to the search: per candidate window (none, or R
recent positions and S sinks in a q8_0 tail) the sensitivities are measured with that window and
the greedy plan spends what the window leaves of the budget; the candidate whose plan has the
smallest summed error wins (ties: the earlier candidate).
"""

from __future__ import annotations

import json
from typing import Optional, Sequence

from ..codecs.catalogue import Codec
from ..errors import ConfigError
from ..formats import PLAN_VERSION, KVFormat
from ..ops.recent import tail_tokens
from ..spec import RecentWindow


def tail_bits(recent: Optional[RecentWindow], context: int, block_size: int = 16) -> float:
    """Bits per stored K/V element a window's tail adds at `context` tokens (its blocks as held
    then, both sides in the tail codec); 0 without a window."""
    if recent is None:
        return 0.0
    return tail_tokens(recent, context, block_size) / context * recent.codec.bits_per_element


def predicted_error(errors: Sequence[dict], formats: Sequence[KVFormat]) -> float:
    """The plan's summed sensitivity (every layer's K and V error at its codecs)."""
    return sum(e["k"][f.k.name] + e["v"][f.v.name] for e, f in zip(errors, formats))


def choose_window(candidates: Sequence[tuple], ladder: Sequence[Codec], dims: Sequence[tuple[int, int]],
                  bits: float, context: int = 1024, block_size: int = 16):
    """candidates: (window or None, its per-layer errors) in order of preference. Returns (window,
    formats, predicted error, search), search = one record per candidate (see module doc);
    ConfigError when no candidate fits `bits`."""
    best, search, refused = None, [], None
    for window, errors in candidates:
        try:
            formats = choose(errors, ladder, dims, bits, window, context, block_size)
        except ConfigError as exc:
            refused = exc
            search.append({"recent_window": _window_doc(window), "fits": False})
            continue
        err = predicted_error(errors, formats)
        search.append({"recent_window": _window_doc(window), "fits": True, "predicted_error": round(err, 8),
                       "tail_bits": round(tail_bits(window, context, block_size), 6)})
        if best is None or err < best[2]:
            best = (window, formats, err)
    if best is None and len(candidates) == 1:
        raise refused
    if best is None:
        raise ConfigError(f"--bits {bits}: no candidate plan fits (the cheapest codec everywhere needs "
                          f"{min(c.bits_per_element for c in ladder):.3f} bits)")
    return (*best, search)


def _window_doc(recent: Optional[RecentWindow]):
    if recent is None:
        return None
    doc = {"tokens": recent.tokens, "codec": recent.codec.name}
    if recent.sinks:
        doc["sinks"] = recent.sinks
    return doc


def choose(errors: Sequence[dict], ladder: Sequence[Codec], dims: Sequence[tuple[int, int]], bits: float,
           recent: Optional[RecentWindow] = None, context: int = 1024, block_size: int = 16) -> list[KVFormat]:
    """Per layer the KVFormat of the plan (see module doc); a layer's rungs are the ladder codecs
    its errors were measured for (a codec its head_dim cannot store has none). ConfigError when
    even the cheapest codecs exceed `bits`."""
    ladder = sorted(ladder, key=lambda c: (c.bits_per_element, c.name))
    rungs = [[c for c in ladder if c.name in e["k"]] for e in errors]
    weights = [h * d for h, d in dims]
    total = 2 * sum(weights)
    extra = tail_bits(recent, context, block_size)
    rung = [[0, 0] for _ in dims]

    def used() -> float:
        return sum(w * (lad[r[0]].bits_per_element + lad[r[1]].bits_per_element)
                   for w, r, lad in zip(weights, rung, rungs)) / total + extra

    if used() > bits + 1e-9:
        raise ConfigError(f"--bits {bits}: the cheapest plan ({ladder[0].name} everywhere"
                          f"{' + the recent window' if recent else ''}) needs {used():.3f} bits")
    while True:
        best = None
        now = used()
        for layer, (w, r, lad) in enumerate(zip(weights, rung, rungs)):
            for side in (0, 1):
                errs = errors[layer]["kv"[side]]
                for to in range(r[side] + 1, len(lad)):
                    cost = w * (lad[to].bits_per_element - lad[r[side]].bits_per_element) / total
                    gain = errs[lad[r[side]].name] - errs[lad[to].name]
                    if gain <= 0 or now + cost > bits + 1e-9:
                        continue
                    key = (gain / cost, -layer, -side, -to)
                    if best is None or key > best[0]:
                        best = (key, layer, side, to)
        if best is None:
            break
        rung[best[1]][best[2]] = best[3]
    return [KVFormat(lad[r[0]], lad[r[1]]) for r, lad in zip(rung, rungs)]


def plan_document(formats: Sequence[KVFormat], dims: Sequence[tuple[int, int]], *, model: str, bits: float,
                  text: str, tokens: int, recent: Optional[RecentWindow], errors: Sequence[dict],
                  context: int = 1024, search: Optional[list] = None) -> dict:
    """The plan file's JSON object (`pagedkv.formats.read_plan` reads it)."""
    return {
        "pagedkv_plan": PLAN_VERSION, "model": model, "bits_budget": bits, "calibration_text": text,
        "calibration_tokens": tokens,
        "layer_dims": [list(d) for d in dims],
        "layers": [{"k": f.k.name, "v": f.v.name} for f in formats],
        "recent_window": _window_doc(recent),
        "tail_bits": tail_bits(recent, context),
        "bits_per_element": sum(f.bits_per_element * h * d for f, (h, d) in zip(formats, dims))
        / sum(h * d for h, d in dims),
        "sensitivity": [{s: {c: round(e, 8) for c, e in row[s].items()} for s in ("k", "v")} for row in errors],
        "context": context,
        "window_search": search or [],
    }


def write_plan(path: str, doc: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
        f.write("\n")
