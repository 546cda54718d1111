"""The fast CPU attention kernel (pagedkv.ops.cpu) against the reference ops.

Every (K, V) codec pair of the catalogue (looped from the registry by the shared helper), decode
and prefill, plus GQA 1/3/8, head dims 64/128/256, block sizes 16/32, ragged lengths, sliding
windows, soft-cap, sinks, k_centre, sparse V, split-K merging, and the portable build variants.
Tolerances: the kernel computes the same fp32 math as the reference in another order, so outputs
agree to ~1e-6; 2e-4 (relative to rms(v) = 1) leaves room for summation order only.
"""

from __future__ import annotations

import math

import pytest
import torch

from helpers.attention_oracle import oracle_attention, run_op
from helpers.backend_check import CheckCase, all_pairs, check_backend, default_cases, refused_codecs

from pagedkv.codecs.catalogue import CODECS
from pagedkv.ops import AttentionParams, Op, reference, select_backend
from pagedkv.ops.cpu import build as kbuild

cpu = pytest.importorskip("pagedkv.ops.cpu")
if not cpu.available():  # no compiler here: the fallback is tested below, the kernel cannot be
    pytestmark = pytest.mark.skip(reason=f"CPU kernel unavailable: {cpu.kernel_info()}")


def _check(cases, **kw):
    return check_backend(decode_attention=cpu.decode_attention, prefill_attention=cpu.prefill_attention,
                         cases=cases, **kw)


def test_every_codec_pair_and_settings_grid():
    """Every pair the kernel declares on a ragged batch + the helper's settings grid (window,
    cap, sinks, sparse); the row it does not read (f16) falls back to the reference."""
    from pagedkv.ops.cpu.attention import ATTENTION_SUPPORT

    pairs = all_pairs(ATTENTION_SUPPORT)
    results = _check(default_cases(pairs))
    assert len(results) >= len(pairs) >= 196
    assert max(r["decode_max_err"] for r in results) < 2e-4
    assert set(refused_codecs(ATTENTION_SUPPORT)) == {"f16"}
    for name in refused_codecs(ATTENTION_SUPPORT):
        layer = CheckCase(name, "turbo3").build().layer
        assert select_backend(Op.DECODE, layer.k_pool.device, layer, AttentionParams(scale=0.1)).name == "reference"


SHAPES = [
    # (pair, kv heads, group, head_dim, block_size): each shape with another codec pair
    (("turbo3", "turbo3"), 2, 1, 64, 16),
    (("turbo4", "fp8"), 1, 3, 128, 32),
    (("q4_0", "turbo2"), 1, 8, 256, 16),
    (("bf16", "nvfp4"), 3, 3, 64, 32),
    (("turbo2", "q8_0"), 2, 8, 128, 16),
    (("turbo3", "fp8"), 2, 2, 80, 16),  # head_dim not a multiple of 64 (rotation blocks 64 + 16)
    (("q8_0", "q4_0"), 8, 2, 128, 24),  # block size not a multiple of 16, group-32 scales, 8 kv heads
    (("turbo4", "turbo3"), 1, 4, 64, 128),  # blocks larger than the kernel's 64-token chunk
    (("fp8", "turbo3"), 1, 3, 80, 16),  # 3-bit V rows whose last code group ends a 16-dim pass
    (("turbo2", "turbo3"), 1, 1, 48, 16),  # rows shorter than one 64-dim K pass / 8-vector V pass
    (("fp8", "turbo3"), 1, 6, 80, 16),  # 6 query vectors: V weights as memory operands, 2-vector passes
    (("turbo3", "turbo4"), 2, 7, 64, 16),  # 7 query vectors: 1-vector V passes
    (("q4_0", "fp8"), 1, 5, 64, 16),  # 5 query vectors, group-32 K scales
    # table keys with <= 4 query vectors take the tokens-in-lanes scores (scores_lut) over the
    # chunk's transposed K scales: group-32 fp16 scales decoded then transposed, 8 kv heads (32
    # scales per token), blocks of 24 and 8 (16-token groups across blocks)
    (("q4_0", "turbo3"), 8, 2, 64, 24),
    (("nvfp4", "turbo4"), 2, 4, 128, 8),
    # AVX-512 tokens-in-lanes exact scores over E4M3 keys (scores_e4m3): 6 query vectors (passes of
    # 4 + 2), two 64-dim passes
    (("fp8", "turbo4"), 2, 6, 128, 16),
]


@pytest.mark.parametrize("pair,h,g,d,bs", SHAPES)
def test_gqa_head_dim_block_size(pair, h, g, d, bs):
    cc = CheckCase(*pair, seq_lens=(45, 1, 17, 64), num_kv_heads=h, group=g, head_dim=d, block_size=bs)
    _check([cc])


@pytest.mark.parametrize("pair", [("turbo5", "turbo5"), ("turbo5", "bf16"), ("fp8", "turbo5")])
def test_turbo5_pairs_run_on_the_c_kernel(pair):
    """5-bit table codes (turbo5) on either side are read by the C kernel: the dispatcher picks the
    "cpu" backend for decode and prefill, not the reference ops (which ran them before)."""
    layer = CheckCase(*pair).build().layer
    for op in (Op.DECODE, Op.PREFILL):
        assert select_backend(op, layer.k_pool.device, layer, AttentionParams(scale=0.125)).name == "cpu", op


TURBO5_CASES = [
    # 5-bit codes fill 5 bytes per 8 (codes straddle bytes, as 3-bit ones do): turbo5 as K, as V and
    # both, decode and prefill (the tile, and the general kernel for rows of at most 8 query vectors);
    # decode K of <= 4 query vectors takes the tokens-in-lanes scores (AVX-512), more the dot path
    (("turbo5", "turbo5"), dict(num_kv_heads=2, group=3, q_lens=(30, 1, 12))),
    (("turbo5", "fp8"), dict(num_kv_heads=1, group=8, sliding_window=20)),  # GQA 8, window
    (("bf16", "turbo5"), dict(soft_cap=20.0, sinks=True, q_lens=(30, 1, 12))),
    (("turbo5", "nvfp4"), dict(head_dim=80, group=6)),  # D not a multiple of 64: a 16-dim remainder pass
    (("turbo3", "turbo5"), dict(head_dim=128, group=4, centre=True, k_offset=4.0, transform=True)),
    (("turbo5", "turbo2g64"), dict(head_dim=192, block_size=24, group=2, seq_lens=(70, 1, 45))),
    (("fp8_e5m2", "turbo5"), dict(head_dim=48, group=7)),  # rows shorter than a 64-dim pass; 1-vector V passes
    (("turbo5", "turbo4"), dict(num_kv_heads=3, group=1, head_dim=256, soft_cap=10.0, sliding_window=9)),
    (("turbo5", "turbo5"), dict(group=3, sinks=True, soft_cap=20.0, transform=True, seq_lens=(40, 0, 9))),
    (("turbo5", "turbo5"), dict(group=3, sparse_v_threshold=1e-2, q_lens=(30, 1, 12))),  # prefill: the general kernel
]


@pytest.mark.parametrize("pair,extra", TURBO5_CASES)
def test_turbo5_pairs_match_the_reference(pair, extra):
    _check([CheckCase(*pair, **extra)])


@pytest.mark.parametrize("pair,extra", [
    (("turbo3", "turbo4"), dict(sliding_window=1)),
    (("fp8", "q8_0"), dict(sliding_window=16, q_lens=(30, 1, 12))),
    (("turbo3", "turbo4"), dict(soft_cap=5.0, sinks=True)),
    (("fp8", "q8_0"), dict(sinks=True, sliding_window=7, group=8, num_kv_heads=1)),
    (("turbo3", "turbo4"), dict(centre=True, k_offset=6.0, soft_cap=10.0)),
    (("turbo8", "turbo3"), dict(q_lens=(45, 1, 33), sliding_window=40, soft_cap=25.0, sinks=True)),
])
def test_window_cap_sinks_centre(pair, extra):
    base = dict(seq_lens=(45, 1, 33))
    base.update(extra)
    _check([CheckCase(*pair, **base)])


def _decode_case(pair, seq_lens, **kw):
    cc = CheckCase(*pair, seq_lens=seq_lens, **kw)
    case = cc.build()
    return cc, case


def test_long_context_and_split_merge():
    """Many blocks, random tables; 1 thread vs 4 threads (split-K partial softmax merge)."""
    cc, case = _decode_case(("turbo3", "turbo3"), (700, 3, 260), num_kv_heads=3, group=3)
    params = cc.params()
    want = run_op(case, params, mode="decode", fn=reference.decode_attention)
    qsl = torch.arange(case.batch + 1, dtype=torch.int32)
    for threads in (1, 2, 4):
        got = cpu.attention(case.q_decode, case.layer, case.block_tables, case.seq_lens, qsl, params,
                            num_threads=threads)
        assert (got - want).abs().max() < 2e-4, threads


def test_zero_length_sequence_outputs_zeros():
    cc, case = _decode_case(("turbo4", "turbo4"), (20, 5), sinks=True)
    lens = case.seq_lens.clone()
    lens[1] = 0
    params = cc.params()
    got = cpu.decode_attention(case.q_decode, case.layer, case.block_tables, lens, params)
    want = reference.decode_attention(case.q_decode, case.layer, case.block_tables, lens, params)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    assert (got - want).abs().max() < 2e-4


def test_bf16_pages_match_fp64_sdpa_oracle():
    """bf16 K/V: the kernel vs fp64 attention on the unquantized K/V (error = bf16 rounding)."""
    cc, case = _decode_case(("bf16", "bf16"), (50, 9), num_kv_heads=2, group=3)
    params = cc.params()
    got = cpu.decode_attention(case.q_decode, case.layer, case.block_tables, case.seq_lens, params)
    for b, n in enumerate(case.seq_lens.tolist()):
        want = oracle_attention(case.q_decode[b:b + 1], case.k[b], case.v[b], torch.tensor([n - 1]), params)
        # bf16 keeps 8 mantissa bits: relative error 2^-9 per element, averaged over D and tokens
        assert (got[b:b + 1].double() - want).abs().max() < 2e-2


@pytest.mark.parametrize("pair", [("turbo3", "turbo3"), ("bf16", "turbo2")])
def test_sparse_v_only_skips_small_weights(pair):
    """Sparse V: the kernel skips only positions whose final weight is below t, so its output is
    within sum_{p<t} p |v| of both the exact and the reference (which skips all of them), and it
    does skip reads (counted)."""
    t = 0.02
    cc, case = _decode_case(pair, (300, 64), num_kv_heads=1, group=4, k_offset=0.0)
    exact_params = cc.params()
    params = AttentionParams(scale=exact_params.scale * 6.0, sparse_v_threshold=t)  # peaky weights
    exact_p = AttentionParams(scale=params.scale)
    qsl = torch.arange(case.batch + 1, dtype=torch.int32)
    stats = {}
    got = cpu.attention(case.q_decode, case.layer, case.block_tables, case.seq_lens, qsl, params,
                        num_threads=1, stats=stats)
    exact = reference.decode_attention(case.q_decode, case.layer, case.block_tables, case.seq_lens, exact_p)
    ref = reference.decode_attention(case.q_decode, case.layer, case.block_tables, case.seq_lens, params)
    assert stats["v_rows_skipped"] > 0
    for b, n in enumerate(case.seq_lens.tolist()):
        k, v = case.k_deq[b], case.v_deq[b]  # what the cache holds, original basis
        _, w = oracle_attention(case.q_decode[b:b + 1], k, v, torch.tensor([n - 1]), exact_p,
                                return_weights=True)  # [Hq, 1, n]
        small = torch.where(w < t, w, torch.zeros_like(w)).sum(-1).squeeze(-1)  # [Hq]
        bound = (small * v.abs().max()).float() + 1e-4
        for other in (exact, ref):
            err = (got[b] - other[b]).abs().amax(-1)
            assert bool((err <= bound).all()), (err, bound)


def test_dispatch_picks_cpu_backend():
    from pagedkv.ops.dispatch import Op, select_backend

    cc, case = _decode_case(("turbo3", "turbo3"), (10,))
    chosen = select_backend(Op.DECODE, case.layer.device, case.layer, cc.params())
    assert chosen.name == "cpu"
    from pagedkv.ops import decode_attention

    out = decode_attention(case.q_decode, case.layer, case.block_tables, case.seq_lens, cc.params())
    want = reference.decode_attention(case.q_decode, case.layer, case.block_tables, case.seq_lens, cc.params())
    assert (out - want).abs().max() < 2e-4


def test_output_dtype_follows_q():
    cc, case = _decode_case(("turbo3", "fp8"), (33,))
    q = case.q_decode.to(torch.bfloat16)
    out = cpu.decode_attention(q, case.layer, case.block_tables, case.seq_lens, cc.params())
    assert out.dtype == torch.bfloat16 and out.shape == q.shape


def test_centre_terms_follow_the_layer_and_an_in_place_write():
    """The per-query-head centre terms are derived once per layer (`attention._centres`): a call
    at another scale, a bf16 q (the add and the cast fused) and a centre written in place still
    match the reference ops."""
    cc, case = _decode_case(("turbo3", "turbo4"), (40, 9), transform=True, num_kv_heads=2, group=3)
    layer = case.layer
    assert layer.k_centre is not None and layer.v_centre is not None

    def same(params, q=case.q_decode):
        got = cpu.decode_attention(q, layer, case.block_tables, case.seq_lens, params)
        want = reference.decode_attention(q.float(), layer, case.block_tables, case.seq_lens, params)
        assert got.dtype == q.dtype
        rounding = 2.0 ** -8 * want.abs() if q.dtype == torch.bfloat16 else 0.0  # the output's own rounding
        assert bool(((got.float() - want).abs() <= 2e-4 + rounding).all())

    same(cc.params())
    same(AttentionParams(scale=0.05))
    same(cc.params(), case.q_decode.to(torch.bfloat16))
    layer.k_centre.add_(0.5)
    layer.v_centre.mul_(-2.0)
    same(cc.params())


@pytest.mark.parametrize("variant", ["scalar", "avx2"])
def test_portable_variants(variant):
    """The other builds give the same results: the portable C path (scalar) and the AVX2
    intrinsics path (8-lane decode, dot, tile and softmax code) on an AVX-512 machine. Built in
    the default (private, cached) directory: a SIMD build costs ~20 s of CPU once."""
    if variant == "avx2" and kbuild.detect_variant() == "scalar":
        pytest.skip("no AVX2 here")
    loaded = cpu.kernel_info()["variant"]  # the session's build (conftest's --kernel-variant, else the best)
    try:
        cpu.load(kbuild.KernelConfig(variant=variant))
        assert cpu.kernel_info()["variant"] == variant
        cases = [CheckCase(k, v, seq_lens=(19, 1, 40), num_kv_heads=2, group=3, sliding_window=w,
                           soft_cap=cap, sinks=s)
                 for (k, v), w, cap, s in [(("turbo3", "turbo4"), None, None, False),
                                           (("fp8", "q4_0"), 9, 20.0, True),
                                           (("turbo8", "nvfp4"), None, None, True),
                                           (("q8_0", "turbo2"), 5, None, False),
                                           (("bf16", "bf16"), None, 30.0, False),
                                           (("turbo5", "turbo5"), 7, 15.0, True),
                                           (("turbo5", "fp8"), None, None, False),
                                           (("q4_0", "turbo5"), None, None, False)]]
        _check(cases)
    finally:
        cpu.load(kbuild.KernelConfig(variant=loaded))


def test_no_compiler_is_a_clear_error(tmp_path):
    with pytest.raises(kbuild.KernelUnavailable, match="no C compiler"):
        kbuild.build_and_load(kbuild.KernelConfig(cache_dir=str(tmp_path), compiler="no-such-cc-xyz"))


def test_variant_detection_from_flags():
    avx512 = frozenset("avx2 fma f16c avx512f avx512bw avx512vl avx512dq avx512vbmi".split())
    assert kbuild.detect_variant(avx512) in ("avx512", "scalar")  # scalar on non-x86 machines
    assert kbuild.detect_variant(frozenset("avx2 fma f16c".split())) in ("avx2", "scalar")
    assert kbuild.detect_variant(frozenset({"sse2"})) == "scalar"


def test_kernel_rejects_unsupported_head_dim_via_supports():
    from pagedkv.ops.dispatch import Op
    from pagedkv.ops import make_layer

    layer = make_layer(CODECS["bf16"], CODECS["bf16"], 4, 16, 1, 72)
    assert not cpu.supports(Op.DECODE, layer, AttentionParams(scale=1.0))
    layer = make_layer(CODECS["bf16"], CODECS["bf16"], 4, 16, 1, 80)
    assert cpu.supports(Op.DECODE, layer, AttentionParams(scale=1.0))


def test_bench_attention_smoke():
    """`pagedkv bench attention` machinery on a tiny shape: rows, ratio = ms / baseline_ms."""
    from pagedkv.bench import attention as ba

    shape = ba.BenchShape(layers=2, repeats=1)
    res = ba.run(["turbo3", "fp8k_turbo3v"], [48], [1, 2], shape, prefill_shapes=((64, 16),),
                 bandwidth_bytes=1 << 22)
    assert {(r["format"], r["batch"]) for r in res.rows} == {
        (f, b) for f in ("turbo3", "fp8k_turbo3v") for b in (1, 2)}
    for r in res.rows:
        assert r["ms"] > 0 and r["baseline_ms"] > 0
        assert math.isclose(r["ratio"], r["ms"] / r["baseline_ms"])
        assert r["baseline"] in r["baseline_ways"] and r["baseline_ms"] == min(r["baseline_ways"].values())
    assert len(res.prefill) == 2 and all(p["ms"] > 0 for p in res.prefill)
    assert len(res.memory) == 2 and res.bandwidth_gbps > 0


def test_fp8_subnormals_exact_even_with_flush_denormal():
    """E4M3 subnormal codes decode exactly although the caller flushes denormals (DAZ/FTZ)."""
    cc, case = _decode_case(("fp8", "fp8"), (40, 7), num_kv_heads=2, group=2)
    params = cc.params()
    want = reference.decode_attention(case.q_decode, case.layer, case.block_tables, case.seq_lens, params)
    codes = case.layer.k_pool.reshape(-1)
    assert bool(((codes & 0x78) == 0).any())  # some subnormal E4M3 codes are stored
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        got = cpu.decode_attention(case.q_decode, case.layer, case.block_tables, case.seq_lens, params)
    finally:
        torch.set_flush_denormal(False)
    assert (got - want).abs().max() < 2e-4


def _six_bit(name: str):
    import dataclasses

    return dataclasses.replace(CODECS[name], name=f"{name}_6bit", code_bits=6)


@pytest.mark.parametrize("side", ["k", "v"])
def test_unknown_code_width_is_refused_not_decoded_as_another(side):
    """Issue 17: a 6-bit row (no kernel decodes 6-bit codes) is an error naming the codec, never a
    silent decode as another width; the kernel is called directly, past any `supports` policy."""
    from pagedkv.errors import InvalidInput
    from pagedkv.ops import make_layer

    odd, ok = _six_bit("turbo3"), CODECS["turbo3"]
    layer = make_layer(odd if side == "k" else ok, odd if side == "v" else ok, 2, 16, 1, 64)
    q = torch.randn(1, 2, 64)
    with pytest.raises(InvalidInput, match="does not implement codec 'turbo3_6bit'"):
        cpu.attention(q, layer, torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([20], dtype=torch.int32),
                      torch.arange(2, dtype=torch.int32), AttentionParams(scale=0.125))


def test_store_kernel_refuses_unknown_code_width():
    """The C store packs only the widths each rule implements: q4_0's rule at 8 bits (8-bit ints
    are q8_0's rule) leaves the pool untouched."""
    import ctypes
    import dataclasses

    from pagedkv.ops import make_layer
    from pagedkv.ops.cpu import write as cstore

    codec = dataclasses.replace(CODECS["q4_0"], name="q4_0_8bit", code_bits=8)
    layer = make_layer(codec, codec, 1, 16, 1, 64)
    d = cstore.store_desc(CODECS["q4_0"])
    x = torch.randn(1, 1, 64)
    slots = torch.zeros(1, dtype=torch.int64)
    a = cstore._StoreArgs()
    a.x, a.centre, a.slots, a.pool = x.data_ptr(), None, slots.data_ptr(), layer.k_pool.data_ptr()
    a.levels, a.mids, a.order = d.levels.data_ptr(), d.mids.data_ptr(), d.order.data_ptr()
    a.x_stride_t, a.x_stride_h, a.num_tokens = x.stride(0), x.stride(1), 1
    a.block_stride, a.scale_offset = layer.k_pool.stride(0), codec.data_bytes(16 * 64)
    a.x_dtype, a.block_size, a.num_heads, a.head_dim = 0, 16, 1, 64
    a.kind, a.bits, a.group, a.scale_kind = d.kind, 8, d.group, d.scale_kind
    a.row_data_bytes, a.row_scale_bytes = codec.row_data_bytes(64), codec.row_scale_bytes(64)
    a.top, a.tensor_scale = d.top, 1.0
    assert cpu._require().lib.pkv_store(ctypes.byref(a)) == 3
    assert int(layer.k_pool.count_nonzero()) == 0


def test_every_hand_over_to_the_reference_ops_is_logged_once(caplog):
    """Issue 30.5, declared, never silent: the dispatcher passing the CPU backend over (a head_dim
    its kernel does not take) and the kernel handing its one unfinished case (a value centre with
    sink logits) to the reference ops each log one line per codec and reason, however many calls;
    the results are the reference's."""
    import logging

    from pagedkv.ops.dispatch import log_fallback_once

    log_fallback_once.cache_clear()
    odd = CheckCase("bf16", "fp8", head_dim=24, seq_lens=(9, 4)).build().layer
    sunk = CheckCase("turbo3", "turbo4", seq_lens=(19, 1, 33), sinks=True, transform=True)
    case, params = sunk.build(), sunk.params()
    assert case.layer.v_centre is not None and params.sinks is not None
    want = reference.decode_attention(case.q_decode, case.layer, case.block_tables, case.seq_lens, params)
    with caplog.at_level(logging.WARNING, logger="pagedkv.ops.dispatch"):
        for _ in range(3):
            assert select_backend(Op.DECODE, odd.k_pool.device, odd, AttentionParams(scale=0.1)).name == "reference"
            got = cpu.decode_attention(case.q_decode, case.layer, case.block_tables, case.seq_lens, params)
            assert torch.equal(got, want)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "decode_attention on cpu runs on the reference ops" in lines[0] and "head_dim=24" in lines[0]
    assert "k=turbo3, v=turbo4" in lines[1] and "runs on the reference ops" in lines[1] and "sink" in lines[1]
