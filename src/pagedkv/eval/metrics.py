"""Next-token metrics of teacher-forced logits: negative log-likelihood (for perplexity), KL
divergence against a reference distribution, and top-1 agreement.

All functions take logits float [T, V] for the positions that predict tokens 1..T of a window
(i.e. logits[:-1] of the forward pass) and return sums, so windows can be pooled exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


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


@dataclass(frozen=True)
class WindowSums:
    """One window's contribution for one format (picklable: eval workers send these)."""

    tokens: int
    nll: float
    kl: float | None  # None without a reference
    top1: int


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

    def add(self, logits: torch.Tensor, targets: torch.Tensor, ref_logp: torch.Tensor | None) -> None:
        self.add_window(window_sums(logits, targets, ref_logp))

    def add_window(self, w: WindowSums) -> None:
        self.tokens += w.tokens
        self.nll += w.nll
        if w.kl is not None:
            self.kl += w.kl
            self.per_window_kl.append(w.kl / w.tokens)
            self.top1 += w.top1

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.tokens) if self.tokens else float("nan")

    @property
    def mean_kl(self) -> float:
        return self.kl / self.tokens if self.tokens else float("nan")

    @property
    def top1_rate(self) -> float:
        return self.top1 / self.tokens if self.tokens else float("nan")
