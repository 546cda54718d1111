"""The Triton kernels against the reference ops, for every codec pair.

On a GPU the kernels run natively on CUDA tensors through the registered "triton" backend; on a
CPU-only machine the same tests run them under Triton's interpreter on CPU tensors
(TRITON_INTERPRET=1, set by tests/conftest.py before anything imports Triton, and again here
for runs of this file alone). Shapes are tiny so the interpreter stays fast.

Stores are compared byte for byte with the reference store; attention outputs with the
reference outputs over the same pools (fp32 rounding only), via the shared backend checker.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace

import pytest
import torch

DEVICE_IS_CPU = not torch.cuda.is_available()
if DEVICE_IS_CPU:
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton")

from helpers.backend_check import CheckCase, all_pairs, check_backend, default_cases, refused_codecs  # noqa: E402
from pagedkv.codecs import CODECS  # noqa: E402
from pagedkv.errors import InvalidInput  # noqa: E402
from pagedkv.ops import AttentionParams, Op, api, make_layer, select_backend  # noqa: E402
from pagedkv.ops import triton as tr  # noqa: E402
from pagedkv.ops.triton.spec import SUPPORT  # noqa: E402
from pagedkv.ops.triton.common import bf16_bits, e4m3_bits, e4m3_value, fp16_bits  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

if DEVICE_IS_CPU and not tr.interpreting():
    raise RuntimeError("triton was imported before TRITON_INTERPRET=1 was set (tests/conftest.py sets "
                       "it first); run with TRITON_INTERPRET=1 in the environment")

pytestmark = pytest.mark.triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp32 products on a GPU (the registered default is bf16): the oracle comparisons are to fp32 rounding
BACKEND = tr.make_backend("fp32", name="triton-fp32-test") if DEVICE == "cuda" else tr.interpreter_backend()
ATTN = dict(decode_attention=tr.decode_attention, prefill_attention=tr.prefill_attention)
TOL = dict(atol=2e-5, rtol=2e-5)  # fp32 arithmetic in a different order than the reference


def _store_inputs(seed: int, t: int, h: int, d: int):
    """Rows with the awkward cases: a zero row, tiny (E4M3-subnormal) and huge (saturating)
    elements, a bf16 input, a padding slot (-1)."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(t, h, d, generator=gen) * 2
    v = torch.randn(t, h, d, generator=gen)
    k[1] = 0.0
    v[2, :, :16] = 1e-4 * torch.randn(h, 16, generator=gen)
    k[3, 0, 5] = 900.0
    v[4, 1, 7] = -3000.0
    slots = torch.randperm(4 * 16, generator=gen)[:t]
    slots[5] = -1
    return k.to(torch.bfloat16), v, slots


STORED = [n for n in CODECS if n not in refused_codecs(SUPPORT, store=True)]


def test_rows_the_kernels_do_not_implement_run_on_the_reference():
    """f16 (and fp8_e5m2's store) are not in `spec.SUPPORT`: the dispatcher declines them. Every
    other row, turbo5 (5-bit codes, 32 levels) and turbo2g64 (groups of 64) included, runs on the
    kernels."""
    assert set(refused_codecs(SUPPORT, store=True)) == {"f16", "fp8_e5m2"}
    assert set(refused_codecs(SUPPORT)) == {"f16"}
    for name in ("turbo5", "turbo2g64"):
        layer = make_layer(CODECS[name], CODECS[name], 2, 16, 1, 64, device=DEVICE)
        for op, params in ((Op.STORE, None), (Op.DECODE, AttentionParams(scale=0.1)),
                           (Op.PREFILL, AttentionParams(scale=0.1))):
            assert select_backend(op, layer.k_pool.device, layer, params, backend=BACKEND) is BACKEND
    for name in refused_codecs(SUPPORT, store=True):
        layer = make_layer(CODECS[name], CODECS[name], 2, 16, 1, 64, device=DEVICE)
        with pytest.raises(InvalidInput, match="not implemented"):
            select_backend(Op.STORE, layer.k_pool.device, layer, None, backend=BACKEND)
        if name in refused_codecs(SUPPORT):
            with pytest.raises(InvalidInput, match="not implemented"):
                select_backend(Op.DECODE, layer.k_pool.device, layer, AttentionParams(scale=0.1), backend=BACKEND)


@pytest.mark.parametrize("name", STORED)
def test_store_writes_the_reference_bytes(name):
    codec = CODECS[name]
    t, h, d = 23, 2, 64
    k, v, slots = _store_inputs(0, t, h, d)
    centre = torch.randn(h, d, generator=torch.Generator().manual_seed(1))
    tgen = torch.Generator().manual_seed(2)
    k_mult, v_centre = torch.rand(h, d, generator=tgen) + 0.5, torch.randn(h, d, generator=tgen)
    layers = [make_layer(codec, codec, 4, 16, h, d, k_scale=0.5, v_scale=2.0, k_centre=centre,
                         k_mult=k_mult, v_centre=v_centre, device=DEVICE) for _ in range(2)]
    api.store(layers[0], k.to(DEVICE), v.to(DEVICE), slots.to(DEVICE), backend="reference")
    api.store(layers[1], k.to(DEVICE), v.to(DEVICE), slots.to(DEVICE), backend=BACKEND)
    # On a GPU the WHT sums in another order than the reference's cuBLAS matmul: an element within
    # ~1e-7 of a decision boundary may take the neighbouring code (docs of ops/triton/store.py).
    flips = 0.002 if DEVICE == "cuda" and codec.rotated else 0.0
    for side in ("k_pool", "v_pool"):
        want, got = getattr(layers[0], side).cpu(), getattr(layers[1], side).cpu()
        assert bool(want.any())
        diff = (want != got).nonzero()
        assert diff.shape[0] <= flips * want.numel(), (
            f"{name} {side}: {diff.shape[0]} bytes differ, first at {diff[:3].tolist()}")


PAIRS = all_pairs(SUPPORT)


def _tiny(k: str, v: str) -> CheckCase:
    return CheckCase(k, v, seq_lens=(19, 1, 33), q_lens=(4, 1, 3), num_kv_heads=1, group=2)


def test_decode_every_pair():
    """Every (K, V) pair of the codecs the backend declares on one tiny ragged batch (GQA 2, a length-1 sequence)."""
    assert len(PAIRS) >= 100
    rows = check_backend(decode_attention=tr.decode_attention, cases=[_tiny(k, v) for k, v in PAIRS],
                         device=DEVICE, **TOL)
    assert len(rows) == len(PAIRS)


def test_prefill_pairs():
    """Prefill reads codes with the same device function as decode: every codec on both sides
    (the 9 same-codec pairs) plus the asymmetric rotation cases (rotated K only / V only)."""
    pairs = [(c, c) for c in CODECS if c not in refused_codecs(SUPPORT)]
    pairs += [("bf16", "turbo3"), ("turbo3", "bf16"), ("q8_0", "turbo8")]
    cases = [_tiny(k, v) for k, v in pairs]
    cases.append(CheckCase("turbo3", "q8_0", seq_lens=(19, 4, 40, 7), q_lens=(3, 0, 21, 7), group=3))  # no queries
    check_backend(prefill_attention=tr.prefill_attention, cases=cases, device=DEVICE, **TOL)


def test_settings_and_shapes():
    """Window, soft-cap, sinks, sparse V, k_centre, GQA 8, head_dim 128/256, block 32, long prefill."""
    settings = default_cases(pairs=[])  # the settings grid only (no all-pairs block)
    assert len(settings) >= 6
    check_backend(**ATTN, cases=settings, device=DEVICE, **TOL)


def test_head_dims_that_are_not_powers_of_two():
    """head_dim 96 / 80: the row tile is padded to 128 and the WHT splits into 64 + 32 / 64 + 16."""
    cases = [CheckCase("turbo3", "turbo2", seq_lens=(21, 4), head_dim=96, group=2),
             CheckCase("turbo8", "q8_0", seq_lens=(9,), head_dim=96),
             CheckCase("nvfp4", "turbo4", seq_lens=(17, 2), head_dim=80, group=1)]
    check_backend(**ATTN, cases=cases, device=DEVICE, **TOL)


def test_groups_of_64_and_5_bit_codes_on_wider_rows():
    """turbo2g64 and turbo5 through the Triton store and attention at head_dim 192 (three groups
    of 64 in a row tile padded to 256) and 128 (two), with GQA, a window, sinks and the transform."""
    cases = [CheckCase("turbo2g64", "turbo5", seq_lens=(21, 4), head_dim=192, group=2),
             CheckCase("turbo5", "turbo2g64", seq_lens=(30, 6), head_dim=128, group=4, sliding_window=12,
                       sinks=True, transform=True)]
    check_backend(**ATTN, store=tr.store, cases=cases, device=DEVICE, **TOL)


def test_a_5_bit_table_without_odd_symmetry_selects_over_all_32_levels(monkeypatch):
    """turbo5's table is odd symmetric, so the kernels select over its lower 16 levels and flip
    the sign (spec.VAL_TABLE_ODD); a 5-bit table that is not takes the 32-level select tree,
    forced here for turbo5 (the same values either way)."""
    from pagedkv.ops.triton import spec

    assert spec.codec_spec(CODECS["turbo5"], 16, 1, 64).values == spec.VAL_TABLE_ODD
    assert spec.codec_spec(CODECS["turbo4"], 16, 1, 64).values == spec.VAL_TABLE
    monkeypatch.setattr(spec, "_values", lambda codec: spec._VALUES[codec.traits.decode])
    assert spec.codec_spec(CODECS["turbo5"], 16, 1, 64).values == spec.VAL_TABLE
    check_backend(**ATTN, cases=[_tiny("turbo5", "turbo5")], device=DEVICE, **TOL)


def test_store_then_attend():
    """The Triton store feeding the Triton attention, compared with the reference end to end."""
    cases = [CheckCase("turbo3", "turbo2", seq_lens=(40, 7), centre=True, k_offset=3.0),
             CheckCase("q4_0", "turbo4", seq_lens=(25,), head_dim=96, group=2),
             CheckCase("bf16", "fp8", seq_lens=(17, 3), sliding_window=8),
             CheckCase("turbo4", "q4_0", seq_lens=(30, 6), group=2, transform=True, sinks=True)]
    check_backend(**ATTN, store=tr.store, cases=cases, device=DEVICE, **TOL)


def test_split_k_partitions_agree():
    """Any number of context partitions (some of them empty) gives the reference output;
    a zero-length (padding) sequence outputs zeros."""
    cc = CheckCase("turbo4", "turbo3", seq_lens=(0, 70, 3), num_kv_heads=2, group=2, sinks=True)
    case = cc.build(device=DEVICE)
    params = cc.params()
    params = replace(params, sinks=params.sinks.to(DEVICE))
    from pagedkv.ops import reference

    want = reference.decode_attention(case.q_decode, case.layer, case.block_tables, case.seq_lens, params)
    for splits, block_n in ((1, 16), (3, 16), (7, 32)):
        got = tr.decode_attention(case.q_decode, case.layer, case.block_tables, case.seq_lens, params,
                                  num_splits=splits, block_n=block_n)
        torch.testing.assert_close(got.cpu(), want.cpu(), **TOL)
        assert bool((got[0] == 0).all())


def test_sparse_v_skips_small_weights():
    """With a threshold the output equals sum over kept weights (no renormalisation): compare
    with the reference at a threshold that drops most positions, and check it differs from exact."""
    cc = CheckCase("turbo8", "q8_0", seq_lens=(64, 30), group=4, sparse_v_threshold=0.02)
    case = cc.build(device=DEVICE)
    exact = replace(cc.params(), sparse_v_threshold=0.0)
    sparse = cc.params()
    from pagedkv.ops import reference

    for fn, ref in ((tr.decode_attention, reference.decode_attention),):
        got = fn(case.q_decode, case.layer, case.block_tables, case.seq_lens, sparse)
        want = ref(case.q_decode, case.layer, case.block_tables, case.seq_lens, sparse)
        full = fn(case.q_decode, case.layer, case.block_tables, case.seq_lens, exact)
        torch.testing.assert_close(got.cpu(), want.cpu(), **TOL)
        assert float((got - full).abs().max()) > 1e-3


def test_dispatch():
    """The triton backend serves CUDA tensors only; asked for on CPU tensors it says so."""
    layer = make_layer(CODECS["turbo3"], CODECS["turbo3"], 2, 16, 1, 64)
    assert select_backend(Op.DECODE, torch.device("cuda"), layer, AttentionParams(scale=1.0)).name == "triton"
    assert select_backend(Op.STORE, torch.device("cpu"), layer, None).name != "triton"
    with pytest.raises(InvalidInput, match="triton"):
        api.store(layer, torch.zeros(1, 1, 64), None, torch.zeros(1, dtype=torch.int64), backend="triton")
    odd = make_layer(CODECS["bf16"], CODECS["bf16"], 2, 16, 1, 8)
    assert not tr.supports(Op.DECODE, odd, None)


def test_missing_triton_says_how_to_install(monkeypatch):
    import importlib

    for mod in [m for m in sys.modules if m == "pagedkv.ops.triton" or m.startswith("pagedkv.ops.triton.")]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setitem(sys.modules, "triton", None)
    with pytest.raises(ImportError, match="pip install triton"):
        importlib.import_module("pagedkv.ops.triton")


def test_lower_precision_matmuls():
    """bf16 / tf32 operands (fp32 accumulation) stay close to the exact reference; bad names fail."""
    cc = CheckCase("turbo4", "bf16", seq_lens=(50, 9), group=2)
    case = cc.build(device=DEVICE)
    from pagedkv.errors import ConfigError
    from pagedkv.ops import reference

    params = cc.params()
    want = reference.decode_attention(case.q_decode, case.layer, case.block_tables, case.seq_lens, params)
    for prec in ("tf32", "bf16"):
        got = tr.decode_attention(case.q_decode, case.layer, case.block_tables, case.seq_lens, params, precision=prec)
        torch.testing.assert_close(got.cpu(), want.cpu(), atol=2e-2, rtol=2e-2)
    fast = tr.make_backend("bf16", name="triton-bf16-test", device_types=(DEVICE,))
    got = api.decode_attention(case.q_decode, case.layer, case.block_tables, case.seq_lens, params, backend=fast)
    torch.testing.assert_close(got.cpu(), want.cpu(), atol=2e-2, rtol=2e-2)
    with pytest.raises(ConfigError, match="precision"):
        tr.make_backend("fp64")
    with pytest.raises(ConfigError, match="precision"):
        tr.decode_attention(case.q_decode, case.layer, case.block_tables, case.seq_lens, params, precision="fp16")


def test_bench_dry_run():
    """The GPU benchmark's logic end to end on tiny shapes (on a GPU: the real device, tiny)."""
    from pagedkv.bench.attention_cuda import BenchConfig, format_table, run_cuda_bench

    cfg = replace(BenchConfig.tiny(), dry_run=DEVICE == "cpu")
    result = run_cuda_bench(cfg)
    ours = [r for r in result["rows"] if r["impl"] == "ours" and r["op"] == "decode"]
    assert {r["format"] for r in ours} == set(cfg.formats)
    by_format = {r["format"]: r["rel_err_vs_sdpa"] for r in ours}
    assert by_format["bf16"] < 1e-2  # the timed kernel computes attention (bf16 pages ~ exact)
    assert by_format["bf16"] < by_format["turbo3"] < 1.0  # the codec's error, bounded
    assert "decode" in format_table(result)


@pytest.mark.parametrize("name,norm_on,rope_kind", [
    ("turbo3", True, "partial"), ("q4_0", True, "full"), ("fp8", False, "partial"),
    ("turbo4", True, None), ("q8_0", True, "multimodal"), ("turbo2g64", True, "full"),
])
def test_fused_norm_rope_store_k(name, norm_on, rope_kind):
    """The fused K kernel returns the reference's fp32 keys (to the last bit or so) and stores
    exactly the bytes the reference store writes for them; k_centre and padding slots included."""
    from pagedkv.ops import reference
    from pagedkv.ops.fused import NormSpec, RopeSpec, store_k_fused
    from pagedkv.ops.triton.fused import store_k_fused as triton_fused

    gen = torch.Generator().manual_seed(3)
    codec, t, h, d = CODECS[name], 13, 2, 64
    k = (torch.randn(t, h, d, generator=gen) * 3).to(DEVICE)
    slots = torch.randperm(48, generator=gen)[:t]
    slots[4] = -1
    slots = slots.to(DEVICE)
    norm = NormSpec(torch.randn(d, generator=gen).to(DEVICE) * 0.1, eps=1e-6, unit_offset=True) if norm_on else None
    rope = {None: None, "full": RopeSpec(theta=5e5), "partial": RopeSpec(rotary_dim=32, attention_scaling=1.1),
            "multimodal": RopeSpec(multimodal=True, mrope_section=(8, 12, 12))}[rope_kind]
    pos = torch.arange(t) + 100
    if rope_kind == "multimodal":
        pos = torch.stack([pos, pos // 3, pos % 5])
    pos = pos.to(DEVICE)
    centre = torch.randn(h, d, generator=gen)
    k_mult = (torch.rand(h, d, generator=gen) + 0.5) if norm_on else None  # k_mult: the torch prologue
    layers = [make_layer(codec, codec, 3, 16, h, d, k_scale=0.25, k_centre=centre, k_mult=k_mult, device=DEVICE)
              for _ in range(3)]
    want = store_k_fused(layers[0], k, slots, pos, norm=norm, rope=rope, backend="reference")
    got = store_k_fused(layers[1], k, slots, pos, norm=norm, rope=rope, backend=BACKEND)  # the hook
    assert bool((triton_fused(layers[2], k, slots, pos, norm=norm, rope=rope) == got).all())
    layers[2].k_pool.zero_()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-6)
    reference.store(layers[2], got, None, slots)
    assert bool((layers[1].k_pool == layers[2].k_pool).all())
    assert bool(layers[1].k_pool.any())


@triton.jit
def _float_helpers_kernel(x_ptr, b_ptr, e_ptr, v_ptr, h_ptr, f_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    x = tl.load(x_ptr + i)
    tl.store(e_ptr + i, e4m3_bits(x))
    tl.store(v_ptr + i, e4m3_value(tl.load(b_ptr + i) & 255))
    tl.store(h_ptr + i, bf16_bits(x))
    tl.store(f_ptr + i, fp16_bits(x))


def test_small_float_helpers_match_torch():
    """The kernels' E4M3 / bf16 / fp16 rounding and E4M3 decoding against torch's conversions:
    every E4M3 byte, their midpoints (ties to even), subnormals, saturation, -0, random values."""
    from pagedkv.codecs.floats import e4m3_table, to_e4m3_bytes

    table = e4m3_table()
    finite = table[torch.isfinite(e4m3_table()) & ~torch.tensor([(b & 0x7F) == 0x7F for b in range(256)])]
    levels = finite.unique()
    mids = (levels[1:] + levels[:-1]) / 2
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([levels, mids, torch.tensor([-0.0, 500.0, -1e6, 2.0**-10, 3 * 2.0**-11, 1e-30]),
                   torch.randn(1000, generator=gen) * 10.0 ** torch.randint(-4, 3, (1000,), generator=gen)])
    n = 1 << (x.numel() - 1).bit_length()
    x = torch.cat([x, torch.zeros(n - x.numel())]).to(DEVICE)
    codes = (torch.arange(n) % 256).to(torch.int32).to(DEVICE)
    outs = [torch.empty(n, dtype=dt, device=DEVICE) for dt in (torch.int32, torch.float32, torch.int32, torch.int32)]
    _float_helpers_kernel[(1,)](x, codes, *outs, N=n)
    e, v, hb, fb = (o.cpu() for o in outs)
    xc = x.cpu()
    assert torch.equal(e.to(torch.uint8), to_e4m3_bytes(xc))
    ok = (codes.cpu() & 0x7F) != 0x7F  # the NaN codes are never written
    assert torch.equal(v[ok], table[codes.cpu()[ok].long()])
    assert torch.equal(hb, xc.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF)
    assert torch.equal(fb, xc.to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF)


def test_cli_bench_attention_cuda(capsys):
    """`pagedkv bench attention --device cuda --json` (a dry run on the CPU, a tiny run on a GPU)."""
    import json

    from pagedkv.cli.main import main

    argv = ["bench", "attention", "--device", "cuda", "--formats", "turbo3", "--precisions", "fp32", "--json"]
    if DEVICE == "cpu":
        assert main(argv[:-1] + ["--batch", "2"]) == 2  # no GPU: one-line error, exit 2
        assert "needs a CUDA GPU" in capsys.readouterr().err
        argv.append("--dry-run")
    else:
        argv += ["--batch", "2", "--contexts", "64"]
    assert main(argv) == 0
    res = json.loads(capsys.readouterr().out)
    assert {(r["op"], r["impl"]) for r in res["rows"] if r["format"] == "turbo3"} == {
        ("decode", "ours"), ("prefill", "ours"), ("store", "ours")}


@pytest.mark.skipif(not DEVICE_IS_CPU, reason="on a GPU every other test compiles the kernels for real")
def test_kernels_compile_for_a_gpu_target(tmp_path):
    """The interpreter does not compile: build the main kernel variants for sm_90 (Triton ->
    PTX -> cubin, no GPU needed) in a subprocess without TRITON_INTERPRET; no compile errors,
    no heavy register spills (tests/triton_compile_check.py)."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    script = os.path.join(os.path.dirname(__file__), "triton_compile_check.py")
    proc = subprocess.run([sys.executable, script, "--arch", "90"], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "0 failures" in proc.stdout


def test_strided_inputs():
    """Column-sliced block tables, strided seq_lens / slot mappings and non-contiguous K/V/q."""
    from pagedkv.ops import reference

    cc = CheckCase("turbo2", "nvfp4", seq_lens=(30, 12), group=2)
    case = cc.build(device=DEVICE)
    params = cc.params()
    wide = torch.full((case.batch, 2 * case.block_tables.shape[1]), -1, dtype=torch.int32, device=DEVICE)
    wide[:, ::2] = case.block_tables  # a strided view with the same values
    tables = wide[:, ::2]
    lens = torch.stack([case.seq_lens, case.seq_lens], 1)[:, 0]
    q = case.q_decode.transpose(0, 1).contiguous().transpose(0, 1)
    want = reference.decode_attention(case.q_decode, case.layer, case.block_tables, case.seq_lens, params)
    got = tr.decode_attention(q, case.layer, tables, lens, params)
    torch.testing.assert_close(got.cpu(), want.cpu(), **TOL)
    k = torch.randn(6, 2, 128, device=DEVICE)[:, :, ::2]
    slots = torch.arange(12, device=DEVICE)[::2]
    layers = [make_layer(CODECS["q4_0"], CODECS["q8_0"], 2, 16, 2, 64, device=DEVICE) for _ in range(2)]
    reference.store(layers[0], k, k, slots)
    tr.store(layers[1], k, k, slots)
    assert bool((layers[0].k_pool == layers[1].k_pool).all()) and bool((layers[0].v_pool == layers[1].v_pool).all())


def test_pools_with_padded_rows():
    """Pools that are views with a row pitch larger than a block (one buffer, padded rows)."""
    from pagedkv.ops import reference
    from pagedkv.ops.batch import PagedLayer

    cc = CheckCase("turbo4", "q4_0", seq_lens=(20, 5), group=2)
    case = cc.build(device=DEVICE)
    lay = case.layer
    def padded(pool):
        big = torch.zeros(pool.shape[0], pool.shape[1] + 48, dtype=torch.uint8, device=DEVICE)
        big[:, : pool.shape[1]] = pool
        return big[:, : pool.shape[1]]
    view = PagedLayer(padded(lay.k_pool), padded(lay.v_pool), lay.k_codec, lay.v_codec, lay.block_size,
                      lay.num_kv_heads, lay.head_dim, lay.k_scale, lay.v_scale)
    assert view.k_pool.stride(0) != view.k_pool.shape[1] and tr.supports(Op.DECODE, view, None)
    params = cc.params()
    want = reference.decode_attention(case.q_decode, lay, case.block_tables, case.seq_lens, params)
    got = tr.decode_attention(case.q_decode, view, case.block_tables, case.seq_lens, params)
    torch.testing.assert_close(got.cpu(), want.cpu(), **TOL)
    got = tr.prefill_attention(case.q_prefill, view, case.block_tables, case.seq_lens, case.query_start_loc, params)
    want = reference.prefill_attention(case.q_prefill, lay, case.block_tables, case.seq_lens, case.query_start_loc, params)
    torch.testing.assert_close(got.cpu(), want.cpu(), **TOL)
    k = torch.randn(4, lay.num_kv_heads, lay.head_dim, device=DEVICE)
    reference.store(lay, k, k, torch.arange(4, device=DEVICE))
    tr.store(view, k, k, torch.arange(4, device=DEVICE))
    assert bool((view.v_pool == lay.v_pool).all())  # q4_0: deterministic bytes on every device


def test_kernels_stay_inside_their_buffers_without_checks():
    """checks=False on CUDA skips the host-side index checks; the kernels mask and clamp instead
    (issue 12 item 6): a slot past the pool writes nothing (guard bytes just past the pool stay),
    a block id past the pool reads a block inside it (clamped: the output equals the one with the
    last block), q8_0 / q4_0 scales saturate as the reference's do."""
    from pagedkv.ops import PagedLayer

    codec = CODECS["q8_0"]
    base = make_layer(codec, CODECS["q4_0"], 4, 16, 1, 64, device=DEVICE)
    kbuf, vbuf = base.k_pool.fill_(0x5A), base.v_pool.fill_(0x5A)
    layer = PagedLayer(kbuf[:2], vbuf[:2], codec, CODECS["q4_0"], 16, 1, 64, base.k_scale, base.v_scale)
    x = torch.randn(3, 1, 64, device=DEVICE)
    x[0, 0, 3] = 3e7  # past 127 * 65504 (q8_0) and 8 * 65504 (q4_0)
    tr.store(layer, x, x, torch.tensor([0, 32, 40], device=DEVICE))  # 32, 40: past 2 x 16 slots
    assert bool((kbuf[2:] == 0x5A).all()) and bool((vbuf[2:] == 0x5A).all())
    ref = make_layer(codec, CODECS["q4_0"], 2, 16, 1, 64, device=DEVICE)
    ref.k_pool.fill_(0x5A), ref.v_pool.fill_(0x5A)
    api.store(ref, x[:1], x[:1], torch.tensor([0], device=DEVICE), backend="reference")
    assert torch.equal(kbuf[:2].cpu(), ref.k_pool.cpu()) and torch.equal(vbuf[:2].cpu(), ref.v_pool.cpu())
    tr.store(layer, torch.randn(32, 1, 64, device=DEVICE), torch.randn(32, 1, 64, device=DEVICE),
             torch.arange(32, device=DEVICE))
    q = torch.randn(1, 2, 64, device=DEVICE)
    lens = torch.tensor([30], dtype=torch.int32, device=DEVICE)
    params = AttentionParams(scale=0.125)
    wild = tr.decode_attention(q, layer, torch.tensor([[0, 3]], dtype=torch.int32, device=DEVICE), lens, params)
    tame = tr.decode_attention(q, layer, torch.tensor([[0, 1]], dtype=torch.int32, device=DEVICE), lens, params)
    torch.testing.assert_close(wild, tame, atol=0, rtol=0)
    qp = torch.randn(4, 2, 64, device=DEVICE)
    qsl = torch.tensor([0, 4], dtype=torch.int32, device=DEVICE)
    long_lens = torch.tensor([40], dtype=torch.int32, device=DEVICE)  # past the 2-block table
    out = tr.prefill_attention(qp, layer, torch.tensor([[0, 3]], dtype=torch.int32, device=DEVICE),
                               long_lens, qsl, params)
    assert bool(torch.isfinite(out).all())
