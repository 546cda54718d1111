"""Reference store: encode new K/V rows and scatter them into their slots of the block pools.

Readable torch, any device; the oracle the fast stores are checked against (byte-exact).
"""

from __future__ import annotations

from typing import Optional

import torch

from ...codecs import reference as codec_ref
from ...codecs.catalogue import Codec, ScaleType
from ...codecs.layout import block_views
from .. import transform
from ..batch import PagedLayer


def tensor_scale(codec: Codec, scale: torch.Tensor) -> Optional[float]:
    """The fp32 per-layer tensor scale as a float for codecs that use one (fp8), else None."""
    return float(scale.reshape(-1)[0]) if codec.scale_type is ScaleType.TENSOR_FP32 else None


def _encode_side(codec: Codec, scale: torch.Tensor, x: torch.Tensor, keep: torch.Tensor):
    """(data, scales) of the kept rows of x float [T, H, D]; raises before anything is written."""
    return codec_ref.encode(codec, x[keep], tensor_scale(codec, scale))


def _write_side(layer: PagedLayer, codec: Codec, pool: torch.Tensor, slots: torch.Tensor,
                data: torch.Tensor, scales: torch.Tensor) -> None:
    data_view, scale_view = block_views(codec, pool, layer.block_size, layer.num_kv_heads, layer.head_dim)
    blocks, offsets = slots // layer.block_size, slots % layer.block_size
    data_view[blocks, offsets] = data
    if scales.shape[-1]:
        scale_view[blocks, offsets] = scales


def store_side(layer: PagedLayer, codec: Codec, pool: torch.Tensor, scale: torch.Tensor,
               x: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Encode x float [T, H, D] with `codec` and write row t to slot `slot_mapping[t]` of `pool`.

    Negative slots are skipped (padding tokens). slot = block_id * block_size + offset.
    """
    keep = slot_mapping >= 0
    if not bool(keep.any()):
        return
    data, scales = _encode_side(codec, scale, x, keep)
    _write_side(layer, codec, pool, slot_mapping[keep].long(), data, scales)


def store(layer: PagedLayer, k: Optional[torch.Tensor], v: Optional[torch.Tensor],
          slot_mapping: torch.Tensor) -> None:
    """Write new keys and values into the layer's pools.

    k, v: float [T, num_kv_heads, head_dim] (either may be None to store one side only);
    slot_mapping: int64 [T], negative = skip. Keys are stored as k * layer.k_mult -
    layer.k_centre, values as v - layer.v_centre (each term when set, `pagedkv.ops.transform`);
    fp8 uses layer.k_scale / layer.v_scale as its tensor scale. Both sides are encoded before
    either is written, so an encode error (e.g. NaN with checks off) leaves the pools unchanged.
    """
    keep = slot_mapping >= 0
    if not bool(keep.any()):
        return
    encoded = []
    if k is not None:
        kf = transform.keys_to_store(layer, k).float()
        if layer.k_centre is not None:
            kf = kf - layer.k_centre.to(kf.device, torch.float32)
        encoded.append((layer.k_codec, layer.k_pool, _encode_side(layer.k_codec, layer.k_scale, kf, keep)))
    if v is not None:
        vf = v.float()
        if layer.v_centre is not None:
            vf = vf - layer.v_centre.to(vf.device, torch.float32)
        encoded.append((layer.v_codec, layer.v_pool, _encode_side(layer.v_codec, layer.v_scale, vf, keep)))
    slots = slot_mapping[keep].long()
    for codec, pool, (data, scales) in encoded:
        _write_side(layer, codec, pool, slots, data, scales)
