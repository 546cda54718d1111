"""Next-token metrics of teacher-forced logits: negative log-likelihood (for perplexity), KL
divergence against a reference distribution, and top-1 agreement.

All functions take logits float [T, V] for the positions that predict tokens 1..T of a window
(i.e. logits[:-1] of the forward pass) and return sums, so windows can be pooled exactly.

Long windows: the logits of a whole window ([T, V] fp32: 1.6 GB for 8k tokens of SmolLM2's
49k vocabulary, 17 GB for 16k of Gemma-3's 262k) are never held. `hidden_window_sums` takes
each format's final hidden states [T, H] and the model's output head, and forms the logits
POSITION_CHUNK_BYTES at a time, the reference's once per chunk for every format. The sums are
kept per position bucket too (`position_buckets`: 0-1k, 1-2k, 2-4k, 4-8k, ...), so that the error
of the late positions of a long window is read apart from the early ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

FIRST_BUCKET = 1024  # positions 0..1023; then each bucket doubles: 1k-2k, 2k-4k, ...
POSITION_CHUNK_BYTES = 1 << 26  # fp32 logits formed at a time per format (64 MiB)


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """float32 [T, V] log-softmax."""
    return torch.log_softmax(logits.float(), dim=-1)


def nll_sum(logp: torch.Tensor, targets: torch.Tensor) -> float:
    """Sum over T of -log p(target): logp float32 [T, V], targets int64 [T]."""
    return float(-logp.gather(1, targets[:, None]).sum())


def kl_sum(ref_logp: torch.Tensor, logp: torch.Tensor) -> float:
    """Sum over T of KL(ref || test) = sum_v p_ref (log p_ref - log p_test)."""
    return float((ref_logp.exp() * (ref_logp - logp)).sum())


def top1_matches(ref_logp: torch.Tensor, logp: torch.Tensor) -> int:
    """How many of the T positions have the same argmax token."""
    return int((ref_logp.argmax(-1) == logp.argmax(-1)).sum())


def position_buckets(length: int) -> list[tuple[int, int]]:
    """The position buckets [lo, hi) that cover positions 0..length-1: [0, 1k), [1k, 2k),
    [2k, 4k), [4k, 8k), ... (the last one cut at `length`)."""
    out, lo, hi = [], 0, FIRST_BUCKET
    while lo < length:
        out.append((lo, min(hi, length)))
        lo, hi = hi, 2 * hi
    return out


def bucket_label(lo: int, hi: int) -> str:
    """`0-1k`, `4-8k`, `8-16k`: the bucket of `position_buckets` starting at lo, by its full
    extent (a cut last bucket keeps its name: positions 4096..8190 of an 8k window are `4-8k`)."""
    top = FIRST_BUCKET if lo == 0 else 2 * lo
    return f"{lo // 1024}-{top // 1024}k"


@dataclass(frozen=True)
class BucketSums:
    """The sums of one window's predictions at positions lo <= p < hi (p: the index of the
    predicting row in the window, 0 = the first token)."""

    lo: int
    hi: int
    tokens: int
    nll: float
    kl: float | None
    top1: int


@dataclass(frozen=True)
class WindowSums:
    """One window's contribution for one format (picklable: eval workers send these)."""

    tokens: int
    nll: float
    kl: float | None  # None without a reference
    top1: int
    buckets: tuple = ()  # BucketSums by position, in order (none where the positions were not given)


def sums_by_position(nll: torch.Tensor, kl: Optional[torch.Tensor], top1: Optional[torch.Tensor],
                     positions: torch.Tensor, length: int) -> WindowSums:
    """WindowSums from per-prediction values: nll / kl float64 [T], top1 bool [T] (kl / top1 None
    without a reference), positions int64 [T] of the predicting rows in a window of `length`."""
    buckets = []
    for lo, hi in position_buckets(length):
        m = (positions >= lo) & (positions < hi)
        if not bool(m.any()):
            continue
        buckets.append(BucketSums(lo, hi, int(m.sum()), float(nll[m].sum()),
                                  None if kl is None else float(kl[m].sum()),
                                  0 if top1 is None else int(top1[m].sum())))
    return WindowSums(int(nll.numel()), float(nll.sum()), None if kl is None else float(kl.sum()),
                      0 if top1 is None else int(top1.sum()), tuple(buckets))


@torch.inference_mode()
def hidden_window_sums(head: Callable[[torch.Tensor], torch.Tensor], hidden: Sequence[torch.Tensor],
                       targets: torch.Tensor, ref: Optional[torch.Tensor], positions: torch.Tensor,
                       length: int) -> list[WindowSums]:
    """Every format's WindowSums of one window from final hidden states: hidden float [T, H] per
    format, ref [T, H] (the reference's) or None, targets int64 [T], positions int64 [T];
    head(h [t, H]) -> logits [t, V]. The logits are formed a chunk of positions at a time (module
    doc); per position the same numbers as `window_sums` on the whole logits."""
    t = int(targets.numel())
    vocab = int(head(hidden[0][:1]).shape[-1])
    step = max(1, POSITION_CHUNK_BYTES // (4 * vocab))
    nll = [torch.zeros(t, dtype=torch.float64) for _ in hidden]
    kl = [torch.zeros(t, dtype=torch.float64) for _ in hidden]
    top1 = [torch.zeros(t, dtype=torch.bool) for _ in hidden]
    for a in range(0, t, step):
        e = min(t, a + step)
        ref_lp = None if ref is None else log_probs(head(ref[a:e]))
        for i, h in enumerate(hidden):
            lp = log_probs(head(h[a:e]))
            nll[i][a:e] = -lp.gather(1, targets[a:e, None])[:, 0].double()
            if ref_lp is not None:
                kl[i][a:e] = (ref_lp.exp() * (ref_lp - lp)).sum(-1).double()
                top1[i][a:e] = ref_lp.argmax(-1) == lp.argmax(-1)
    return [sums_by_position(n, None if ref is None else k, None if ref is None else o, positions, length)
            for n, k, o in zip(nll, kl, top1)]


def window_sums(logits: torch.Tensor, targets: torch.Tensor, ref_logp: torch.Tensor | None) -> WindowSums:
    """The sums of one window: logits float [T, V], targets int64 [T], ref_logp [T, V] or None."""
    lp = log_probs(logits)
    if ref_logp is None:
        return WindowSums(int(targets.numel()), nll_sum(lp, targets), None, 0)
    return WindowSums(int(targets.numel()), nll_sum(lp, targets), kl_sum(ref_logp, lp), top1_matches(ref_logp, lp))


@dataclass
class MetricSums:
    """Running sums over windows for one format (added in window order, so a run split over
    worker processes sums the same floats in the same order as one process)."""

    tokens: int = 0
    nll: float = 0.0
    kl: float = 0.0
    top1: int = 0
    per_window_kl: list = field(default_factory=list)
    # by position bucket (lo, hi): [tokens, nll, kl, top1, per-window mean KL list]
    buckets: dict = field(default_factory=dict)

    def add(self, logits: torch.Tensor, targets: torch.Tensor, ref_logp: torch.Tensor | None) -> None:
        self.add_window(window_sums(logits, targets, ref_logp))

    def add_window(self, w: WindowSums) -> None:
        self.tokens += w.tokens
        self.nll += w.nll
        if w.kl is not None:
            self.kl += w.kl
            self.per_window_kl.append(w.kl / w.tokens)
            self.top1 += w.top1
        for b in w.buckets:
            acc = self.buckets.setdefault((b.lo, b.hi), [0, 0.0, 0.0, 0, []])
            acc[0] += b.tokens
            acc[1] += b.nll
            if b.kl is not None:
                acc[2] += b.kl
                acc[3] += b.top1
                acc[4].append(b.kl / b.tokens)

    def by_position(self) -> list[dict]:
        """Per position bucket, in order: positions (`4-8k`), lo, hi, tokens, ppl, kl (mean),
        top1, kl_per_window (each window's mean over the bucket); kl / top1 None without a reference."""
        out = []
        for (lo, hi), (n, nll, kl, top1, per) in sorted(self.buckets.items()):
            out.append({"positions": bucket_label(lo, hi), "lo": lo, "hi": hi, "tokens": n,
                        "ppl": math.exp(nll / n), "kl": kl / n if per else None,
                        "top1": top1 / n if per else None, "kl_per_window": list(per)})
        return out

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.tokens) if self.tokens else float("nan")

    @property
    def mean_kl(self) -> float:
        return self.kl / self.tokens if self.tokens else float("nan")

    @property
    def top1_rate(self) -> float:
        return self.top1 / self.tokens if self.tokens else float("nan")
