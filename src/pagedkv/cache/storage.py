"""The tensors of a paged cache: per layer a K pool and a V pool (or one latent pool), built
from the catalogue by `build_layer`, the one layer builder of every front door.

Layer i's pools are uint8 `[num_blocks, spec.k_block_bytes]` and `[num_blocks, spec.v_block_bytes]`
(each side its own stride: asymmetric formats differ), zero-filled on `config.device`, wrapped in a
`pagedkv.ops.batch.PagedLayer` together with the fp8 per-layer scales (float32 [1], 1.0 until
configured) and the optional key centre. Block id b addresses the same token slots in every layer.
"""

from __future__ import annotations

import dataclasses
from hashlib import blake2b
from typing import Optional, Union

import torch

from ..alloc.swapstate import RELEASED
from ..codecs import reference as codec_ref
from ..codecs.catalogue import Codec, ScaleType
from ..codecs.layout import block_views
from ..ops.batch import PagedLayer, make_layer
from ..ops.latent_layer import LatentLayer, make_latent_layer
from .config import LayerSpec


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


def pool_names(layer) -> tuple[str, ...]:
    """The pool fields of a layer: ("pool",) for a `LatentLayer`, ("k_pool", "v_pool") else."""
    return ("pool",) if isinstance(layer, LatentLayer) else ("k_pool", "v_pool")


def layer_bytes(layer) -> tuple[int, int]:
    """(K bytes, V bytes) of a layer's pools as allocated (a latent layer: (pool bytes, 0))."""
    return tuple(int(getattr(layer, n).numel()) for n in pool_names(layer)) + \
        ((0,) if isinstance(layer, LatentLayer) else ())


def record_member(layer) -> PagedLayer:
    """The layer as swap records and the prefix store see it (`offload.record`: K bytes, V bytes
    and what they mean per block): a `PagedLayer` itself; a `LatentLayer` as a PagedLayer whose
    K pool is its whole pool (every section of a block), whose V pool is empty, with the latent
    and rope codecs and fp8 scales as K's and V's (so both are in the record's meaning)."""
    if not isinstance(layer, LatentLayer):
        return layer
    s = layer.spec
    return PagedLayer(k_pool=layer.pool, v_pool=layer.pool[:, :0], k_codec=s.latent_codec,
                      v_codec=s.rope_codec, block_size=layer.block_size, num_kv_heads=1,
                      head_dim=s.elements, k_scale=layer.latent_scale, v_scale=layer.rope_scale)


def from_record_member(layer, member: PagedLayer):
    """`layer` with the pools of `member` (a `record_member` of it, e.g. a swap read-back view)."""
    if not isinstance(layer, LatentLayer):
        return member
    return dataclasses.replace(layer, pool=member.k_pool)


def apply_group_step(layer, step, names: Optional[tuple[str, ...]] = None):
    """One block group's plan step (`alloc.manager.GroupStep`) applied to a layer's pools: block
    moves then a cut to `step.num_blocks` (new tensors, so the memory is returned), or growth;
    then the copy-on-write copies. Returns the layer with its new pools (a `PagedLayer`, a
    `LatentLayer`, or a tail; names: the pool fields, default `pool_names(layer)`); the one
    place pools are resized."""
    changes = {}
    for name in names or pool_names(layer):
        pool = getattr(layer, name)
        if step.moves:
            src = torch.tensor([m[0] for m in step.moves], device=pool.device)
            pool[torch.tensor([m[1] for m in step.moves], device=pool.device)] = pool[src]
        if pool.shape[0] > step.num_blocks:
            pool = pool[:step.num_blocks].clone()
        elif pool.shape[0] < step.num_blocks:
            grown = torch.zeros(step.num_blocks, pool.shape[1], dtype=pool.dtype, device=pool.device)
            grown[:pool.shape[0]] = pool
            pool = grown
        if step.copies:
            src = torch.tensor([c[0] for c in step.copies], device=pool.device)
            pool[torch.tensor([c[1] for c in step.copies], device=pool.device)] = pool[src]
        changes[name] = pool
    return dataclasses.replace(layer, **changes)


def build_tail(main: PagedLayer, codec: Codec, num_blocks: int) -> PagedLayer:
    """The high-precision recent window's tail of layer `main` (`ops.recent`): `codec` on both
    sides, zeroed pools of `num_blocks` blocks (its own block group), the layer's transform (key
    centre and multipliers, value centre: the tail stores the same transformed rows) and unit
    tensor scales (a tail codec is never tensor-scaled)."""
    shape = (num_blocks, codec.block_bytes(main.block_size, main.num_kv_heads, main.head_dim))
    dev = main.device
    return dataclasses.replace(
        main, k_codec=codec, v_codec=codec,
        k_pool=torch.zeros(shape, dtype=torch.uint8, device=dev),
        v_pool=torch.zeros(shape, dtype=torch.uint8, device=dev),
        k_scale=torch.ones(1, dtype=torch.float32, device=dev),
        v_scale=torch.ones(1, dtype=torch.float32, device=dev))


def with_transform(tail: PagedLayer, main: PagedLayer) -> PagedLayer:
    """`tail` carrying `main`'s transform (after the main layer's transform changed)."""
    return dataclasses.replace(tail, k_centre=main.k_centre, k_mult=main.k_mult,
                               v_centre=main.v_centre)


def transform_namespace(fingerprint: bytes, layers) -> bytes:
    """The prefix-key namespace of a cache whose layers carry `layers`' transforms: the config
    fingerprint itself while every layer has the default transform (unit fp8 scales, no or zero
    key centre, no multipliers, no value centre), else a digest of the fingerprint and every
    non-default transform tensor, so caches with different transforms never share a key."""
    h = blake2b(fingerprint, digest_size=16, person=b"pagedkv-xform")
    default = True
    for i, pl in enumerate(layers):
        for name in ("k_scale", "v_scale", "k_centre", "k_mult", "v_centre"):
            t = getattr(pl, name, None)
            if t is None or (name in ("k_scale", "v_scale") and bool((t == 1).all())) \
                    or (name == "k_centre" and not bool(t.any())):
                continue
            default = False
            h.update(f"|{i}:{name}:".encode() + t.detach().to("cpu", torch.float32).numpy().tobytes())
    return fingerprint if default else h.digest()


def _tensor_scale(pl_codec, scale: torch.Tensor) -> Optional[float]:
    return float(scale.item()) if pl_codec.scale_type is ScaleType.TENSOR_FP32 else None


def sequence_rows(table_row: torch.Tensor, entries, n: int, block_size: int,
                  device) -> tuple[torch.Tensor, torch.Tensor]:
    """The slots of a sequence's n stored positions (int64 [n], from its block-table row) and
    which of them sit in a block a sliding window released (bool [n]; `entries`: the group's
    table entries of the sequence), for `gather_side`-style reads (tests, oracles)."""
    pos = torch.arange(n, device=device)
    slots = table_row.long()[pos // block_size] * block_size + pos % block_size
    released = torch.tensor([e == RELEASED for e in entries], dtype=torch.bool)
    return slots, released[pos.cpu() // block_size].to(device)


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
