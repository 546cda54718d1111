"""The paged storage of one latent (MLA) layer: one pool holding `[latent | rope]` per token.

DeepSeek-style multi-head latent attention caches, per token, one latent vector `c` (e.g. 512
dims, the KV compression after its RMSNorm) and one rotary key `k_rope` (e.g. 64 dims, after
RoPE), shared by every head: `c` serves as the keys' no-position part AND as the values (both
through absorbed projections), `k_rope` as the keys' rotary part. So a latent layer has ONE pool,
not a K and a V pool, and its bytes per token are per latent, not per head.

Block layout (a block = `block_size` token slots, one block id addresses the same slots in every
layer, as for K/V layers):
- uniform (the rope part uses the latent codec): the block is exactly one codec block of
  `num_kv_heads = 1`, `head_dim = latent_dim + rope_dim` (docs/internals.md: data section of
  token-major rows `[latent | rope]`, then the scale section). Rotated codecs rotate the row with
  the block-diagonal WHT (576 = 512 + 64: the latent and the rope part are rotated separately).
  This is a plain `PagedLayer` (K pool == V pool), so every attention backend serves it as MQA
  with one KV head whose values are the keys; the output's first `latent_dim` dims are the
  latent attention output.
- mixed (the rope part in another codec, e.g. bf16 rope beside turbo3 latent): the block is the
  latent codec's block of `[block_size, 1, latent_dim]` followed by the rope codec's block of
  `[block_size, 1, rope_dim]`; each section is a `PagedLayer` over a column slice of the pool.

fp8 keeps one fp32 tensor scale per section (`latent_scale`, `rope_scale`); a uniform layout has
one section and uses `latent_scale` for the whole row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..codecs.catalogue import Codec
from ..errors import ConfigError
from .batch import PagedLayer


def _pos_int(name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {v!r}")


@dataclass(frozen=True)
class LatentSpec:
    """Dims and codecs of a latent layer. latent_dim: e.g. 512 (kv_lora_rank); rope_dim: e.g. 64
    (qk_rope_head_dim). The rope part uses `rope_codec` (== latent_codec: uniform layout)."""

    latent_dim: int
    rope_dim: int
    latent_codec: Codec
    rope_codec: Codec

    def __post_init__(self) -> None:
        _pos_int("latent_dim", self.latent_dim)
        _pos_int("rope_dim", self.rope_dim)
        for name in ("latent_codec", "rope_codec"):
            if not isinstance(getattr(self, name), Codec):
                raise ConfigError(f"{name} must be a Codec (pagedkv.codecs.get_codec), got "
                                  f"{getattr(self, name)!r}")
        if self.uniform:
            self.latent_codec.check_head_dim(self.latent_dim + self.rope_dim)
        else:
            self.latent_codec.check_head_dim(self.latent_dim)
            self.rope_codec.check_head_dim(self.rope_dim)

    @property
    def uniform(self) -> bool:
        """True when the rope part uses the latent codec (one section of latent+rope dims)."""
        return self.latent_codec == self.rope_codec

    @property
    def name(self) -> str:
        """`turbo3` (uniform) or `turbo3+bf16rope` (mixed)."""
        if self.uniform:
            return self.latent_codec.name
        return f"{self.latent_codec.name}+{self.rope_codec.name}rope"

    def section_dims(self) -> tuple[tuple[Codec, int], ...]:
        """(codec, dims) of each section in block order."""
        if self.uniform:
            return ((self.latent_codec, self.latent_dim + self.rope_dim),)
        return ((self.latent_codec, self.latent_dim), (self.rope_codec, self.rope_dim))

    def section_bytes(self, block_size: int) -> tuple[int, ...]:
        return tuple(c.block_bytes(block_size, 1, d) for c, d in self.section_dims())

    def block_bytes(self, block_size: int) -> int:
        """Bytes of one block of this layer (all sections)."""
        return sum(self.section_bytes(block_size))

    def bytes_per_token(self) -> float:
        """Exact stored bytes per token (block bytes / block size; independent of block size)."""
        return self.block_bytes(16) / 16

    @property
    def elements(self) -> int:
        """Stored elements per token (latent + rope)."""
        return self.latent_dim + self.rope_dim


@dataclass(frozen=True, eq=False)
class LatentLayer:
    """One latent layer's paged storage.

    pool: uint8 [num_blocks, spec.block_bytes(block_size)]. latent_scale, rope_scale: float32 [1],
    fp8 tensor scales (1.0 for other codecs; a uniform layout uses latent_scale for the whole row).
    """

    pool: torch.Tensor
    spec: LatentSpec
    block_size: int
    latent_scale: torch.Tensor
    rope_scale: torch.Tensor

    @property
    def num_blocks(self) -> int:
        return int(self.pool.shape[0])

    @property
    def device(self) -> torch.device:
        return self.pool.device

    @property
    def latent_dim(self) -> int:
        return self.spec.latent_dim

    @property
    def rope_dim(self) -> int:
        return self.spec.rope_dim

    def sections(self) -> tuple[PagedLayer, ...]:
        """The pool's sections as PagedLayers of one KV head whose V pool is the K pool.

        uniform: (row [latent | rope] of latent_dim + rope_dim,); mixed: (latent, rope), each a
        column slice of `pool` (views: writing a section writes the pool)."""
        out, start = [], 0
        scales = (self.latent_scale, self.rope_scale)
        for i, ((codec, dims), nbytes) in enumerate(zip(self.spec.section_dims(),
                                                         self.spec.section_bytes(self.block_size))):
            part = self.pool[:, start:start + nbytes]
            out.append(PagedLayer(k_pool=part, v_pool=part, k_codec=codec, v_codec=codec,
                                  block_size=self.block_size, num_kv_heads=1, head_dim=dims,
                                  k_scale=scales[i], v_scale=scales[i]))
            start += nbytes
        return tuple(out)


def make_latent_layer(spec: LatentSpec, num_blocks: int, block_size: int, *,
                      latent_scale: float = 1.0, rope_scale: float = 1.0,
                      device: torch.device | str = "cpu") -> LatentLayer:
    """A LatentLayer with a zeroed pool uint8 [num_blocks, spec.block_bytes(block_size)]."""
    if not isinstance(spec, LatentSpec):
        raise ConfigError(f"spec must be a LatentSpec, got {type(spec).__name__}")
    _pos_int("num_blocks", num_blocks)
    _pos_int("block_size", block_size)
    for name, v in (("latent_scale", latent_scale), ("rope_scale", rope_scale)):
        if not (isinstance(v, (int, float)) and 0 < float(v) < float("inf")):
            raise ConfigError(f"{name} must be a finite number > 0, got {v!r}")
    return LatentLayer(
        pool=torch.zeros(num_blocks, spec.block_bytes(block_size), dtype=torch.uint8, device=device),
        spec=spec, block_size=block_size,
        latent_scale=torch.tensor([float(latent_scale)], dtype=torch.float32, device=device),
        rope_scale=torch.tensor([float(rope_scale)], dtype=torch.float32, device=device),
    )
