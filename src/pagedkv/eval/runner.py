"""`pagedkv eval`: quality, size and speed of KV formats on a real model, teacher-forced.

For each window (int64 [N] tokens, BOS first when the tokenizer has one) and each format, a fresh
`PagedKVCache` receives the whole window in one forward pass. The cache stores every token's K/V
compressed *before* attention reads it (`update` stores, then the ops attend over the pages), so
query p attends to the compressed K/V of tokens 0..p, itself included: exactly what it would see
when decoding token by token. One pass per window is therefore faithful and ~N times cheaper than
decoding. (Key centring and fp8 tensor scales are fixed from the window's K/V, as they would be
from a prompt of that length.)

Metrics against the pagedkv bf16 cache run on the same window (the reference): mean KL of the
next-token distribution, top-1 agreement, also by position bucket (0-1k, 1-2k, 2-4k, 4-8k, ...:
`kl_by_position`; a long window's late positions read apart from its early ones); plus perplexity, bits/element (averaged over layers,
high-precision layers included; a recent window's tail blocks as held at the end of the window),
KV bytes per token, the longest context that fits a memory
budget, and decode tokens/s (median of a few greedy steps on the first window, 1 thread, timed in
the thread's CPU time so that other processes on the machine do not count). A pass keeps the
model's final hidden states, not its logits; the metrics form the logits a chunk of positions at
a time (`metrics.hidden_window_sums`), so a 16k-token window of a 262k-word vocabulary fits.

A prefill never takes the kernel's decode paths (calls whose sequences each have one query
token), which is where most approximations (`pagedkv.approx`: int8_scores, bf16 decode scores)
live. With `decode_tail` N > 0 the metrics cover the last N tokens of each window only, each
predicted by a decode step: tokens 0..L-N-2 are one prefill, then tokens L-N-1..L-2 are fed one
at a time on the same cache (teacher-forced: the window's true tokens), and the logits of those N
steps are scored against tokens L-N..L-1. The bf16 reference runs the same split, so the
comparison is like for like (its first chunk also fixes the key centre and fp8 scales, as it
does for the formats).
"""

from __future__ import annotations

import inspect
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from ..approx import Approximation
from ..options import CacheOptions
from ..defaults import BLOCK_SIZE
from ..errors import ConfigError, PagedKVError
from ..integrations.hf_compat import with_cache
from ..integrations.model_config import text_config
from ..ops.recent import tail_tokens
from ..spec import RecentWindow
from .choice import FormatChoice, parse_choice, parse_window  # noqa: F401 (parse_window: re-exported)
from .config import DEFAULT_FORMATS, REFERENCE_FORMAT, EvalConfig  # noqa: F401 (re-exported)
from .metrics import MetricSums, hidden_window_sums
from .tuned import resolve_tuned


@dataclass
class FormatResult:
    choice: FormatChoice
    bits_per_element: float
    bytes_per_token: float
    max_context_tokens: int
    high_precision_layers: int
    sums: MetricSums = field(default_factory=MetricSums)
    decode_times: list = field(default_factory=list)
    approx: str = "exact"  # the attention approximation of the pass (`pagedkv.approx`)
    scored_positions: Optional[str] = None  # set with a decode tail (EvalConfig.scored_positions)

    def as_dict(self) -> dict:
        dt = statistics.median(self.decode_times) if self.decode_times else float("nan")
        return {
            "format": self.choice.label,
            "approx": self.approx,
            "kv_format": self.choice.format_name,
            "high_precision_layers": self.high_precision_layers,
            "bits_per_element": self.bits_per_element,
            "bytes_per_token": self.bytes_per_token,
            "ppl": self.sums.ppl,
            "kl": self.sums.mean_kl,
            "top1": self.sums.top1_rate,
            "decode_tok_s": 1.0 / dt if dt == dt and dt > 0 else None,
            "max_context_tokens": self.max_context_tokens,
            "tokens": self.sums.tokens,
            "kl_per_window": self.sums.per_window_kl,
            "kl_by_position": self.sums.by_position(),
            **({"scored_positions": self.scored_positions} if self.scored_positions else {}),
        }


def cache_for(model, choice: FormatChoice, block_size: int = BLOCK_SIZE, checks: bool = True,
              approx: Approximation = Approximation(), options: Optional[CacheOptions] = None):
    """The cache `choice` names for `model`: `options` (default: block_size, checks and approx
    as given, the rest at their defaults; the choice's window added)."""
    from ..integrations.deepseek import mla_dims

    opts = options or CacheOptions(block_size=block_size, checks=checks, approx=approx)
    if mla_dims(model.config) is not None:  # latent (MLA) models: one [latent | rope] per token
        if choice.recent is not None:
            raise ConfigError(f"{choice.label}: a recent window is not implemented for latent (MLA) layers")
        if not opts.approx.exact:
            raise ConfigError(f"approx {opts.approx.name!r} is not implemented for latent (MLA) layers; use exact")
        from ..integrations.deepseek import PagedLatentCache
        from ..integrations.deepseek import enable as enable_mla

        enable_mla(model)
        return PagedLatentCache(model, choice.kv_format, high_precision_layers=choice.high_precision_layers,
                                options=opts)
    from ..integrations.transformers import PagedKVCache

    return PagedKVCache(model, choice.kv_format, high_precision_layers=choice.high_precision_layers,
                        recent_window=choice.recent, options=opts)


def layout_numbers(cache, memory_bytes: int, recent: Optional[RecentWindow] = None,
                   window_tokens: int = 0) -> tuple[float, float, int]:
    """(bits/element over all layers, bytes/token, longest context fitting memory_bytes), as
    stored at the end of a window of `window_tokens` tokens: with a recent window, its tail
    blocks (`stored_tail_tokens`, tail codec on both sides) are added to the format's pages."""
    cfg = cache.config
    elems_per_token = sum(s.latent.elements if s.latent is not None else 2 * s.num_kv_heads * s.head_dim
                          for s in cfg.layers)
    bytes_per_token = cfg.bytes_per_block / cfg.block_size
    fits = (memory_bytes // cfg.bytes_per_block) * cfg.block_size
    if recent is not None and window_tokens:
        tail_per_token = sum(2 * recent.codec.row_bytes(s.head_dim) * s.num_kv_heads for s in cfg.layers)
        tail = tail_tokens(recent, window_tokens, cfg.block_size) * tail_per_token
        bytes_per_token += tail / window_tokens
        fits = int((memory_bytes - tail) // cfg.bytes_per_block) * cfg.block_size
    return 8 * bytes_per_token / elems_per_token, bytes_per_token, int(fits)


def evaluate(model, windows: Sequence[torch.Tensor], cfg: EvalConfig,
             progress: Optional[Callable[[str], None]] = None,
             on_window: Optional[Callable[[list[dict]], None]] = None, tokenizer=None) -> list[dict]:
    """Run every format over every window; returns one dict per format (see FormatResult).

    progress(label) is called after each pass; on_window(rows) after each window with the
    results so far (for long runs that should leave partial results behind). With
    `cfg.compute.workers` > 1 the windows are shared out to that many forked worker processes
    (`pagedkv.eval.workers`); results are added in window order, so the numbers are the same.
    """
    from ..integrations.transformers import enable

    enable(model)
    choices = [parse_choice(f) for f in cfg.formats]
    check_unique(choices)
    choices = resolve_tuned(model, tokenizer, choices, cfg.window_tokens)  # `tunedB`: plans made here
    results = [format_result(model, c, cfg) for c in choices]
    if cfg.compute.workers > 1 and len(windows) > 1:
        from .workers import parallel_windows

        parts_by_window = parallel_windows(model, windows, choices, cfg, progress, window_parts)
    else:
        parts_by_window = ((wi, window_parts(model, wi, w, choices, cfg, progress)) for wi, w in enumerate(windows))
    for wi, parts in parts_by_window:
        for r, part in zip(results, parts):
            r.sums.add_window(part["sums"])
            if "decode_times" in part:
                r.decode_times = part["decode_times"]
        if on_window:
            on_window([r.as_dict() for r in results])
    return [r.as_dict() for r in results]


def format_result(model, choice: FormatChoice, cfg: EvalConfig) -> FormatResult:
    """An empty FormatResult of `choice` with its layout numbers as stored at the end of a window
    of `cfg.window_tokens` tokens (`layout_numbers`)."""
    cache = cache_for(model, choice, cfg.block_size)
    bits, bpt, fits = layout_numbers(cache, cfg.memory_bytes, choice.recent, cfg.window_tokens)
    return FormatResult(choice, bits, bpt, fits, cache.config.num_high_precision_layers,
                        approx=cfg.approx.name, scored_positions=cfg.scored_positions)


def check_unique(choices: Sequence[FormatChoice]) -> None:
    labels = [c.label for c in choices]
    dupes = sorted({x for x in labels if labels.count(x) > 1})
    if dupes:
        raise ConfigError(f"--formats lists {', '.join(dupes)} more than once")


def window_parts(model, wi: int, window: torch.Tensor, choices: Sequence[FormatChoice], cfg: EvalConfig,
                 on_pass: Optional[Callable[[str], None]] = None) -> list[dict]:
    """Every format's pass over window `wi`: per format {"sums": WindowSums} (+ "decode_times"
    for window 0). The bf16 reference runs first (or once more, when it is not a listed format,
    or when `cfg.approx` makes the listed bf16 pass approximate: the reference stays exact).
    The sums cover the window's scored predictions (`_forward`), by position too; they are formed
    after the last pass, from every pass's final hidden states (`metrics.hidden_window_sums`)."""
    ids = window[None]
    targets = window[-cfg.decode_tail:] if cfg.decode_tail else window[1:]
    positions = torch.arange(window.numel() - 1 - targets.numel(), window.numel() - 1)
    ref_choice = parse_choice(REFERENCE_FORMAT)
    order = sorted(range(len(choices)), key=lambda i: choices[i].label != ref_choice.label)
    ref_hidden = None
    if choices[order[0]].label != ref_choice.label or not cfg.approx.exact:
        ref_hidden = _forward(model, ids, ref_choice, cfg, exact=True)[0][:targets.numel()]
    parts: list = [{} for _ in choices]
    hidden: list = [None] * len(choices)
    for i in order:
        h, last, cache = _forward(model, ids, choices[i], cfg)
        hidden[i] = h[:targets.numel()]
        if choices[i].label == ref_choice.label and ref_hidden is None:
            ref_hidden = hidden[i]
        if wi == 0 and cfg.decode_steps:
            parts[i]["decode_times"] = _decode_times(model, cache, last, cfg.decode_steps)
        del cache, last, h
        if on_pass:
            on_pass(choices[i].label)
    sums = hidden_window_sums(output_head(model), hidden, targets.to(hidden[0].device), ref_hidden,
                              positions.to(hidden[0].device), window.numel())
    for part, ws in zip(parts, sums):
        part["sums"] = ws
    return parts


def output_head(model) -> Callable[[torch.Tensor], torch.Tensor]:
    """h [t, H] (final hidden states, after the last norm) -> float logits [t, V] as the model's
    forward forms them: its output embeddings, then the final soft-cap where the config has one
    (Gemma). `_forward` checks it against the model's own last logit row on every pass."""
    emb = model.get_output_embeddings()
    conf = text_config(model.config)
    cap = getattr(conf, "final_logit_softcapping", None)

    def head(h: torch.Tensor) -> torch.Tensor:
        x = emb(h).float()
        return x if cap is None else cap * torch.tanh(x / cap)

    return head


class _FinalHidden:
    """While open, records the decoder's output (final hidden states [T, H] of sequence 0) on
    every call of the model (a forward hook on `model.get_decoder()`)."""

    def __init__(self, model):
        self.rows: list = []
        self._handle = model.get_decoder().register_forward_hook(self._hook)

    def _hook(self, module, args, output) -> None:
        h = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
        self.rows.append(h[0].detach())

    def close(self) -> torch.Tensor:
        self._handle.remove()
        return torch.cat(self.rows)


def _check_head(model, hidden: torch.Tensor, last: torch.Tensor) -> None:
    """The metrics' logits (`output_head` of the hidden states) must be the model's: its last
    logit row against the head of the last hidden row; PagedKVError naming the gap otherwise."""
    want = last.reshape(-1).float()
    got = output_head(model)(hidden[-1:]).reshape(-1)
    gap = float((got - want.to(got.device)).abs().max())
    if not gap <= 1e-4 * max(1.0, float(want.abs().max())):
        raise PagedKVError(f"eval: this model's logits are not its output embeddings of the final hidden "
                           f"state (max gap {gap:.3g}); the eval cannot score it")


@torch.inference_mode()
def _forward(model, ids, choice: FormatChoice, cfg: EvalConfig, exact: bool = False):
    """(final hidden states [T, H] in the model's dtype and device, the last logit row float
    [1, 1, V], the cache) of one teacher-forced pass over ids [1, L] on a fresh cache of `choice`.
    Without a decode tail: one prefill, T = L (the last row predicts past the window). With tail
    N: a prefill of ids[:, :L-N-1] (none when that is empty), then ids[:, L-N-1:L-1] one token per
    call, T = N rows, each from a decode step, predicting the window's last N tokens; the cache
    then holds L - 1 tokens. The model forms only its last logit row where it allows it."""
    cache = cache_for(model, choice, cfg.block_size, checks=False,  # model K/V: skip NaN scans
                      approx=Approximation() if exact else cfg.approx)
    kw = with_cache(model, cache)
    keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    ids = ids.to(model.device)
    rec = _FinalHidden(model)
    try:
        if not cfg.decode_tail:
            last = model(ids, **kw, use_cache=True, **keep).logits[:, -1:]
        else:
            start = ids.shape[1] - 1 - cfg.decode_tail
            if start:  # not scored
                model(ids[:, :start], **kw, use_cache=True, **keep)
                rec.rows.clear()
            for p in range(start, ids.shape[1] - 1):
                last = model(ids[:, p:p + 1], **kw, use_cache=True).logits[:, -1:]
    finally:
        hidden = rec.close()
    _check_head(model, hidden, last)
    return hidden, last.float(), cache


@torch.inference_mode()
def _decode_times(model, cache, logits, steps: int) -> list[float]:
    """Seconds per greedy decode step continuing from the cache, at 1 thread. On the CPU the
    clock is the thread's CPU time (time.thread_time: the step computes in this thread, and
    the time the OS gives to other processes on a shared machine does not count), wall time on
    a GPU (synchronised)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        nxt = logits[:, -1].argmax(-1, keepdim=True).to(model.device)
        cuda = nxt.device.type == "cuda"
        clock = time.perf_counter if cuda else time.thread_time
        times = []
        kw = with_cache(model, cache)  # resolved once, outside the timed steps
        for _ in range(steps):
            t = clock()
            out = model(nxt, **kw, use_cache=True)
            if cuda:
                torch.cuda.synchronize()
            times.append(clock() - t)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        return times
    finally:
        torch.set_num_threads(threads)


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points (bits, error) not dominated by a cheaper-and-better one, by bits."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1]))
    front, best = [], math.inf
    for i in order:
        if points[i][1] < best:
            front.append(i)
            best = points[i][1]
    return front
