"""Measure what a sparse-V threshold costs on real inputs: skipped V rows and the error.

Sparse V must be measured, never silent (see docs/internals.md "Sparse V"): this runs decode
attention exactly and with the threshold on the same inputs and reports how much V it skips and
how far the output moves. Attention weights near-uniform over a long context fall below any fixed
threshold (at 4k tokens a flat head has p ~ 2.4e-4 < 1e-3), so the error depends on the heads.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..batch import AttentionParams, PagedLayer
from .attention import _sequence_kv, attend, attention_weights


@dataclass(frozen=True)
class SparseVStats:
    """skipped: fraction of (query head, position) V reads skipped; dropped_mass_mean / _max:
    softmax weight dropped per query head (mean / worst); rel_error: ||o_sparse - o|| / ||o||
    over the batch; max_abs_error: worst element of |o_sparse - o|."""

    threshold: float
    skipped: float
    dropped_mass_mean: float
    dropped_mass_max: float
    rel_error: float
    max_abs_error: float


def measure_sparse_v(q: torch.Tensor, layer: PagedLayer, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, params: AttentionParams) -> SparseVStats:
    """Decode inputs as for `decode_attention` (q float [B, Hq, D]); params.sparse_v_threshold > 0."""
    t = params.sparse_v_threshold
    exact_params = replace(params, sparse_v_threshold=0.0)
    skipped = total = 0
    masses, diffs, refs = [], [], []
    for b, n in enumerate(seq_lens.tolist()):
        if n == 0:
            continue
        k, v = _sequence_kv(layer, block_tables[b], n)
        pos = torch.tensor([n - 1], device=q.device)
        exact = attend(q[b : b + 1], k, v, pos, layer, exact_params)
        sparse = attend(q[b : b + 1], k, v, pos, layer, params)
        weights = attention_weights(q[b : b + 1], k, pos, layer, exact_params)  # [H, G, 1, n]
        small = weights < t
        skipped += int(small.sum())
        total += small.numel()
        masses.append((weights * small).sum(-1).flatten())
        diffs.append(sparse - exact)
        refs.append(exact)
    mass = torch.cat(masses) if masses else torch.zeros(1)
    diff, ref = (torch.cat(diffs), torch.cat(refs)) if diffs else (torch.zeros(1), torch.ones(1))
    return SparseVStats(
        threshold=t,
        skipped=skipped / max(total, 1),
        dropped_mass_mean=float(mass.mean()),
        dropped_mass_max=float(mass.max()),
        rel_error=float(diff.norm() / ref.norm().clamp_min(1e-30)),
        max_abs_error=float(diff.abs().max()),
    )

