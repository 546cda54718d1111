"""Codecs derived in one place (`codecs/derive.py`) and backends that declare what they implement.

A catalogue row with a code width no kernel implements must be refused by those backends: the
dispatcher falls back to the reference (automatic selection) or raises (a named backend), and
never hands the row to a kernel that would read it with another width's rules (before this, the
C kernel decoded a 5-bit row as 2-bit and Triton as 3-bit, silently).
"""

from __future__ import annotations

import pytest
import torch

from helpers.attention_oracle import make_case, oracle_outputs, run_op
from pagedkv.codecs import CODECS, Codec, ScaleType, ValueKind
from pagedkv.codecs import packing
from pagedkv.codecs import reference as codec_ref
from pagedkv.codecs.derive import DecodeKind, EncodeRule, auto_high_precision_layers, traits
from pagedkv.errors import ConfigError, InvalidInput
from pagedkv.ops import AttentionParams, Backend, Op, api, make_layer, reference, select_backend
from pagedkv.ops.dispatch import register_backend, unregister_backend
from pagedkv.ops.support import CodecSupport, pairs

V, S = ValueKind, ScaleType
Q5 = Codec("q5_test", 5, V.INT, 32, S.FP16, False, "int5 + fp16 scale per 32 (test row)")
Q6 = Codec("q6_test", 6, V.INT, 32, S.FP16, False, "int6 + fp16 scale per 32 (test row)")
PARAMS = AttentionParams(scale=0.125)

EXPECTED = {  # the facts every backend switches on, per catalogue row
    "bf16": (DecodeKind.RAW_BF16, EncodeRule.ROUND_BF16, 16),
    "fp8": (DecodeKind.E4M3, EncodeRule.E4M3_TENSOR, 8),
    "nvfp4": (DecodeKind.TABLE, EncodeRule.TABLE_SEARCH, 4),
    "turbo4": (DecodeKind.TABLE, EncodeRule.TABLE_SEARCH, 4),
    "turbo3": (DecodeKind.TABLE, EncodeRule.TABLE_SEARCH, 3),
    "turbo2": (DecodeKind.TABLE, EncodeRule.TABLE_SEARCH, 2),
    "turbo8": (DecodeKind.E4M3, EncodeRule.E4M3_GROUP, 8),
    "q8_0": (DecodeKind.INT8, EncodeRule.INT_AMAX, 8),
    "q4_0": (DecodeKind.INT_OFFSET, EncodeRule.INT_SIGNED_MAX, 4),
}


def test_every_catalogue_row_derives():
    for name, codec in CODECS.items():
        t = traits(codec)
        assert (t.decode, t.encode, t.bits) == EXPECTED.get(name, (t.decode, t.encode, t.bits)), name
        assert t.bits == codec.code_bits and t.scale is codec.scale_type and t.rotated == codec.rotated
        assert codec.traits == t


@pytest.mark.parametrize("row, match", [
    (Codec("e2m1x3", 3, V.E2M1, 16, S.FP8_E4M3, False, ""), "E2M1 values are 4-bit"),
    (Codec("bf16s", 16, V.BF16, 16, S.FP8_E4M3, False, ""), "raw 16-bit codes without a scale"),
    (Codec("lmbf", 4, V.LLOYD_MAX, 16, S.BF16, True, ""), "table codes take an E4M3 group scale"),
    (Codec("int9", 9, V.INT, 32, S.FP16, False, ""), "code bits must be 1..8"),
    (Codec("nogroup", 4, V.INT, 0, S.FP16, False, ""), "needs a group size"),
])
def test_rows_without_a_derivation_are_refused_by_every_backend(row, match):
    with pytest.raises(ConfigError, match=match):
        traits(row)
    if row.code_bits > 8 or not row.group_size:
        return
    layer = make_layer(row, CODECS["bf16"], 2, 16, 1, 64)
    with pytest.raises(ConfigError, match=match):  # the reference too: no rule, no numbers
        api.store(layer, torch.randn(3, 1, 64), torch.randn(3, 1, 64), torch.arange(3))
    assert not bool(layer.k_pool.any())


def test_packing_is_one_lsb_first_bit_stream_at_every_width():
    gen = torch.Generator().manual_seed(0)
    for bits in range(1, 9):
        codes = torch.randint(0, 1 << bits, (3, 32), generator=gen, dtype=torch.int64)
        packed = packing.pack(codes.to(torch.uint8), bits)
        stream = [sum(int(c) << (bits * i) for i, c in enumerate(row)) for row in codes]
        want = torch.tensor([[(s >> (8 * k)) & 255 for k in range(32 * bits // 8)] for s in stream],
                            dtype=torch.uint8)
        assert torch.equal(packed, want), bits
        assert torch.equal(packing.unpack(packed, bits, 32).long(), codes), bits


@pytest.mark.parametrize("row", [Q5, Q6], ids=lambda r: r.name)
def test_a_row_no_kernel_implements_runs_on_the_reference(row):
    """q5/q6 rows (llama.cpp's q4_0 rule at 5/6 bits): the CPU kernel and Triton decline them,
    automatic dispatch computes them with the reference, right."""
    assert traits(row).decode is DecodeKind.INT_OFFSET
    x = torch.randn(64, 2, 64, generator=torch.Generator().manual_seed(1))
    err = float((codec_ref.roundtrip(row, x) - x).pow(2).mean())
    err4 = float((codec_ref.roundtrip(CODECS["q4_0"], x) - x).pow(2).mean())
    assert err < 0.35 * err4  # one more bit: ~4x less error; a wrong decode is far off
    for op in (Op.DECODE, Op.PREFILL):
        layer = make_layer(row, CODECS["turbo3"], 4, 16, 2, 64)
        assert select_backend(op, torch.device("cpu"), layer, PARAMS).name == "reference"
    case = make_case(row, row, seq_lens=[40, 7], num_kv_heads=2, group=2, store_backend=None, seed=2)
    ref_case = make_case(row, row, seq_lens=[40, 7], num_kv_heads=2, group=2, seed=2)
    assert torch.equal(case.layer.k_pool, ref_case.layer.k_pool)  # the CPU store: the reference's bytes
    for mode in ("decode", "prefill"):
        got = run_op(case, PARAMS, mode=mode, backend=None).double()
        torch.testing.assert_close(got, oracle_outputs(case, PARAMS, mode=mode), atol=2e-5, rtol=2e-5)


def test_the_cpu_kernel_refuses_a_5_bit_row_by_name():
    cpu = pytest.importorskip("pagedkv.ops.cpu")
    if not cpu.available():
        pytest.skip("no compiled CPU kernel")
    from pagedkv.ops.cpu.attention import side_desc
    from pagedkv.ops.cpu.write import store_desc

    layer = make_layer(Q5, CODECS["bf16"], 4, 16, 2, 64)
    q = torch.randn(1, 2, 64)
    tables, lens = torch.tensor([[0]], dtype=torch.int32), torch.tensor([5], dtype=torch.int32)
    with pytest.raises(InvalidInput, match="backend 'cpu' does not implement decode_attention for k codec 'q5_test'"):
        api.decode_attention(q, layer, tables, lens, PARAMS, backend="cpu")
    with pytest.raises(InvalidInput, match="CPU attention kernel does not implement codec 'q5_test'"):
        side_desc(Q5)
    assert store_desc(Q5) is not None  # the C store encodes it (q4_0's rule at 5 bits)
    assert side_desc(CODECS["q4_0"]).bits == 4


def test_triton_refuses_a_5_bit_row():
    pytest.importorskip("triton")
    from pagedkv.ops import triton as tr
    from pagedkv.ops.triton.spec import codec_spec

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not tr.interpreting():
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1 before its import")
    backend = tr.BACKEND if device == "cuda" else tr.interpreter_backend()
    layer = make_layer(CODECS["turbo3"], Q5, 4, 16, 2, 64, device=device)
    k = torch.randn(3, 2, 64, device=device)
    with pytest.raises(InvalidInput, match="does not implement store for v codec 'q5_test'"):
        api.store(layer, k, k, torch.arange(3, device=device), backend=backend)
    with pytest.raises(ConfigError, match="Triton kernels do not implement codec 'q5_test'"):
        codec_spec(Q5, 16, 2, 64)
    if device == "cuda":  # automatic dispatch on the GPU: the reference, never the kernels
        assert select_backend(Op.DECODE, torch.device(device), layer, PARAMS).name == "reference"


def test_the_dispatcher_enforces_a_declaration():
    """A fast backend declaring only 4-bit offset ints gets q4_0 layers and never a q5 one."""
    def boom(*args, **kwargs):
        raise AssertionError("a declined row reached the backend")

    fake = Backend(name="declares-q4", device_types=("cpu",), store=boom, decode_attention=boom,
                   prefill_attention=boom, priority=10_000,
                   codecs=CodecSupport(decode=pairs(DecodeKind.INT_OFFSET, (4,)),
                                       encode=pairs(EncodeRule.INT_SIGNED_MAX, (4,))))
    register_backend(fake)
    try:
        q4 = make_layer(CODECS["q4_0"], CODECS["q4_0"], 2, 16, 1, 64)
        q5 = make_layer(Q5, Q5, 2, 16, 1, 64)
        assert select_backend(Op.DECODE, torch.device("cpu"), q4, PARAMS) is fake
        assert select_backend(Op.STORE, torch.device("cpu"), q5, None).name != fake.name
        api.store(q5, torch.randn(2, 1, 64), torch.randn(2, 1, 64), torch.arange(2))  # not `boom`
        mixed = make_layer(CODECS["q4_0"], Q5, 2, 16, 1, 64)  # both sides are checked
        assert select_backend(Op.PREFILL, torch.device("cpu"), mixed, PARAMS) is not fake
        with pytest.raises(InvalidInput, match="v codec 'q5_test': decode kind int-offset at 5 bits"):
            select_backend(Op.DECODE, torch.device("cpu"), mixed, PARAMS, backend="declares-q4")
    finally:
        unregister_backend(fake.name)
    assert reference.BACKEND.codecs.refusal(Q5, store=True) is None


def test_a_store_may_declare_a_rule_for_rotated_rows_only():
    """`unrotated_encode`: the level search declared for rotated rows (turbo4) but not for nvfp4,
    the same rule and width without the rotation; attention reads both."""
    sup = CodecSupport(encode=pairs(EncodeRule.TABLE_SEARCH, (4,)), unrotated_encode=frozenset(),
                       decode=pairs(DecodeKind.TABLE, (4,)))
    assert sup.refusal(CODECS["turbo4"], store=True) is None
    assert "unrotated row" in sup.refusal(CODECS["nvfp4"], store=True)
    assert sup.refusal(CODECS["nvfp4"], store=False) is None


def test_auto_high_precision_layers_has_a_value_for_every_width():
    """The rule replaces the table {16: 0, 8: 0, 4: 2, 3: 3, 2: 4}, which fell through to 0."""
    got = {c.code_bits: auto_high_precision_layers(c) for c in CODECS.values()}
    assert got == {16: 0, 8: 0, 5: 1, 4: 2, 3: 3, 2: 4}
    assert auto_high_precision_layers(Q5) == 1 and auto_high_precision_layers(Q6) == 0
