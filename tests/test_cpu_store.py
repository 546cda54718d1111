"""The C cache write of the "cpu" backend (pagedkv.ops.cpu.write) against the reference store.

Oracle: `pagedkv.ops.reference.store.store` on a twin layer; the pools must hold the same bytes.
Every codec of the catalogue, head dims 64 / 128 and one valid non-power-of-two, random slots with
negatives (skipped), k_centre, fp8 tensor scales, float32 / bfloat16 / float16 and strided
inputs, and values that stress the rules: zero rows, huge and tiny (fp32 subnormal) values,
rows made of exact levels times an E4M3 scale (exact ties between scale candidates).

Beyond the catalogue, rows the C store declares (`write.STORE_SUPPORT`) but no catalogue row has
(integer rules at 2..7 bits, table and integer rows with groups 8..64) must write the reference's
bytes too: the C store derives everything from the row.

Tolerance (table codecs only: nvfp4, turbo2/3/4/5, turbo2g64). Both stores compute each candidate
scale's per-element squared terms with the same fp32 operations, but a group's error is a sum of G
fp32 terms, and a different summation order rounds differently. The C store sums in the order of
torch's CPU kernel (8-lane vectors, 4 accumulators), so here nothing should differ; on a machine
whose torch sums in another order (other SIMD width) two candidates whose errors agree to within
rounding may swap. Any order of n nonnegative fp32 terms is within (n-1) * 2^-24 * S of the exact
sum S (recursive summation bound), so when the C store prefers candidate a over the reference's
b, the exact sums obey S(a) <= S(b) * (1 + 2 * (G - 1) * 2^-24), i.e. 1.8e-6 relative for G = 16
(the exact S computed in fp64 from the same fp32 terms). A flipped group must satisfy that and
flips must stay rare (<= 0.1% of groups); every other byte must be equal.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging

import pytest
import torch

from pagedkv.codecs import wht
from pagedkv.codecs.catalogue import CODECS, Codec, ScaleType, ValueKind
from pagedkv.codecs.floats import from_e4m3_bytes
from pagedkv.codecs.layout import block_views
from pagedkv.codecs.packing import unpack
from pagedkv.errors import InvalidInput
from pagedkv.ops import api, make_layer
from pagedkv.ops.dispatch import Op, get_backend, log_fallback_once, select_backend

ref_store = importlib.import_module("pagedkv.ops.reference.store")
cpu = pytest.importorskip("pagedkv.ops.cpu")
from pagedkv.ops.cpu import build as kbuild  # noqa: E402
from pagedkv.ops.cpu import write as cstore  # noqa: E402

if not cpu.available():
    pytestmark = pytest.mark.skip(reason=f"CPU kernel unavailable: {cpu.kernel_info()}")

def sum_rel_tol(codec) -> float:
    """See the module docstring: twice the recursive summation bound of a group's G terms."""
    return 2 * (codec.group_size - 1) * 2.0**-24


MAX_FLIP_FRACTION = 1e-3
BLOCK_SIZE, NUM_BLOCKS = 16, 12


def odd_head_dim(codec) -> int:
    """A valid head_dim that is not a power of two (80 for group-16 codecs, 96 for group-32 / 24 /
    48, 192 for group-64)."""
    for d in (80, 96, 192):
        try:
            codec.check_head_dim(d)
            return d
        except Exception:
            continue
    raise AssertionError(codec)


def make_values(t: int, h: int, d: int, codec, gen: torch.Generator) -> torch.Tensor:
    """float32 [t, h, d]: Gaussian rows of spread magnitudes plus the awkward cases."""
    x = torch.randn(t, h, d, generator=gen) * torch.exp(torch.randn(t, h, 1, generator=gen) * 2)
    x[0] = 0.0  # zero rows: scale 0
    x[1, 0, :5] = 0.0  # a zero run inside a row
    x[2] *= 3e3  # large (E4M3 scales saturate at 448 for the table codecs)
    x[3, :, : d // 2] = 1e-41  # fp32 subnormals
    x[4] *= 1e-20  # tiny groups
    table = codec.value_table()
    if table is not None and t > 6:  # exact levels times an E4M3 scale: candidates tie exactly
        idx = torch.randint(0, table.numel(), (h, d), generator=gen)
        x[5] = table[idx].nan_to_num() * float(from_e4m3_bytes(torch.tensor([0x38], dtype=torch.uint8)))
        x[6, :, :] = 1.5
        x[6, :, 1::3] = -1.5  # equal magnitudes: q4_0 takes the first of the largest
    return x


def twin_layers(codec, h, d, centre, k_scale, v_scale):
    base = make_layer(codec, codec, NUM_BLOCKS, BLOCK_SIZE, h, d)
    base = dataclasses.replace(base, k_centre=centre, k_scale=torch.tensor([k_scale]),
                               v_scale=torch.tensor([v_scale]))
    other = dataclasses.replace(base, k_pool=base.k_pool.clone(), v_pool=base.v_pool.clone())
    return base, other


def random_slots(t: int, gen: torch.Generator) -> torch.Tensor:
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=gen)[:t].long()
    neg = torch.rand(t, generator=gen) < 0.2
    slots[neg] = -1 - torch.randint(0, 5, (int(neg.sum()),), generator=gen)
    return slots


def _group_terms(codec, x_groups, data_groups, scale_groups):
    """The reference's fp32 squared terms of each group [N, G] for the stored codes and scale."""
    codes = unpack(data_groups, codec.code_bits, codec.group_size).long()
    vals = codec.value_table()[codes]
    s = from_e4m3_bytes(scale_groups.reshape(-1))[:, None]
    return (x_groups - vals * s).square()


def compare_side(codec, want_pool, got_pool, layer, x_stored, slots):
    """Assert the pools agree (see the module doc for the table codecs' tolerance).

    x_stored: float32 [T, H, D], the values the codec encodes (centred, rotated if it rotates)."""
    if torch.equal(want_pool, got_pool):
        return 0
    table_search = codec.scale_type is ScaleType.FP8_E4M3
    assert table_search, f"{codec.name}: bytes differ where no summation is involved"
    h, d, g = layer.num_kv_heads, layer.head_dim, codec.group_size
    wd, ws = block_views(codec, want_pool, layer.block_size, h, d)
    gd, gs = block_views(codec, got_pool, layer.block_size, h, d)
    keep = slots >= 0
    blocks, offs = slots[keep] // layer.block_size, slots[keep] % layer.block_size
    gbytes = g * codec.code_bits // 8
    want_d = wd[blocks, offs].reshape(-1, gbytes)
    got_d = gd[blocks, offs].reshape(-1, gbytes)
    want_s = ws[blocks, offs].reshape(-1, 1)
    got_s = gs[blocks, offs].reshape(-1, 1)
    # every byte outside the written rows is untouched by both stores
    assert int((want_pool != got_pool).sum()) == int((want_d != got_d).sum() + (want_s != got_s).sum())
    flipped = ((want_d != got_d).any(-1) | (want_s != got_s).any(-1))
    n_flip = int(flipped.sum())
    assert n_flip <= max(1, MAX_FLIP_FRACTION * flipped.numel()), (codec.name, n_flip, flipped.numel())
    xg = x_stored[keep].reshape(-1, g)[flipped]
    err_want = _group_terms(codec, xg, want_d[flipped], want_s[flipped]).double().sum(-1)
    err_got = _group_terms(codec, xg, got_d[flipped], got_s[flipped]).double().sum(-1)
    assert bool((err_got <= err_want * (1 + sum_rel_tol(codec))).all()), (codec.name, err_got, err_want)
    return n_flip


def run_case(codec, d, *, h=3, t=40, dtype=torch.float32, centre=True, strided=False, seed=0):
    gen = torch.Generator().manual_seed(seed * 1000 + d)
    x = make_values(t, h, d, codec, gen)
    v = make_values(t, h, d, codec, gen).flip(0) * 0.5
    c = torch.randn(h, d, generator=gen) * 0.3 if centre else None
    slots = random_slots(t, gen)
    k_in, v_in = x.to(dtype), v.to(dtype)
    if strided:  # last dim contiguous, the others not
        k_in = k_in.transpose(0, 1).contiguous().transpose(0, 1)
        v_in = torch.cat([v_in, v_in], -1)[..., :d]
    want, got = twin_layers(codec, h, d, c, 0.37, 0.011)
    ref_store.store(want, k_in, v_in, slots)
    cpu.store(got, k_in, v_in, slots)
    k_enc = k_in.float() - (c if c is not None else 0.0)
    v_enc = v_in.float()
    if codec.rotated:
        k_enc, v_enc = wht.rotate(k_enc), wht.rotate(v_enc)
    flips = compare_side(codec, want.k_pool, got.k_pool, want, k_enc, slots)
    flips += compare_side(codec, want.v_pool, got.v_pool, want, v_enc, slots)
    return flips


CASES = [(name, d) for name, c in CODECS.items() for d in (64, 128, odd_head_dim(c))]


@pytest.mark.parametrize("name,d", CASES)
def test_store_bytes_equal_reference(name, d):
    codec = CODECS[name]
    flips = sum(run_case(codec, d, seed=s) for s in range(2))
    assert flips == 0 or codec.scale_type is ScaleType.FP8_E4M3


@pytest.mark.parametrize("name", list(CODECS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_and_strided_rows(name, dtype):
    run_case(CODECS[name], 64, dtype=dtype, strided=True, seed=3)


def test_no_centre_all_slots_negative_and_empty():
    codec = CODECS["turbo3"]
    run_case(codec, 64, centre=False)
    want, got = twin_layers(codec, 2, 64, None, 1.0, 1.0)
    x = torch.randn(5, 2, 64)
    cpu.store(got, x, x, torch.full((5,), -1, dtype=torch.int64))
    cpu.store(got, x[:0], x[:0], torch.zeros(0, dtype=torch.int64))
    assert torch.equal(got.k_pool, want.k_pool) and torch.equal(got.v_pool, want.v_pool)


def test_one_side_only_and_block_size_not_16():
    codec = CODECS["nvfp4"]
    layer = make_layer(CODECS["turbo2"], codec, 6, 24, 2, 64)
    twin = dataclasses.replace(layer, k_pool=layer.k_pool.clone(), v_pool=layer.v_pool.clone())
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(30, 2, 64, generator=gen)
    slots = torch.randperm(6 * 24, generator=gen)[:30].long()
    ref_store.store(layer, None, x, slots)
    cpu.store(twin, None, x, slots)
    ref_store.store(layer, x, None, slots)
    cpu.store(twin, x, None, slots)
    assert torch.equal(layer.k_pool, twin.k_pool) and torch.equal(layer.v_pool, twin.v_pool)


V, S = ValueKind, ScaleType
# rows the C store declares that the catalogue does not hold: other widths and groups of its rules
BEYOND_CATALOGUE = [
    Codec("q2_test", 2, V.INT, 32, S.FP16, False, "q4_0's rule at 2 bits"),
    Codec("q3_test", 3, V.INT, 16, S.BF16, False, "q4_0's rule at 3 bits, bf16 scale"),
    Codec("q5_test", 5, V.INT, 32, S.FP16, False, "q4_0's rule at 5 bits"),
    Codec("q7_test", 7, V.INT, 64, S.FP16, False, "q4_0's rule at 7 bits, group 64"),
    Codec("q8g8_test", 8, V.INT, 8, S.FP16, False, "q8_0's rule, group 8"),
    Codec("nvfp4g8_test", 4, V.E2M1, 8, S.FP8_E4M3, False, "E2M1, group 8"),
    Codec("nvfp4g24_test", 4, V.E2M1, 24, S.FP8_E4M3, False, "E2M1, group 24"),
    Codec("nvfp4g32_test", 4, V.E2M1, 32, S.FP8_E4M3, True, "E2M1, group 32, rotated"),
    Codec("nvfp4g48_test", 4, V.E2M1, 48, S.FP8_E4M3, False, "E2M1, group 48"),
    Codec("fp8g32_test", 8, V.FP8_E4M3, 32, S.FP16, False, "turbo8's rule, group 32, fp16 scale"),
]


@pytest.mark.parametrize("codec", BEYOND_CATALOGUE, ids=lambda c: c.name)
def test_rows_beyond_the_catalogue_store_the_reference_bytes(codec, monkeypatch):
    assert cstore.STORE_SUPPORT.refusal(codec, store=True) is None
    monkeypatch.setattr(cstore, "reference_store_side", _no_fallback)
    for d in (64 if codec.group_size <= 64 and 64 % codec.group_size == 0 else 96, odd_head_dim(codec)):
        run_case(codec, d, seed=4)


def _no_fallback(*args, **kwargs):
    raise AssertionError("the C store handed a declared row to the reference store")


def test_declared_support_is_what_runs(monkeypatch):
    """Every catalogue row is declared and stored in C, never handed to the reference store; the
    backend's declaration is the C store's."""
    assert cpu.BACKEND.codecs.encode == cstore.STORE_SUPPORT.encode
    monkeypatch.setattr(cstore, "reference_store_side", _no_fallback)
    for codec in CODECS.values():
        assert cstore.STORE_SUPPORT.refusal(codec, store=True) is None, codec.name
        desc = cstore.store_desc(codec)
        if codec.values in (ValueKind.E2M1, ValueKind.LLOYD_MAX):
            assert desc.kind == cstore.SK_TABLE and desc.levels.numel() == 2**codec.code_bits
        run_case(codec, 64, t=12, seed=5)


def test_an_undeclared_row_goes_to_the_reference_logged_once(caplog):
    """A row past the declaration (a group of 80) is never handed to the C store: the dispatcher
    picks the reference store and says so once per codec and reason."""
    wide = Codec("q8g80_test", 8, V.INT, 80, S.FP16, False, "q8_0's rule, group 80")
    assert "group size 80" in cstore.STORE_SUPPORT.refusal(wide, store=True)
    assert cstore.store_desc(wide) is None
    log_fallback_once.cache_clear()
    layer = make_layer(wide, CODECS["bf16"], 4, 16, 1, 80)
    x = torch.randn(3, 1, 80)
    with caplog.at_level(logging.WARNING, logger="pagedkv.ops.dispatch"):
        for _ in range(3):
            assert select_backend(Op.STORE, layer.device, layer, None).name == "reference"
            api.store(layer, x, x, torch.arange(3, dtype=torch.int64))
    lines = [r.getMessage() for r in caplog.records if "q8g80_test" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "store on cpu runs on the reference ops" in lines[0] and "group size 80" in lines[0]


def test_a_call_the_c_store_cannot_run_is_logged_once(caplog):
    """A pool whose rows are not byte-contiguous runs the reference store for that side, with one
    log line per codec and reason, however many calls."""
    codec = CODECS["nvfp4"]
    layer = make_layer(codec, codec, 4, 16, 1, 64)
    wide = torch.zeros(4, layer.k_pool.shape[1] * 2, dtype=torch.uint8)
    odd = dataclasses.replace(layer, k_pool=wide[:, ::2])
    x = torch.randn(5, 1, 64)
    log_fallback_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger="pagedkv.ops.dispatch"):
        for _ in range(3):
            cpu.store(odd, x, x, torch.arange(5, dtype=torch.int64))
    lines = [r.getMessage() for r in caplog.records if "CPU store of nvfp4" in r.getMessage()]
    assert lines == ["pagedkv: the CPU store of nvfp4 runs on the reference store: the pool's rows are "
                     "not byte-contiguous"], lines


def test_dispatcher_picks_the_c_store_for_cpu_layers():
    layer = make_layer(CODECS["turbo3"], CODECS["q4_0"], 4, 16, 2, 64)
    chosen = select_backend(Op.STORE, layer.device, layer, None)
    assert chosen.name == "cpu" and chosen.store is cpu.store
    assert get_backend("reference").store is ref_store.store
    assert select_backend(Op.STORE, layer.device, layer, None, "reference").name == "reference"
    # public op, automatic vs reference backend: same bytes
    twin = dataclasses.replace(layer, k_pool=layer.k_pool.clone(), v_pool=layer.v_pool.clone())
    x = torch.randn(20, 2, 64)
    slots = torch.arange(20, dtype=torch.int64) * 3 % 64
    api.store(layer, x, x, slots)
    api.store(twin, x, x, slots, backend="reference")
    assert torch.equal(layer.k_pool, twin.k_pool) and torch.equal(layer.v_pool, twin.v_pool)


def test_reference_backend_still_runs_the_reference(monkeypatch):
    calls = []
    real = ref_store._encode_side  # the reference's encoder, one call per side
    monkeypatch.setattr(ref_store, "_encode_side", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    layer = make_layer(CODECS["turbo4"], CODECS["turbo4"], 4, 16, 1, 64)
    x = torch.randn(3, 1, 64)
    api.store(layer, x, x, torch.arange(3, dtype=torch.int64), backend="reference")
    assert len(calls) == 2
    api.store(layer, x, x, torch.arange(3, 6, dtype=torch.int64))
    assert len(calls) == 2  # the automatic choice on CPU is the C store


@pytest.mark.parametrize("checks", [True, False])
def test_bad_values_raise_before_any_write(checks):
    layer = make_layer(CODECS["turbo3"], CODECS["fp8"], 4, 16, 2, 64)
    x = torch.randn(6, 2, 64)
    x[4, 1, 7] = float("nan")
    slots = torch.arange(6, dtype=torch.int64)
    with pytest.raises(InvalidInput) as got:
        api.store(layer, x, None, slots, checks=checks)
    with pytest.raises(InvalidInput) as want:
        api.store(layer, x, None, slots, checks=checks, backend="reference")
    assert str(got.value) == str(want.value)
    assert not layer.k_pool.any() and not layer.v_pool.any()
    # an infinite value in V, checks on or off: neither side is written (issue 12 item 10)
    v = torch.randn(6, 2, 64)
    v[0, 0, 0] = float("inf")
    with pytest.raises(InvalidInput, match="v holds NaN or Inf"):
        api.store(layer, torch.randn(6, 2, 64), v, slots, checks=checks)
    assert not layer.k_pool.any() and not layer.v_pool.any()
    # shape errors come from validation, unchanged
    with pytest.raises(InvalidInput, match="k must have shape"):
        api.store(layer, x[:, :1], None, slots)


def test_nan_in_a_skipped_row_is_ignored_like_the_reference():
    codec = CODECS["q8_0"]
    want, got = twin_layers(codec, 1, 64, None, 1.0, 1.0)
    x = torch.randn(4, 1, 64)
    x[2] = float("nan")
    slots = torch.tensor([0, 1, -1, 3])
    ref_store.store(want, x, x, slots)
    cpu.store(got, x, x, slots)
    assert torch.equal(want.k_pool, got.k_pool) and torch.equal(want.v_pool, got.v_pool)


def test_pool_without_contiguous_rows_falls_back_to_the_reference():
    codec = CODECS["turbo2"]
    layer = make_layer(codec, codec, 4, 16, 1, 64)
    wide = torch.zeros(4, layer.k_pool.shape[1] * 2, dtype=torch.uint8)
    odd = dataclasses.replace(layer, k_pool=wide[:, ::2], v_pool=torch.zeros_like(layer.v_pool))
    x = torch.randn(5, 1, 64)
    slots = torch.arange(5, dtype=torch.int64) * 7
    cpu.store(odd, x, x, slots)
    ref_store.store(layer, x, x, slots)
    assert torch.equal(odd.k_pool, layer.k_pool) and torch.equal(odd.v_pool, layer.v_pool)


@pytest.mark.parametrize("variant", ["scalar", "avx2"])
def test_portable_variants_write_the_same_bytes(tmp_path, variant):
    """The portable C path (no SIMD intrinsics; compiler-vectorised with AVX2) is exact too."""
    if variant == "avx2" and kbuild.detect_variant() == "scalar":
        pytest.skip("no AVX2 here")
    loaded = cpu.kernel_info()["variant"]  # the session's build (conftest's --kernel-variant, else the best)
    try:
        cpu.load(kbuild.KernelConfig(cache_dir=str(tmp_path), variant=variant))
        for codec in [*CODECS.values(), *BEYOND_CATALOGUE[2:7]]:
            run_case(codec, 96 if codec.group_size and 64 % codec.group_size else 64, t=24, seed=7)
    finally:
        cpu.load(kbuild.KernelConfig(variant=loaded))


def _c_group_sums(x: torch.Tensor, lanes: int) -> torch.Tensor:
    import ctypes

    out = torch.empty(x.shape[0])
    rc = cpu._require().lib.pkv_store_group_sums(ctypes.c_void_p(x.data_ptr()), x.shape[1], x.shape[0], lanes,
                                                  ctypes.c_void_p(out.data_ptr()))
    assert rc == 0
    return out


@pytest.mark.parametrize("group", range(8, 65, 8))
def test_the_scale_search_sums_a_group_as_torch_does(group):
    """The C scale search sums a group's squared errors in torch's CPU order (the reference's pick
    at exact ties depends on it): bit-equal to torch's sum on terms of wide range, where another
    order (one lane at a time) rounds differently."""
    gen = torch.Generator().manual_seed(group)
    x = (torch.randn(16, group, generator=gen) * torch.exp(torch.randn(16, group, generator=gen) * 4)).square()
    assert torch.equal(_c_group_sums(x, cstore.torch_sum_lanes()), x.sum(-1))
    if group >= 16:
        assert not torch.equal(_c_group_sums(x, 1), x.sum(-1))


@pytest.mark.parametrize("lanes", [8, 16])
def test_the_lane_probe_sums_as_the_c_store_does(lanes):
    """torch_sum_lanes() is found by comparing torch's sums with a Python copy of the C order
    (`write._lane_order_sum`); that copy must be the C order for either lane count."""
    from pagedkv.ops.cpu.write import _lane_order_sum

    gen = torch.Generator().manual_seed(lanes)
    for group in (8, 16, 40, 64):
        x = (torch.randn(16, group, generator=gen) * torch.exp(torch.randn(16, group, generator=gen) * 4)).square()
        rows = [list(r) for r in x.numpy()]
        assert _c_group_sums(x, lanes).tolist() == [_lane_order_sum(r, lanes) for r in rows]


@pytest.mark.slow
def test_the_avx512_path_emulated_where_the_cpu_lacks_it(tmp_path, monkeypatch):
    """On a CPU without AVX-512 the avx512 build's store path is checked through SIMDe's portable
    intrinsics (tests/helpers/simde_store.py): the reference's bytes for every catalogue row and
    the rows beyond it. (Where the CPU has AVX-512, the session's build runs the path natively.)"""
    import ctypes

    from helpers import simde_store

    if kbuild.detect_variant() == "avx512":
        pytest.skip("this CPU runs the AVX-512 store natively (the other tests)")
    lib = simde_store.build(kbuild.STORE_SOURCE, tmp_path)
    if lib is None:
        pytest.skip("SIMDe headers (libsimde-dev) or a C compiler missing")
    lib.pkv_store.restype = ctypes.c_int
    lib.pkv_store.argtypes = [ctypes.POINTER(cstore._StoreArgs)]
    monkeypatch.setattr(cpu, "store", lambda layer, k, v, slots: cstore.store(lib, layer, k, v, slots))
    for codec in [*CODECS.values(), *BEYOND_CATALOGUE]:
        run_case(codec, 96 if codec.group_size and 64 % codec.group_size else 64, t=24, seed=8)


def test_tolerance_rejects_a_worse_scale_choice():
    """The near-tie allowance is no blanket pass: a group stored with another scale fails it."""
    codec = CODECS["turbo3"]
    want, _ = twin_layers(codec, 2, 64, None, 1.0, 1.0)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(8, 2, 64, generator=gen)
    slots = torch.arange(8, dtype=torch.int64)
    ref_store.store(want, x, None, slots)
    bad = want.k_pool.clone()
    _, scales = block_views(codec, bad, BLOCK_SIZE, 2, 64)
    scales[0, 3, 1, 2] += 1  # one group, the next E4M3 scale up
    with pytest.raises(AssertionError):
        compare_side(codec, want.k_pool, bad, want, wht.rotate(x), slots)
    assert compare_side(codec, want.k_pool, want.k_pool.clone(), want, wht.rotate(x), slots) == 0


def test_column_slice_pools_and_strided_last_dim():
    """Pools that are column slices of a wider buffer (latent sections) and inputs whose last dim
    is not contiguous write the reference's bytes."""
    codec = CODECS["turbo4"]
    layer = make_layer(codec, CODECS["q4_0"], 5, 16, 2, 64)
    kw = torch.zeros(5, layer.k_pool.shape[1] + 40, dtype=torch.uint8)
    vw = torch.zeros(5, layer.v_pool.shape[1] + 24, dtype=torch.uint8)
    sliced = dataclasses.replace(layer, k_pool=kw[:, 40:], v_pool=vw[:, :layer.v_pool.shape[1]])
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(20, 2, 128, generator=gen)[..., ::2]  # stride 2 along head_dim
    slots = torch.randperm(80, generator=gen)[:20].long()
    ref_store.store(layer, x, x, slots)
    cpu.store(sliced, x, x, slots)
    assert torch.equal(sliced.k_pool, layer.k_pool) and torch.equal(sliced.v_pool, layer.v_pool)
    assert not kw[:, :40].any() and not vw[:, layer.v_pool.shape[1]:].any()


def test_without_the_kernel_the_reference_store_runs():
    """No compiler = the module registers no "cpu" backend; the dispatcher then runs the reference."""
    from pagedkv.ops.dispatch import register_backend, unregister_backend

    layer = make_layer(CODECS["turbo3"], CODECS["turbo3"], 4, 16, 1, 64)
    unregister_backend("cpu")
    try:
        assert select_backend(Op.STORE, layer.device, layer, None).name == "reference"
    finally:
        register_backend(cpu.BACKEND)
    assert select_backend(Op.STORE, layer.device, layer, None).name == "cpu"


def test_shared_backend_check_every_pair_store_exact():
    """The shared backend check (tests/helpers/backend_check.py): every codec pair and the settings
    grid (k_centre, GQA, head dims, block sizes) store the reference's bytes through the C store."""
    from helpers.backend_check import check_backend, default_cases

    results = check_backend(store=cpu.store, cases=default_cases())
    assert len(results) >= len(CODECS) ** 2
    assert max(r["store_max_diff"] for r in results) == 0


def test_the_store_plan_cache_is_bounded():
    """One cached store plan per (codec, geometry), cleared past `_MAX_PLANS`: a process that
    meets many geometries never grows it without bound, and a plan after the clear is rebuilt."""
    from types import SimpleNamespace

    write = importlib.import_module("pagedkv.ops.cpu.write")
    codec = CODECS["turbo3"]
    write._PLANS.clear()
    for bs in range(1, write._MAX_PLANS + 40):
        write._side_plan(codec, SimpleNamespace(block_size=bs, num_kv_heads=1, head_dim=16))
        assert len(write._PLANS) <= write._MAX_PLANS
    again = write._side_plan(codec, SimpleNamespace(block_size=1, num_kv_heads=1, head_dim=16))
    assert write._PLANS[(id(codec), 1, 1, 16)] == (codec, again) and again.why is None
