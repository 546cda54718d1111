"""One vLLM block = one pagedkv block: the page geometry and the pool views, without vLLM.

vLLM allocates each layer's cache as a uint8 tensor viewed `[num_blocks, H, N, C]` (N = tokens
per block, H = KV heads, C = `state_content_bytes`, the layout LBHNC: every block's H*N*C bytes
contiguous). pagedkv asks for C = the K row bytes plus the V row bytes of one (token, head) of
the layer's format, so a page is exactly the layer's K block followed by its V block, as sized
by the catalogue; the K and V pools are then two strided 2-D views of the same memory (row
stride = the page stride, contiguous bytes within a row), which the ops and the C kernels take
as they are (they read `pool.stride(0)`).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

from ...cache.config import CacheConfig
from ...errors import ConfigError
from ...formats import KVFormat
from ...ops.batch import PagedLayer
from ...cache.calibration import Calibration


def layer_formats(kv_format, high_precision_layers, hp_format, num_layers: int,
                  layer_dims: Sequence[tuple[int, int]]) -> tuple[KVFormat, ...]:
    """Every attention layer's format after the high-precision policy (pagedkv's CacheConfig:
    the same names give the same formats as in the transformers cache). ConfigError for an
    unknown name, a per-layer list of the wrong length or a head_dim a codec cannot store."""
    cfg = CacheConfig(num_layers=num_layers, num_kv_heads=layer_dims[0][0], head_dim=layer_dims[0][1],
                      layer_dims=tuple(layer_dims), kv_format=kv_format,
                      high_precision_layers=high_precision_layers, hp_format=hp_format, num_blocks=1)
    return cfg.layer_formats


def content_bytes(fmt: KVFormat, head_dim: int) -> int:
    """C: the bytes of one (token, KV head) cell: K row data + scales, then V row data + scales."""
    return sum(c.row_data_bytes(head_dim) + c.row_scale_bytes(head_dim) for c in (fmt.k, fmt.v))


def page_bytes(fmt: KVFormat, block_size: int, num_kv_heads: int, head_dim: int) -> int:
    """The catalogue's bytes of one block of one layer, K and V."""
    return fmt.k_block_bytes(block_size, num_kv_heads, head_dim) + fmt.v_block_bytes(block_size, num_kv_heads, head_dim)


def check_geometry(fmt: KVFormat, block_size: int, num_kv_heads: int, head_dim: int) -> None:
    """The page (H * N * C) must be exactly the catalogue's K + V block; ConfigError otherwise."""
    cells = block_size * num_kv_heads * content_bytes(fmt, head_dim)
    want = page_bytes(fmt, block_size, num_kv_heads, head_dim)
    if cells != want:
        raise ConfigError(f"pagedkv format {fmt.name} with head_dim {head_dim}, {num_kv_heads} KV heads and "
                          f"block size {block_size} does not fill whole (token, head) cells "
                          f"({cells} != {want} bytes per block)")


def paged_layer(kv_cache: torch.Tensor, fmt: KVFormat, num_kv_heads: int, head_dim: int,
                cal: Optional[Calibration]) -> PagedLayer:
    """The PagedLayer over vLLM's page tensor (uint8 [num_blocks, H, N, C], block-contiguous);
    ConfigError unless the page is the format's (`check_geometry`)."""
    if kv_cache.dtype != torch.uint8 or kv_cache.dim() != 4:
        raise ConfigError(f"pagedkv expects vLLM's KV cache as uint8 [blocks, H, N, C], got "
                          f"{kv_cache.dtype} {tuple(kv_cache.shape)}")
    nb, h, n, c = kv_cache.shape
    if h != num_kv_heads or c != content_bytes(fmt, head_dim):
        raise ConfigError(f"pagedkv: vLLM's page {tuple(kv_cache.shape)} does not match format {fmt.name} "
                          f"({num_kv_heads} KV heads, {content_bytes(fmt, head_dim)} bytes per cell)")
    check_geometry(fmt, n, num_kv_heads, head_dim)
    s = kv_cache.stride()
    if s[3] != 1 or s[2] != c or s[1] != n * c:
        raise ConfigError(f"pagedkv needs block-contiguous pages (layout LBHNC or BLHNC), got strides {s}")
    kb = fmt.k_block_bytes(n, h, head_dim)
    vb = fmt.v_block_bytes(n, h, head_dim)
    base = kv_cache.storage_offset()
    k_pool = kv_cache.as_strided((nb, kb), (s[0], 1), base)
    v_pool = kv_cache.as_strided((nb, vb), (s[0], 1), base + kb)
    one = torch.ones(1, dtype=torch.float32, device=kv_cache.device)
    cal = cal or Calibration()
    dev = kv_cache.device
    return PagedLayer(
        k_pool=k_pool, v_pool=v_pool, k_codec=fmt.k, v_codec=fmt.v, block_size=n,
        num_kv_heads=h, head_dim=head_dim,
        k_scale=one if cal.k_scale is None else cal.k_scale.to(dev, torch.float32),
        v_scale=one.clone() if cal.v_scale is None else cal.v_scale.to(dev, torch.float32),
        **{name: _stat(getattr(cal, name), dev) for name in ("k_centre", "k_mult", "v_centre")},
    )


def tail_layer(kv_cache: torch.Tensor, codec, num_kv_heads: int, head_dim: int,
               cal: Optional[Calibration]) -> PagedLayer:
    """The recent window's tail over vLLM's tail page (its own block size): `codec` on both
    sides, the layer's transform (key centre and multipliers, value centre: the tail stores the
    same transformed rows as the pages, as `cache.storage.build_tail`), unit tensor scales."""
    cal = dataclasses.replace(cal or Calibration(), k_scale=None, v_scale=None)
    return paged_layer(kv_cache, KVFormat(codec, codec), num_kv_heads, head_dim, cal)


def _stat(x: Optional[torch.Tensor], device) -> Optional[torch.Tensor]:
    return None if x is None else x.to(device, torch.float32).contiguous()
