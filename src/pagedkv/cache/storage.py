"""The tensors of a paged cache: per layer a K pool and a V pool (or one latent pool), built
from the catalogue by `build_layer`, the one layer builder of every front door.

Layer i's pools are uint8 `[num_blocks, spec.k_block_bytes]` and `[num_blocks, spec.v_block_bytes]`
(each side its own stride: asymmetric formats differ), zero-filled on `config.device`, wrapped in a
`pagedkv.ops.batch.PagedLayer` together with the fp8 per-layer scales (float32 [1], 1.0 until
configured) and the optional key centre. Block id b addresses the same token slots in every layer.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from ..codecs import reference as codec_ref
from ..codecs.catalogue import ScaleType
from ..codecs.layout import block_views
from ..ops.batch import PagedLayer, make_layer
from ..ops.latent_layer import LatentLayer, make_latent_layer
from .config import CacheConfig, LayerSpec


def build_layer(spec: LayerSpec, num_blocks: int, block_size: int, device: torch.device,
                key_centring: bool = False) -> Union[PagedLayer, LatentLayer]:
    """Zeroed pools for one layer, sized from its format (exact catalogue bytes, no padding):
    the one builder every front door uses. A latent spec (MLA) gets a `LatentLayer` (one pool,
    `ops.latent`), a K/V spec a `PagedLayer` (`ops.batch.make_layer`: fp8 scales 1.0, a zero
    key centre when `key_centring`)."""
    if spec.latent is not None:
        return make_latent_layer(spec.latent, num_blocks, block_size, device=device)
    f = spec.format
    pl = make_layer(f.k, f.v, num_blocks, block_size, spec.num_kv_heads, spec.head_dim,
                    k_centre=(torch.zeros(spec.num_kv_heads, spec.head_dim) if key_centring
                              else None), device=device)
    assert pl.k_pool.shape[1] == spec.k_block_bytes and pl.v_pool.shape[1] == spec.v_block_bytes
    return pl


def build_layers(config: CacheConfig) -> tuple[PagedLayer, ...]:
    n = config.total_blocks
    return tuple(build_layer(s, n, config.block_size, config.device, config.key_centring)
                 for s in config.layers)


def copy_blocks(layers: tuple[PagedLayer, ...], copies: list[tuple[int, int]]) -> None:
    """Copy block src -> dst in both pools of every layer (copy-on-write). copies: [(src, dst)]."""
    if not copies:
        return
    dev = layers[0].device
    src = torch.tensor([c[0] for c in copies], dtype=torch.int64, device=dev)
    dst = torch.tensor([c[1] for c in copies], dtype=torch.int64, device=dev)
    for pl in layers:
        pl.k_pool[dst] = pl.k_pool[src]
        pl.v_pool[dst] = pl.v_pool[src]


def _tensor_scale(pl_codec, scale: torch.Tensor) -> Optional[float]:
    return float(scale.item()) if pl_codec.scale_type is ScaleType.TENSOR_FP32 else None


def gather_side(pl: PagedLayer, side: str, slots: torch.Tensor) -> torch.Tensor:
    """Decode the rows at `slots` (int64 [n]) of one side -> float32 [n, H, D] in the basis the
    model produced: unrotated, the layer transform undone (keys are stored as
    `k * k_mult - k_centre`, values as `v - v_centre`)."""
    codec, pool, scale = ((pl.k_codec, pl.k_pool, pl.k_scale) if side == "k"
                          else (pl.v_codec, pl.v_pool, pl.v_scale))
    dv, sv = block_views(codec, pool, pl.block_size, pl.num_kv_heads, pl.head_dim)
    blocks, offs = slots // pl.block_size, slots % pl.block_size
    out = codec_ref.decode(codec, dv[blocks, offs], sv[blocks, offs], pl.head_dim,
                           _tensor_scale(codec, scale))
    if side == "k":
        if pl.k_centre is not None:
            out = out + pl.k_centre
        if pl.k_mult is not None:
            out = out / pl.k_mult
    elif pl.v_centre is not None:
        out = out + pl.v_centre
    return out
