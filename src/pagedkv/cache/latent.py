"""Latent (MLA) layer layout for `CacheConfig(latent=LatentLayout(...))`.

A DeepSeek-style layer caches one `[latent | rope]` vector per token (kv_lora_rank +
qk_rope_head_dim, e.g. 512 + 64) shared by every head, in one pool (see
`pagedkv.ops.latent_layer`). With `CacheConfig(latent=...)` every layer is latent: its LayerSpec
has `num_kv_heads = 1`, `head_dim = latent_dim + rope_dim`, `k_block_bytes` = the pool's block
bytes, `v_block_bytes = 0` and `latent` = the resolved `LatentSpec`.

Codecs: the latent serves as both K and V, so it takes the MORE precise codec of the layer's
format pair (`turbo3` -> turbo3; `bf16k_turbo3v` -> bf16), high-precision layers included.
The rope part: `rope_format=None` ("auto") picks by measurement (`benchmarks/studies/mla_rope_precision.py`,
numbers in docs/mla.md, attention output error vs fp32):
- fp8 and turbo8 latents keep the rope part in q8_0: fp8 + q8_0 rope cuts the error by 12 % (34 %
  with strong rope outliers) for +4 bytes/token (+0.7 %); turbo8 + q8_0 rope is both smaller
  (644 vs 648 B/token at 512+64) and more accurate. (q8_0 needs rope_dim % 32 == 0, else same.)
- every other codec keeps one codec for the row: a q8_0/bf16 rope part lowers the error by
  ~3-12 % for +10-20 % bytes, ~5x less error per byte than giving the latent the next codec up
  (turbo3 -> turbo4), and a uniform row is served by the fused kernels as MQA (a mixed layout
  runs the chunked torch path, ~2.5x slower decode on CPU).
`rope_format="same"` forces one codec; a codec name forces that codec.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from ..codecs.catalogue import Codec, get_codec
from ..codecs.derive import DecodeKind
from ..errors import ConfigError
from ..formats import KVFormat
from ..ops.latent_layer import LatentSpec


# the rope codec of an 8-bit float (E4M3-valued) latent, chosen by measurement (module doc);
# every other latent keeps its own codec for the rope part
E4M3_LATENT_ROPE = "q8_0"


def auto_rope_codec(latent: Codec) -> Optional[Codec]:
    """The measured rope codec for `latent` (derived from its row: E4M3 values, i.e. fp8 and
    turbo8 today), or None = the latent's own codec."""
    return get_codec(E4M3_LATENT_ROPE) if latent.traits.decode is DecodeKind.E4M3 else None


@dataclass(frozen=True)
class LatentLayout:
    """latent_dim (kv_lora_rank), rope_dim (qk_rope_head_dim); rope_format: None = auto (see
    the module doc), "same" = the latent's codec, else a codec name / Codec for the rope part."""

    latent_dim: int = 512
    rope_dim: int = 64
    rope_format: Optional[Union[str, Codec]] = None

    def __post_init__(self) -> None:
        for name in ("latent_dim", "rope_dim"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ConfigError(f"LatentLayout.{name} must be a positive integer, got {v!r}")
        rf = self.rope_format
        if rf is not None and rf != "same" and not isinstance(rf, Codec):
            if not isinstance(rf, str):
                raise ConfigError(f"LatentLayout.rope_format must be None, a codec name or a Codec, "
                                  f"got {rf!r}")
            object.__setattr__(self, "rope_format", get_codec(rf))

    def spec(self, fmt: KVFormat) -> LatentSpec:
        """The LatentSpec a layer of format `fmt` uses (raises ConfigError for unsupported dims)."""
        a, b = fmt.k, fmt.v
        latent = a if (a.code_bits, a.bits_per_element) >= (b.code_bits, b.bits_per_element) else b
        rope = self.rope_format
        if rope is None:
            rope = latent
            auto = auto_rope_codec(latent)
            if auto is not None:
                try:
                    auto.check_head_dim(self.rope_dim)
                    rope = auto
                except ConfigError:
                    pass
        elif rope == "same":
            rope = latent
        return LatentSpec(self.latent_dim, self.rope_dim, latent, rope)


def fit_latent_scales(spec: LatentSpec, latent, rope, device) -> dict:
    """The fp8 tensor scales of a latent layer fitted to its first chunk (latent float [..., L],
    rope float [..., R]): {"latent_scale": float32 [1], "rope_scale": ...} for the tensor-scaled
    sections only (a uniform row has one section: the latent scale over the whole row), empty
    for every other codec. The one place both front doors (the engine's `PagedCache`, the
    drop-in's `PagedLatentCache`) fit them."""
    from .calibration import fp8_tensor_scale
    import torch

    out = {}
    if spec.latent_codec.traits.tensor_scaled:
        x = torch.cat([latent.detach().float().flatten(), rope.detach().float().flatten()]) \
            if spec.uniform else latent.detach().float()
        out["latent_scale"] = fp8_tensor_scale(x, device)
    if not spec.uniform and spec.rope_codec.traits.tensor_scaled:
        out["rope_scale"] = fp8_tensor_scale(rope.detach().float(), device)
    return out


# A latent layer's stored-bytes transform in the prefix store's fields (`transform_record`):
# the latent section's fp8 scale as k_scale, the rope section's as v_scale (as its record
# member, `storage.record_member`, says); nothing else applies to latents.
LATENT_TRANSFORM_SHAPES = {"k_scale": (1,), "v_scale": (1,)}


def latent_transform(layer) -> dict:
    """The transform of a `LatentLayer` (see LATENT_TRANSFORM_SHAPES)."""
    return {"k_centre": None, "k_mult": None, "v_centre": None, "k_scale": layer.latent_scale,
            "v_scale": layer.rope_scale}


def with_latent_transform(layer, t: dict):
    """`layer` (a `LatentLayer`) with the scales of a stored transform `t` (absent ones kept)."""
    import dataclasses

    import torch

    changes = {name: t[key].to(layer.device, torch.float32)
               for name, key in (("latent_scale", "k_scale"), ("rope_scale", "v_scale"))
               if t.get(key) is not None}
    return dataclasses.replace(layer, **changes) if changes else layer
