"""The per-layer transform of `PagedLayer` (k_mult, k_centre, v_centre), applied in one place.

Every backend's store and attention call these helpers, so the arithmetic (and therefore the
stored bytes) is the same everywhere:
- store: keys become `k * k_mult - k_centre` (the centre is subtracted by each store's own
  centring path, after `keys_to_store`), values `v - v_centre`;
- attention: q becomes `q / k_mult` before anything else (rotation, the k_centre logit term),
  so `(q / m) . (k * m - c) + (q / m) . c = q . k`; the output gains `v_centre * W` where W is
  the sum of the token weights (1 without sinks, 1 - the sinks' weight with them, 0 for an
  empty decode row), so `sum_j p_j (v_j - c) + W c = sum_j p_j v_j` exactly.
All tensors float32; [H, D] transform tensors are broadcast over each kv head's GQA group.
"""

from __future__ import annotations

from typing import Optional

import torch

from .batch import PagedLayer


def per_q_head(x: torch.Tensor, num_q_heads: int) -> torch.Tensor:
    """float32 [H, D] -> [Hq, D]: row h repeated for the Hq / H query heads of kv head h."""
    return x.repeat_interleave(num_q_heads // x.shape[0], dim=0)


def keys_to_store(layer: PagedLayer, k: torch.Tensor) -> torch.Tensor:
    """k float [T, H, D] -> what the store encodes before centring: k * k_mult (float32), or k
    itself (any float dtype) without a multiplier."""
    if layer.k_mult is None:
        return k
    return k.float() * layer.k_mult.to(k.device, torch.float32)


def query_for_keys(layer: PagedLayer, q: torch.Tensor) -> torch.Tensor:
    """q float [..., Hq, D] -> float32 q / k_mult (q.float() without a multiplier)."""
    qf = q.float()
    if layer.k_mult is None:
        return qf
    return qf / per_q_head(layer.k_mult.to(qf.device, torch.float32), q.shape[-2])


def add_value_centre(layer: PagedLayer, out: torch.Tensor, weight_sum: torch.Tensor) -> torch.Tensor:
    """out float32 [..., Hq, D] (original basis) += weight_sum [..., Hq] * v_centre; in place.

    weight_sum: the sum of each query head's token weights (see the module docstring)."""
    if layer.v_centre is not None:
        vc = per_q_head(layer.v_centre.to(out.device, torch.float32), out.shape[-2])
        out.add_(weight_sum.to(torch.float32)[..., None] * vc)
    return out


def rows_weight_sum(seq_lens: torch.Tensor, query_start_loc: torch.Tensor, num_q_heads: int,
                    device) -> torch.Tensor:
    """Token-weight sums without sinks: float32 [Tq, Hq], 1 for every query row of a sequence
    with keys, 0 for rows of an empty sequence (decode padding). Every query sees at least its
    own key (causal, any window), so the token weights of a non-empty row sum to one."""
    qsl = query_start_loc.to(device, torch.int64)
    q_lens = qsl[1:] - qsl[:-1]
    has_keys = (seq_lens.to(device) > 0).to(torch.float32)
    w = torch.repeat_interleave(has_keys, q_lens, output_size=int(qsl[-1]) if qsl.numel() else 0)
    return w[:, None].expand(-1, num_q_heads)


def check_values(layer: PagedLayer) -> Optional[str]:
    """None, or why the transform tensors' values are unusable (k_mult zero / non-finite,
    a centre non-finite): a value scan, run by the public ops when checks are on."""
    for name in ("k_mult", "k_centre", "v_centre"):
        x = getattr(layer, name)
        if x is not None and x.numel() and not bool(torch.isfinite(x).all()):
            return f"layer.{name} holds NaN or Inf values"
    if layer.k_mult is not None and bool((layer.k_mult == 0).any()):
        return "layer.k_mult holds zeros (attention divides q by it); use a nonzero multiplier"
    return None
