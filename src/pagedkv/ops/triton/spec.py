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

from ...codecs.catalogue import Codec, ScaleType
from ...codecs.derive import DecodeKind, EncodeRule
from ...codecs.reference import level_order
from ...errors import ConfigError
from ..support import CodecSupport, pairs

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
    EncodeRule.ROUND_BF16: ENC_BF16,
    EncodeRule.E4M3_TENSOR: ENC_E4M3,  # fp8 (SCALE_KIND tells the tensor scale apart)
    EncodeRule.E4M3_GROUP: ENC_E4M3,  # turbo8 (bf16 group scale)
    EncodeRule.TABLE_SEARCH: ENC_TABLE,  # nearest level + E4M3 group-scale search
    EncodeRule.INT_AMAX: ENC_INT,  # q8_0 (BITS == 8)
    EncodeRule.INT_SIGNED_MAX: ENC_INT,  # q4_0 (BITS < 8)
}

# How the attention kernels turn a code into its value before the scale (constexpr VALUES):
# a gather from the value table, or arithmetic for E4M3 / int8 / offset ints (no dependent load).
VAL_TABLE, VAL_E4M3, VAL_INT8, VAL_INT4, VAL_TABLE_ODD = 0, 1, 2, 3, 4
_VALUES = {
    DecodeKind.RAW_BF16: VAL_TABLE,  # unused: BITS == 16 decodes the halves
    DecodeKind.E4M3: VAL_E4M3,
    DecodeKind.INT8: VAL_INT8,
    DecodeKind.INT_OFFSET: VAL_INT4,  # code - 2**(BITS - 1)
    DecodeKind.TABLE: VAL_TABLE,
}

# What the kernels implement (`common.load_rows` unpacks 2/3/4/5/8-bit codes and bf16 halves; the
# store packs any width but is tested at these); the dispatcher refuses every other row. A group
# of 64 needs head_dim a multiple of 64, which the catalogue requires of such a row
# (`Codec.check_head_dim`), so a row tile always holds whole groups.
_WIDTHS = (2, 3, 4, 5, 8)
_ENCODE_DIRECT = (pairs(EncodeRule.ROUND_BF16, (16,)) | pairs(EncodeRule.E4M3_TENSOR, (8,))
                  | pairs(EncodeRule.E4M3_GROUP, (8,)) | pairs(EncodeRule.INT_AMAX, (8,))
                  | pairs(EncodeRule.INT_SIGNED_MAX, (4,)))
SUPPORT = CodecSupport(
    decode=(pairs(DecodeKind.RAW_BF16, (16,)) | pairs(DecodeKind.E4M3, (8,)) | pairs(DecodeKind.INT8, (8,))
            | pairs(DecodeKind.INT_OFFSET, (4,)) | pairs(DecodeKind.TABLE, _WIDTHS)),
    encode=_ENCODE_DIRECT | pairs(EncodeRule.TABLE_SEARCH, (2, 3, 4, 5)),
    groups=frozenset({0, 16, 32, 64}),
)

MAX_HEAD_DIM = 256


@functools.lru_cache(maxsize=None)
def _values(codec: Codec) -> int:
    """The VALUES constexpr of `codec`: VAL_TABLE_ODD for a 5-bit table (turbo5) that is odd
    symmetric, table[c] = -table[2**bits - 1 - c] (the Lloyd-Max codebooks), so the kernels
    select over its 16 lower levels and flip the sign instead of holding all 32."""
    kind = _VALUES[codec.traits.decode]
    if kind == VAL_TABLE and codec.code_bits == 5:
        table = codec.value_table()
        if torch.equal(table.flip(0), -table):
            return VAL_TABLE_ODD
    return kind


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


def codec_spec(codec: Codec, block_size: int, num_kv_heads: int, head_dim: int, *,
               store: bool = False) -> CodecSpec:
    """The CodecSpec of `codec` for blocks of `block_size` x `num_kv_heads` x `head_dim`;
    ConfigError for a row the kernels do not read (or, with `store`, write): see `SUPPORT`,
    which the dispatcher enforces before any launch."""
    why = SUPPORT.refusal(codec, store=store)
    if why is not None:
        raise ConfigError(f"the Triton kernels do not implement codec {codec.name!r}: {why}")
    t = codec.traits
    return CodecSpec(
        bits=t.bits,
        group=t.group,
        scale_kind=_SCALE_KIND[t.scale],
        encode=_ENCODE.get(t.encode, -1),  # -1: a rule only the reference store writes (E5M2)
        rotated=t.rotated,
        row_data=codec.row_data_bytes(head_dim),
        row_scale=codec.row_scale_bytes(head_dim),
        data_end=block_size * num_kv_heads * codec.row_data_bytes(head_dim),
        block_bytes=codec.block_bytes(block_size, num_kv_heads, head_dim),
        levels=t.levels,
        values=_values(codec),
    )


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
    levels, order = level_order(table)  # the reference encoder's order (tie order matters)
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
