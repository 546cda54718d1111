"""Host side of the Triton kernels: the compile-time constants and small tables of one codec.

The kernels are generic over the (K codec, V codec) pair: everything codec-specific they need
is derived here from the catalogue row (`pagedkv.codecs.catalogue.Codec`) and passed as
`tl.constexpr` integers (code bits, group size, scale kind, value kind, byte geometry of a row
and of a block) plus a few tiny tensors (the value table, sorted levels). No Triton import here,
so the geometry can be inspected and tested without Triton.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ...codecs.catalogue import Codec, ScaleType, ValueKind

# Scale kinds (constexpr SCALE_KIND): how a code's value is multiplied after the table lookup.
SCALE_NONE, SCALE_TENSOR, SCALE_E4M3, SCALE_BF16, SCALE_FP16 = 0, 1, 2, 3, 4
_SCALE_KIND = {
    ScaleType.NONE: SCALE_NONE,
    ScaleType.TENSOR_FP32: SCALE_TENSOR,
    ScaleType.FP8_E4M3: SCALE_E4M3,
    ScaleType.BF16: SCALE_BF16,
    ScaleType.FP16: SCALE_FP16,
}

# Encode rules (constexpr ENCODE) used by the store kernel.
ENC_BF16, ENC_E4M3, ENC_TABLE, ENC_INT = 0, 1, 2, 3
_ENCODE = {
    ValueKind.BF16: ENC_BF16,
    ValueKind.FP8_E4M3: ENC_E4M3,  # fp8 (tensor scale) and turbo8 (bf16 group scale)
    ValueKind.E2M1: ENC_TABLE,  # nearest level + E4M3 group-scale search
    ValueKind.LLOYD_MAX: ENC_TABLE,
    ValueKind.INT: ENC_INT,  # q8_0 / q4_0 (llama.cpp rules)
}

# How the attention kernels turn a code into its value before the scale (constexpr VALUES):
# a gather from the value table, or arithmetic for E4M3 / int8 / int4 (no dependent load).
VAL_TABLE, VAL_E4M3, VAL_INT8, VAL_INT4 = 0, 1, 2, 3

MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class CodecSpec:
    """Compile-time description of one side (K or V) of a layer, for one head_dim / block geometry.

    bits: code bits (16 = raw bf16); group: elements per scale (0: none); scale_kind, encode: see
    the module constants; rotated: stored after the WHT; row_data / row_scale: bytes of one
    (token, head) row's codes / scales; data_end: offset of a block's scale section;
    block_bytes: bytes of one block; levels: number of distinct codes (value table length).
    """

    bits: int
    group: int
    scale_kind: int
    encode: int
    rotated: bool
    row_data: int
    row_scale: int
    data_end: int
    block_bytes: int
    levels: int
    values: int

    def constexprs(self, prefix: str) -> dict:
        """The kernel keyword arguments for this side, e.g. prefix 'K_' -> K_BITS=..."""
        return {
            f"{prefix}BITS": self.bits,
            f"{prefix}GROUP": max(self.group, 1),
            f"{prefix}SCALE_KIND": self.scale_kind,
            f"{prefix}VALUES": self.values,
            f"{prefix}ROW_DATA": self.row_data,
            f"{prefix}ROW_SCALE": self.row_scale,
            f"{prefix}DATA_END": self.data_end,
            f"{prefix}BLOCK_BYTES": self.block_bytes,
        }


def codec_spec(codec: Codec, block_size: int, num_kv_heads: int, head_dim: int) -> CodecSpec:
    """The CodecSpec of `codec` for blocks of `block_size` x `num_kv_heads` x `head_dim`."""
    return CodecSpec(
        bits=codec.code_bits,
        group=codec.group_size,
        scale_kind=_SCALE_KIND[codec.scale_type],
        encode=_ENCODE[codec.values],
        rotated=codec.rotated,
        row_data=codec.row_data_bytes(head_dim),
        row_scale=codec.row_scale_bytes(head_dim),
        data_end=block_size * num_kv_heads * codec.row_data_bytes(head_dim),
        block_bytes=codec.block_bytes(block_size, num_kv_heads, head_dim),
        levels=0 if codec.code_bits > 8 else 1 << codec.code_bits,
        values=_values_kind(codec),
    )


def _values_kind(codec: Codec) -> int:
    if codec.values is ValueKind.FP8_E4M3:
        return VAL_E4M3
    if codec.values is ValueKind.INT:
        return VAL_INT8 if codec.code_bits == 8 else VAL_INT4
    return VAL_TABLE  # Lloyd-Max levels, E2M1 (and unused for bf16)


def supports_head_dim(head_dim: int) -> bool:
    """The kernels tile head_dim in power-of-two blocks of 16..256 and pack codes 8 at a time."""
    return head_dim % 16 == 0 and 16 <= head_dim <= MAX_HEAD_DIM


@dataclass(frozen=True, eq=False)
class CodecTables:
    """The small tensors one codec's kernels read, on one device.

    values: float32 [max(1, 2**bits)] value of each code before the scale (a dummy [1] for bf16);
    levels: float32 [L] ascending distinct-value order used by the encoder; mids: float32 [L-1]
    midpoints; order: int32 [L] code of each ascending level; max_level: max |level|.
    """

    values: torch.Tensor
    levels: torch.Tensor
    mids: torch.Tensor
    order: torch.Tensor
    max_level: float


@functools.lru_cache(maxsize=None)
def _tables_cpu(codec: Codec) -> CodecTables:
    table = codec.value_table()
    if table is None:
        one = torch.zeros(1, dtype=torch.float32)
        return CodecTables(one, one, one, torch.zeros(1, dtype=torch.int32), 1.0)
    levels, order = table.sort()  # the same call as the reference encoder (tie order matters)
    mids = (levels[1:] + levels[:-1]) / 2
    if mids.numel() == 0:
        mids = torch.zeros(1)
    return CodecTables(table.contiguous(), levels.contiguous(), mids.contiguous(),
                       order.to(torch.int32).contiguous(), float(levels.abs().max()))


@functools.lru_cache(maxsize=None)
def _tables(codec: Codec, device: str) -> CodecTables:
    t = _tables_cpu(codec)
    return CodecTables(t.values.to(device), t.levels.to(device), t.mids.to(device), t.order.to(device),
                       t.max_level)


def codec_tables(codec: Codec, device: torch.device | str) -> CodecTables:
    """Cached CodecTables of `codec` on `device`."""
    return _tables(codec, str(torch.device(device)))
