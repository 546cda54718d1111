"""The codec catalogue: one frozen row per codec; sizes, names and kernels derive from it.

A codec says how one K or V tensor is stored. Every byte count of a block follows from the row:
a block is its data section (`code_bits` per element) followed by its scale section (one scale of
`scale_type` per `group_size` consecutive elements along head_dim), both token-major. Adding a codec
means adding one row here (and, for a new value kind, its table in `tables.py`).
"""

from __future__ import annotations

from ..errors import ConfigError
from .kinds import ScaleType, ValueKind
from .row import Codec

__all__ = ["Codec", "ScaleType", "ValueKind", "CODECS", "ALIASES", "REFUSED", "canonical_codec_name",
           "refusal_hint", "get_codec"]


def _row(name, bits, values, group, scale, rotated, description) -> Codec:
    return Codec(name, bits, values, group, scale, rotated, description)


V, S = ValueKind, ScaleType
CODECS: dict[str, Codec] = {
    c.name: c
    for c in (
        _row("bf16", 16, V.BF16, 0, S.NONE, False, "raw bfloat16"),
        _row("f16", 16, V.FP16, 0, S.NONE, False, "raw IEEE half, saturating at 65504 (llama.cpp f16)"),
        _row("fp8", 8, V.FP8_E4M3, 0, S.TENSOR_FP32, False, "E4M3, one fp32 scale per layer and side"),
        _row("fp8_e5m2", 8, V.FP8_E5M2, 0, S.TENSOR_FP32, False, "E5M2, one fp32 scale per layer and side"),
        _row("nvfp4", 4, V.E2M1, 16, S.FP8_E4M3, False, "E2M1 + E4M3 scale per 16"),
        _row("turbo5", 5, V.LLOYD_MAX, 16, S.FP8_E4M3, True, "WHT + 32-level Lloyd-Max + E4M3 scale per 16"),
        _row("turbo4", 4, V.LLOYD_MAX, 16, S.FP8_E4M3, True, "WHT + 16-level Lloyd-Max + E4M3 scale per 16"),
        _row("turbo4g32", 4, V.LLOYD_MAX, 32, S.FP8_E4M3, True, "WHT + 16-level Lloyd-Max + E4M3 scale per 32"),
        _row("turbo3", 3, V.LLOYD_MAX, 16, S.FP8_E4M3, True, "WHT + 8-level Lloyd-Max + E4M3 scale per 16"),
        _row("turbo3g32", 3, V.LLOYD_MAX, 32, S.FP8_E4M3, True, "WHT + 8-level Lloyd-Max + E4M3 scale per 32"),
        _row("turbo2", 2, V.LLOYD_MAX, 16, S.FP8_E4M3, True, "WHT + 4-level Lloyd-Max + E4M3 scale per 16"),
        _row("turbo2g64", 2, V.LLOYD_MAX, 64, S.FP8_E4M3, True, "WHT + 4-level Lloyd-Max + E4M3 scale per 64"),
        _row("turbo8", 8, V.FP8_E4M3, 16, S.BF16, True, "WHT + E4M3 + bf16 scale per 16"),
        _row("q8_0", 8, V.INT, 32, S.FP16, False, "int8 + fp16 scale per 32 (llama.cpp q8_0)"),
        _row("q4_0", 4, V.INT, 32, S.FP16, False, "int4 + fp16 scale per 32 (llama.cpp q4_0)"),
    )
}
del V, S


# Other systems' names for the same bytes (vLLM's kv_cache_dtype, torch dtype names).
# "auto" is vLLM's "the model's dtype": bf16 here, pagedkv's exact cache.
ALIASES: dict[str, str] = {
    "fp8_e4m3": "fp8", "bfloat16": "bf16", "auto": "bf16", "float16": "f16", "fp16": "f16", "half": "f16",
}

# Names other systems use for something pagedkv stores differently: refused with what to use.
REFUSED: dict[str, str] = {
    "fp8_inc": "Intel Gaudi's fp8 cache; use fp8 (E4M3, one fp32 scale per layer and side)",
    "fp8_ds_mla": "vLLM's DeepSeek MLA fp8 page layout; use fp8 (latent layers: CacheConfig(latent=...))",
    "float32": "pagedkv keeps no fp32 cache; use bf16 or f16",
    "fp32": "pagedkv keeps no fp32 cache; use bf16 or f16",
    "q5_0": "llama.cpp's q5_0 bytes (ggml nibble order and a high-bit array) are not stored; "
            "use turbo5 (5.5 bits) or q8_0",
    "q4_1": "llama.cpp's q4_1 (scale and minimum) is not stored; use q4_0 or turbo4",
    "q5_1": "llama.cpp's q5_1 (scale and minimum) is not stored; use turbo5 or q8_0",
    "iq4_nl": "llama.cpp's iq4_nl table is not stored; use turbo4 (4.5 bits, WHT + Lloyd-Max)",
}


def canonical_codec_name(name: str) -> "str | None":
    """The catalogue name `name` stands for (case-insensitive, aliases resolved), or None."""
    key = str(name).strip().lower()
    key = ALIASES.get(key, key)
    return key if key in CODECS else None


def refusal_hint(name: str) -> str:
    """'; <why and what to use>' for a name REFUSED lists, else ''."""
    why = REFUSED.get(str(name).strip().lower())
    return f"; {name!r} is not the same thing: {why}" if why else ""


def get_codec(name: str) -> Codec:
    """The catalogue row called `name` (case-insensitive, ALIASES accepted); ConfigError listing
    valid names (and, for a REFUSED name, what to use instead)."""
    if isinstance(name, Codec):
        return name
    key = canonical_codec_name(name)
    if key is None:
        raise ConfigError(
            f"unknown codec {name!r}{refusal_hint(name)}; valid codecs: {', '.join(CODECS)} "
            f"(aliases: {', '.join(f'{a}={c}' for a, c in ALIASES.items())})"
        )
    return CODECS[key]
