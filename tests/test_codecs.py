"""Codec catalogue: byte sizes from the DESIGN table, round trips, packing, WHT, Lloyd-Max, errors."""

import math

import pytest
import torch

from pagedkv.codecs import CODECS, decode, encode, get_codec, roundtrip
from pagedkv.codecs import packing, wht
from pagedkv.codecs.floats import (e2m1_table, e5m2_table, from_e4m3_bytes, to_e2m1_codes, to_e4m3_bytes,
                                   to_e5m2_bytes)
from pagedkv.codecs.lloyd_max import gaussian_levels, gaussian_mse
from pagedkv.codecs.layout import block_views
from pagedkv.errors import ConfigError, InvalidInput

# The table of DESIGN.md, written out independently: (data bytes, scale bytes) for E elements.
DESIGN_TABLE = {
    "bf16": lambda E: (2 * E, 0),
    "f16": lambda E: (2 * E, 0),
    "fp8": lambda E: (E, 0),
    "fp8_e5m2": lambda E: (E, 0),
    "turbo5": lambda E: (5 * E // 8, E // 16),
    "nvfp4": lambda E: (E // 2, E // 16),
    "turbo4": lambda E: (E // 2, E // 16),
    "turbo4g32": lambda E: (E // 2, E // 32),
    "turbo3": lambda E: (3 * E // 8, E // 16),
    "turbo3g32": lambda E: (3 * E // 8, E // 32),
    "turbo2": lambda E: (E // 4, E // 16),
    "turbo2g64": lambda E: (E // 4, E // 64),
    "turbo8": lambda E: (E, E // 16 * 2),
    "q8_0": lambda E: (E, E // 32 * 2),
    "q4_0": lambda E: (E // 2, E // 32 * 2),
}
DESIGN_BITS = {"bf16": 16, "f16": 16, "fp8": 8, "fp8_e5m2": 8, "turbo5": 5.5, "nvfp4": 4.5, "turbo4": 4.5, "turbo4g32": 4.25, "turbo3": 3.5, "turbo3g32": 3.25, "turbo2": 2.5, "turbo2g64": 2.125,
               "turbo8": 9, "q8_0": 8.5, "q4_0": 4.5}
# Documented round-trip tolerance (normalised MSE on iid N(0,1), head_dim 128).
TOLERANCE = {"bf16": 1e-5, "f16": 1e-7, "fp8": 1e-3, "fp8_e5m2": 3e-3, "turbo5": 0.0014, "nvfp4": 0.009, "turbo4": 0.0050, "turbo4g32": 0.0062, "turbo3": 0.0212, "turbo3g32": 0.0260,
             "turbo2": 0.0945, "turbo2g64": 0.122, "turbo8": 0.0015, "q8_0": 5e-5, "q4_0": 0.009}


def test_catalogue_is_the_design_table():
    assert set(CODECS) == set(DESIGN_TABLE)
    for name, codec in CODECS.items():
        assert codec.bits_per_element == DESIGN_BITS[name]


@pytest.mark.parametrize("bs,h,d", [(16, 3, 64), (16, 8, 128), (32, 2, 256), (8, 1, 96)])
@pytest.mark.parametrize("name", list(CODECS))
def test_block_bytes_match_design_formula(name, bs, h, d):
    codec = CODECS[name]
    if d % max(codec.group_size, 1):
        pytest.skip("head_dim not a multiple of the group")
    E = bs * h * d
    data, scale = DESIGN_TABLE[name](E)
    assert codec.data_bytes(E) == data and codec.scale_bytes(E) == scale
    assert codec.block_bytes(bs, h, d) == data + scale
    # rows tile the block exactly (token-major data section, then scale section)
    assert bs * h * codec.row_bytes(d) == data + scale


def _gaussian(n=2048, d=128, seed=0):
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", list(CODECS))
def test_roundtrip_within_documented_tolerance(name):
    x = _gaussian()
    y = roundtrip(CODECS[name], x, tensor_scale=float(x.abs().max()) / 448)
    err = float(((x - y) ** 2).sum() / (x**2).sum())
    assert err <= TOLERANCE[name], (name, err)


def test_bf16_roundtrip_is_exact():
    x = _gaussian().to(torch.bfloat16)
    assert torch.equal(roundtrip(CODECS["bf16"], x), x.float())


def test_turbo_nmse_bars_of_issue():
    x = _gaussian(8192)
    got = {n: float(((x - roundtrip(CODECS[n], x)) ** 2).sum() / (x**2).sum())
           for n in ("turbo5", "turbo4", "turbo3", "turbo2", "turbo8")}
    assert got["turbo5"] <= got["turbo4"] / 3  # each bit buys ~4x (rate-distortion 4^-b)
    assert got["turbo4"] <= 0.0060 and got["turbo3"] <= 0.024
    assert got["turbo2"] <= 0.100 and got["turbo8"] <= 0.0015


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_packing_roundtrips_every_code_value(bits):
    n = 2**bits * 8
    codes = (torch.arange(n) % 2**bits).to(torch.uint8).reshape(2, -1)
    codes = codes[:, torch.randperm(codes.shape[1], generator=torch.Generator().manual_seed(bits))]
    packed = packing.pack(codes, bits)
    assert packed.shape[-1] == codes.shape[-1] * bits // 8
    assert torch.equal(packing.unpack(packed, bits, codes.shape[-1]), codes)


def test_packing_bit_order_is_documented_order():
    c = torch.tensor([1, 2, 3, 4, 5, 6, 7, 0], dtype=torch.uint8)
    w = sum(int(v) << (3 * j) for j, v in enumerate(c))
    assert packing.pack(c, 3).tolist() == [w & 255, (w >> 8) & 255, (w >> 16) & 255]
    assert packing.pack(c[:2], 4).tolist() == [1 | 2 << 4]
    assert packing.pack(c[:4], 2).tolist() == [1 | 2 << 2 | 3 << 4 | 0 << 6]


def test_packing_rejects_ragged_rows():
    with pytest.raises(InvalidInput, match="multiple of 8"):
        packing.pack(torch.zeros(7, dtype=torch.uint8), 3)


@pytest.mark.parametrize("d", [16, 64, 80, 96, 128, 256])
def test_wht_is_orthonormal_and_preserves_dot_products(d):
    r = wht.rotation_matrix(d)
    assert torch.allclose(r @ r.T, torch.eye(d), atol=1e-5)
    q, k = _gaussian(4, d, 1), _gaussian(4, d, 2)
    assert torch.allclose((q * k).sum(-1), (wht.rotate(q) * wht.rotate(k)).sum(-1), atol=1e-4)
    assert torch.allclose(wht.unrotate(wht.rotate(q)), q, atol=1e-5)


def test_wht_signs_are_fixed_and_mixed():
    s = wht.signs(128)
    assert torch.equal(s, wht.signs(128)) and 32 < int((s > 0).sum()) < 96
    assert wht.power_of_two_blocks(96) == [64, 32] and wht.power_of_two_blocks(80) == [64, 16]


def test_lloyd_max_solver_matches_max_1960():
    known = {1: 0.3634, 2: 0.1175, 3: 0.03454, 4: 0.009497}
    for bits, mse in known.items():
        levels = gaussian_levels(bits)
        assert math.isclose(gaussian_mse(levels), mse, rel_tol=2e-3), bits
    assert math.isclose(gaussian_levels(1)[1], math.sqrt(2 / math.pi), rel_tol=1e-6)
    assert math.isclose(gaussian_levels(2)[3], 1.510, rel_tol=1e-3)


def test_fitted_codebooks_are_symmetric_and_ascending():
    for name in ("turbo2", "turbo2g64", "turbo3", "turbo4", "turbo5"):
        t = CODECS[name].value_table()
        assert torch.all(t[1:] > t[:-1])
        assert torch.allclose(t, -t.flip(0))


def test_small_float_tables():
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    v = from_e4m3_bytes(b)
    finite = torch.isfinite(v)
    assert int((~finite).sum()) == 2  # 0x7F and 0xFF are NaN
    nonzero = finite & (v != 0)  # +-0 may legitimately come back as either zero byte
    assert torch.equal(to_e4m3_bytes(v[nonzero]), b[nonzero])
    assert float(from_e4m3_bytes(to_e4m3_bytes(torch.tensor([1e6])))) == 448.0  # saturates
    t = e2m1_table()
    assert torch.equal(t[to_e2m1_codes(t).long()], t)
    e5 = e5m2_table()  # every finite E5M2 byte round-trips; inf / NaN codes are never written
    raw = b.view(torch.float8_e5m2).float()
    ok = torch.isfinite(raw) & (raw != 0)
    assert int((~torch.isfinite(raw)).sum()) == 8 and torch.equal(e5[ok], raw[ok])
    assert torch.equal(to_e5m2_bytes(raw[ok]), b[ok])
    assert float(e5[to_e5m2_bytes(torch.tensor([1e9, -1e9])).long()].abs().min()) == 57344.0


def test_f16_is_ieee_half_and_saturates():
    x = torch.tensor([[1.0, -2.5, 1e-5, 7e4] + [0.0] * 12])
    data, _ = encode(CODECS["f16"], x)
    assert torch.equal(data.view(torch.float16)[0, :3], x[0, :3].half())
    assert float(decode(CODECS["f16"], data, _, 16)[0, 3]) == 65504.0  # not inf


def test_fp8_tensor_scale_is_applied():
    x = _gaussian(16, 64) * 1000
    y = roundtrip(CODECS["fp8"], x, tensor_scale=float(x.abs().max()) / 448)
    assert float(((x - y) ** 2).sum() / (x**2).sum()) < 1e-3
    with pytest.raises(InvalidInput, match="tensor_scale"):
        encode(CODECS["fp8"], x, tensor_scale=0.0)


@pytest.mark.parametrize("name", list(CODECS))
def test_zero_vectors_decode_to_zero(name):
    x = torch.zeros(3, 64)
    assert torch.equal(roundtrip(CODECS[name], x), x)


def test_block_views_are_views_of_the_pool():
    codec = CODECS["turbo3"]
    pool = torch.zeros(4, codec.block_bytes(16, 2, 64), dtype=torch.uint8)
    data, scales = block_views(codec, pool, 16, 2, 64)
    assert data.shape == (4, 16, 2, 24) and scales.shape == (4, 16, 2, 4)
    x = _gaussian(2, 64)
    d, s = encode(codec, x)
    data[1, 3] = d
    scales[1, 3] = s
    assert torch.allclose(decode(codec, data[1, 3], scales[1, 3], 64), roundtrip(codec, x))


def test_invalid_inputs_get_clear_errors():
    with pytest.raises(ConfigError, match="unknown codec 'turbo9'.*turbo3"):
        get_codec("turbo9")
    with pytest.raises(ConfigError, match="'q5_0' is not the same thing.*use turbo5"):
        get_codec("q5_0")
    with pytest.raises(InvalidInput, match="NaN or Inf"):
        encode(CODECS["turbo3"], torch.tensor([[float("nan")] * 64]))
    with pytest.raises(InvalidInput, match="floating-point"):
        encode(CODECS["turbo3"], torch.zeros(2, 64, dtype=torch.int32))
    with pytest.raises(InvalidInput, match="multiple of 16"):
        encode(CODECS["turbo3"], torch.zeros(2, 40))
    with pytest.raises(ConfigError, match="multiple of 32"):
        CODECS["q4_0"].block_bytes(16, 2, 80)
    with pytest.raises(InvalidInput, match="data rows"):
        decode(CODECS["turbo3"], torch.zeros(2, 5, dtype=torch.uint8), torch.zeros(2, 4, dtype=torch.uint8), 64)


def test_shipped_codebooks_are_what_the_solver_fits():
    from pagedkv.codecs.tables import LEVEL_QUANTUM, fit_lloyd_max_table, lloyd_max_table

    for name in ("turbo2", "turbo2g64", "turbo3", "turbo4", "turbo5"):
        c = CODECS[name]
        shipped = lloyd_max_table(c.code_bits, c.group_size)
        fitted = fit_lloyd_max_table(c.code_bits, c.group_size)
        # equal up to one rounding quantum (float summation order may differ across machines)
        assert torch.allclose(shipped, fitted, atol=LEVEL_QUANTUM * 1.01, rtol=0), name


def test_equal_levels_keep_code_order_in_every_encoder():
    """E2M1 holds +0 (code 0) and -0 (code 8): every encoder takes the levels from `level_order`
    (a stable sort on the CPU), so which zero code a small value gets is fixed, whatever device
    or sort the table meets: values just under zero get +0's code, just over it -0's (the level
    search's rule: ties go down, the second of two equal levels from above)."""
    from pagedkv.codecs.reference import decode, encode, level_order

    codec = CODECS["nvfp4"]
    levels, order = level_order(codec.value_table())
    zeros = order[levels == 0].tolist()
    assert zeros == [0, 8] and levels.device.type == "cpu"
    x = torch.tensor([[6.0, -0.01, 0.01, 0.0] + [1.0] * 12])
    data, scales = encode(codec, x)
    codes = [(int(b) >> s) & 15 for b in data[0, :2] for s in (0, 4)]
    assert codes[1:4] == [0, 8, 0]
    assert torch.equal(decode(codec, data, scales, 16)[0, 1:4].abs(), torch.zeros(3))
