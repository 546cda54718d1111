"""The plan: a K and a V codec per layer minimising the summed sensitivity within a bits budget.

Greedy knapsack: every (layer, side) starts on the ladder's cheapest codec; each step takes,
among all moves of one (layer, side) to any more precise rung that still fits the budget, the
one with the largest error drop per added bit (ties: lower layer, then K before V, then the
cheaper rung), until no move fits or helps. Bits are averaged over every stored K and V element
(layers weighted by kv heads x head_dim), plus the recent window's tail when the plan has one
(as held at the end of `context` tokens). Deterministic for given errors and budget.
"""

from __future__ import annotations

import json
from typing import Optional, Sequence

from ..codecs.catalogue import Codec
from ..errors import ConfigError
from ..formats import PLAN_VERSION, KVFormat
from ..ops.recent import RecentWindow, stored_tail_tokens


def choose(errors: Sequence[dict], ladder: Sequence[Codec], dims: Sequence[tuple[int, int]], bits: float,
           recent: Optional[RecentWindow] = None, context: int = 1024, block_size: int = 16) -> list[KVFormat]:
    """Per layer the KVFormat of the plan (see module doc); ConfigError when even the cheapest
    codecs exceed `bits`."""
    ladder = sorted(ladder, key=lambda c: (c.bits_per_element, c.name))
    weights = [h * d for h, d in dims]
    total = 2 * sum(weights)
    extra = 0.0
    if recent is not None:
        tail = stored_tail_tokens(context, recent.tokens, block_size) / context
        extra = tail * recent.codec.bits_per_element
    rung = [[0, 0] for _ in dims]

    def used() -> float:
        return sum(w * (ladder[r[0]].bits_per_element + ladder[r[1]].bits_per_element)
                   for w, r in zip(weights, rung)) / total + extra

    if used() > bits + 1e-9:
        raise ConfigError(f"--bits {bits}: the cheapest plan ({ladder[0].name} everywhere"
                          f"{' + the recent window' if recent else ''}) needs {used():.3f} bits")
    while True:
        best = None
        now = used()
        for layer, (w, r) in enumerate(zip(weights, rung)):
            for side in (0, 1):
                errs = errors[layer]["kv"[side]]
                for to in range(r[side] + 1, len(ladder)):
                    cost = w * (ladder[to].bits_per_element - ladder[r[side]].bits_per_element) / total
                    gain = errs[ladder[r[side]].name] - errs[ladder[to].name]
                    if gain <= 0 or now + cost > bits + 1e-9:
                        continue
                    key = (gain / cost, -layer, -side, -to)
                    if best is None or key > best[0]:
                        best = (key, layer, side, to)
        if best is None:
            break
        rung[best[1]][best[2]] = best[3]
    return [KVFormat(ladder[r[0]], ladder[r[1]]) for r in rung]


def plan_document(formats: Sequence[KVFormat], dims: Sequence[tuple[int, int]], *, model: str, bits: float,
                  text: str, tokens: int, recent: Optional[RecentWindow], errors: Sequence[dict]) -> dict:
    """The plan file's JSON object (`pagedkv.formats.read_plan` reads it)."""
    return {
        "pagedkv_plan": PLAN_VERSION, "model": model, "bits_budget": bits, "calibration_text": text,
        "calibration_tokens": tokens,
        "layer_dims": [list(d) for d in dims],
        "layers": [{"k": f.k.name, "v": f.v.name} for f in formats],
        "recent_window": None if recent is None else {"tokens": recent.tokens, "codec": recent.codec.name},
        "bits_per_element": sum(f.bits_per_element * h * d for f, (h, d) in zip(formats, dims))
        / sum(h * d for h, d in dims),
        "sensitivity": [{s: {c: round(e, 8) for c, e in row[s].items()} for s in ("k", "v")} for row in errors],
    }


def write_plan(path: str, doc: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
        f.write("\n")
