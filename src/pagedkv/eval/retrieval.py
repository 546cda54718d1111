"""Running the retrieval tasks (`pagedkv.eval.retrieval_tasks`) on KV formats and scoring them.

A *unit* is one (task, length, format): a fresh `PagedKVCache` of the format runs that task's
trials at that length one after another, in `sharing_order`. Each trial is
`cache.begin(prompt)` (the cache's prefix caching: the whole blocks the prompt shares with what
the cache stored before are not computed again, exactly as a serving cache reuses a shared
document), one forward over the rest of the prompt, then `max_new_tokens` greedy decode steps
(the decode path, as a user's generation takes it). Key centring and fp8 scales are fixed by the
unit's first trial (its whole prompt: a long first chunk, as a long prompt gives) and kept by the
later ones, as a serving cache keeps them. A recent window's tail keeps the blocks it released
(`PagedKVCache(keep_window_prefixes=True)`), so a format with a window hits the same prefixes as
one without. Sliding-window models take no prefix hits (every prompt computed whole).

Units are independent: with `compute.workers` > 1 they are shared out to forked processes of
`compute.threads` threads each (the model loaded once before the fork), the most expensive
first; the results are the same as in one process.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

from .retrieval_stats import INFORMATIVE, depth_bins, mcnemar_exact, paired_counts, wilson
from .retrieval_tasks import Trial, computed_tokens, extract_answer, is_correct, sharing_order


@dataclass(frozen=True)
class Unit:
    task: str
    length: int
    choice: object  # runner.FormatChoice
    trials: tuple[Trial, ...]  # in sharing order

    @property
    def label(self) -> str:
        return f"{self.task} {self.length} {self.choice.label}"


def make_units(trials_by_cell: dict, choices: Sequence) -> list[Unit]:
    """One unit per (task, length) cell and format, the trials in sharing order."""
    return [Unit(task, length, c, tuple(sharing_order(trials)))
            for (task, length), trials in trials_by_cell.items() for c in choices]


# CPU seconds on one core of the development machine (SmolLM2-135M, 1 thread): a prefill token
# at position p costs _TOKEN_S + _TOKEN_POSITION_S * p (the weights, then attention over the p
# tokens before it), a decode step _STEP_S + _STEP_POSITION_S * p, for bf16; a compressed format
# (its stores encode, its attention decodes the pages) about _CODEC_FACTOR more. Fitted to
# prefills of 512 and 2048 tokens and a 1k and an 8k eval pass; scaled to another model by its
# weights (layers x hidden^2) and attention width (layers x heads x head_dim). An estimate: on a
# busy machine the same work takes more CPU time, and more wall time still.
_TOKEN_S = 2.5e-3
_TOKEN_POSITION_S = 1.5e-6
_STEP_S = 0.08
_STEP_POSITION_S = 2.0e-6
_CODEC_FACTOR = 1.5
_SMOLLM2 = (30 * 576 * 576, 30 * 9 * 64)


@dataclass(frozen=True)
class CostModel:
    """What the estimate knows of a model: its weights and attention width relative to
    SmolLM2-135M, each layer's sliding window (None: global), and whether its caches take prefix
    hits (a model with sliding layers takes none, see `has_sliding_layers`)."""
    weights: float
    attention: float
    windows: tuple = ()
    reuse: bool = True

    def reach(self, start: int, end: int) -> float:
        """Mean over layers and over positions (start, end] of the tokens one attends to: the
        position on a global layer, at most the window on a sliding one (a decode step at `end`:
        start == end)."""
        if not self.windows:
            return (start + end) / 2
        return sum(_mean_min(start, end, w) for w in self.windows) / len(self.windows)


def _mean_min(start: int, end: int, window: Optional[int]) -> float:
    """Mean of min(p, window) over p in [start, end] (window None: no cap)."""
    if window is None or end <= window:
        return (start + end) / 2
    if start >= window:
        return float(window)
    return ((window * window - start * start) / 2 + window * (end - window)) / (end - start)


def cost_model(config) -> CostModel:
    """The `CostModel` of a Hugging Face config."""
    text = getattr(config, "text_config", None) or config
    layers = getattr(text, "num_hidden_layers", 30)
    hidden = getattr(text, "hidden_size", 576)
    heads = getattr(text, "num_attention_heads", 9)
    head_dim = getattr(text, "head_dim", None) or hidden // max(heads, 1)
    windows = tuple(layer_windows(config))
    return CostModel(layers * hidden * hidden / _SMOLLM2[0], layers * heads * head_dim / _SMOLLM2[1],
                     windows, not any(w is not None for w in windows))


def layer_windows(config) -> list:
    """Each layer's sliding window as the cache lays them out (None: global); [] for a model
    the K/V layout does not cover (latent MLA layers: none slide)."""
    from ..errors import ConfigError
    from ..integrations.hf_common import _layer_layout

    try:
        return _layer_layout(config)[1]
    except ConfigError:
        return []


def has_sliding_layers(config) -> bool:
    """Whether some layer of `config` slides (as the cache lays them out): such caches take no
    prefix hits (`PagedKVCache.begin`), so every prompt is computed whole."""
    return any(w is not None for w in layer_windows(config))


def unit_seconds(unit: Unit, block_size: int, model: CostModel) -> float:
    """Estimated CPU seconds of a unit on one core (see the constants above): each trial's
    computed prompt tokens (the rest are prefix hits) at their positions, then its decode steps."""
    total = 0.0
    for t, c in zip(unit.trials, computed_tokens(unit.trials, block_size, model.reuse)):
        end = len(t.prompt)
        total += c * (model.weights * _TOKEN_S + model.attention * _TOKEN_POSITION_S * model.reach(end - c, end))
        total += t.max_new_tokens * (model.weights * _STEP_S + model.attention * _STEP_POSITION_S * model.reach(end, end))
    return total * (1.0 if _is_bf16(unit.choice) else _CODEC_FACTOR)


def _is_bf16(choice) -> bool:
    fmt = getattr(choice, "kv_format", None)
    return getattr(choice, "recent", None) is None and getattr(fmt, "name", None) == "bf16" \
        and not getattr(choice, "high_precision_layers", 0)


def estimate(units: Sequence[Unit], block_size: int, model: CostModel, workers: int) -> tuple[float, int, int]:
    """(estimated wall seconds with `workers` idle cores, prompt tokens computed, prompt tokens)."""
    costs = [unit_seconds(u, block_size, model) for u in units]
    loads = [0.0] * max(1, workers)
    for c in sorted(costs, reverse=True):  # the order the workers take them
        loads[loads.index(min(loads))] += c
    computed = sum(sum(computed_tokens(u.trials, block_size, model.reuse)) for u in units)
    return max(loads), computed, sum(len(t.prompt) for u in units for t in u.trials)


def run_unit(model, unit: Unit, block_size: int, on_trial: Optional[Callable[[], None]] = None) -> dict:
    """Run a unit (see the module docstring): {"generated": [token ids per trial, in
    `unit.trials` order], "bits_per_element": as stored at the unit's length, "computed":
    prompt tokens the model computed, "seconds" / "cpu_seconds": wall / this process's CPU time}."""
    import torch

    from ..integrations.hf_compat import with_cache
    from ..options import CacheOptions
    from .runner import cache_for, layout_numbers

    t0, cpu0 = time.perf_counter(), time.process_time()
    choice = unit.choice
    # the tail of a recent window keeps the blocks a later trial's hit needs at its end, so
    # every format computes what `computed_tokens` counts (no sliding layers: see the doc)
    opts = CacheOptions(block_size=block_size, checks=False,
                        keep_window_prefixes=not has_sliding_layers(model.config))
    cache = cache_for(model, choice, options=opts)
    bits = layout_numbers(cache, 1, choice.recent, unit.length)[0]
    kw = with_cache(model, cache)
    keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    generated, computed = [], 0
    with torch.inference_mode():
        for trial in unit.trials:
            ids = torch.tensor([trial.prompt], dtype=torch.int64, device=model.device)
            hit = cache.begin(ids)
            computed += ids.shape[1] - hit
            logits = model(ids[:, hit:], **kw, use_cache=True, **keep).logits
            out = []
            for step in range(trial.max_new_tokens):
                nxt = logits[:, -1].argmax(-1, keepdim=True)
                out.append(int(nxt))
                if step + 1 < trial.max_new_tokens:
                    logits = model(nxt, **kw, use_cache=True).logits
            generated.append(out)
            if on_trial:
                on_trial()
    return {"generated": generated, "bits_per_element": bits, "computed": computed,
            "seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - cpu0}


def run_units(model, units: Sequence[Unit], block_size: int, costs: Sequence[float], workers: int,
              threads: int, on_trial: Optional[Callable[[str], None]] = None) -> Iterator[tuple[int, dict]]:
    """Yield (unit index, `run_unit` result) as units finish; with workers > 1 from forked
    processes, the most expensive units first (see the module docstring)."""
    if workers <= 1 or len(units) <= 1:
        for i, u in enumerate(units):
            yield i, run_unit(model, u, block_size, (lambda u=u: on_trial(u.label)) if on_trial else None)
        return
    from .workers import fork_map

    order = sorted(range(len(units)), key=lambda i: -costs[i])
    n = min(workers, len(units))
    shares: list[list[int]] = [[] for _ in range(n)]
    loads = [0.0] * n
    for i in order:  # longest first, each to the least loaded worker
        k = loads.index(min(loads))
        shares[k].append(i)
        loads[k] += costs[i]
    yield from fork_map(model, shares, _unit_work, (units, block_size), threads, on_trial, "retrieval")


def _unit_work(model, share, conn, units, block_size) -> None:
    for i in share:
        result = run_unit(model, units[i], block_size, lambda: conn.send(("progress", units[i].label)))
        conn.send(("result", i, result))


def score(units: Sequence[Unit], results: dict, decode: Callable[[list], str]) -> tuple[list[dict], list[dict]]:
    """(rows, trials): one row per (task, length, format) with accuracy, its Wilson 95%
    interval, bits per element at that length, the paired counts and McNemar's exact p against
    bf16 (the cell's first format), bf16's accuracy and whether the cell is informative (bf16 >=
    80%); one record per trial and format (depth, answer, what the model wrote, correct)."""
    by_cell: dict = {}
    for i, u in enumerate(units):
        by_cell.setdefault((u.task, u.length), []).append(i)
    rows, records = [], []
    for (task, length), idx in by_cell.items():
        per_format = {}
        for i in idx:
            u = units[i]
            texts = [decode(g) for g in results[i]["generated"]]
            ok = {t.index: is_correct(s, t.answer) for t, s in zip(u.trials, texts)}
            per_format[i] = ok
            for t, s in zip(u.trials, texts):
                records.append({"task": task, "length": length, "format": u.choice.label, "trial": t.index,
                                "context": t.context, "depth": round(t.depth, 4), "answer": t.answer,
                                "generated": s, "extracted": extract_answer(s), "correct": ok[t.index]})
        ref = per_format[idx[0]]
        order = sorted(ref)
        ref_ok = [ref[k] for k in order]
        ref_acc = sum(ref_ok) / len(ref_ok)
        for i in idx:
            u, ok = units[i], [per_format[i][k] for k in order]
            depths = {t.index: t.depth for t in u.trials}
            lost, gained = paired_counts(ref_ok, ok)
            lo, hi = wilson(sum(ok), len(ok))
            rows.append({"task": task, "length": length, "format": u.choice.label,
                         "bits_per_element": results[i]["bits_per_element"], "trials": len(ok),
                         "correct": sum(ok), "accuracy": sum(ok) / len(ok), "ci95": [lo, hi],
                         "bf16_accuracy": ref_acc, "informative": ref_acc >= INFORMATIVE,
                         "lost": lost, "gained": gained, "mcnemar_p": mcnemar_exact(lost, gained),
                         "by_depth": depth_bins([depths[k] for k in order], ok),
                         "computed_tokens": results[i]["computed"], "seconds": results[i]["seconds"],
                         "cpu_seconds": results[i].get("cpu_seconds")})
    return rows, records
