"""First-chunk calibration (pagedkv.cache.calibration): the attention-weighted key centre
against a written-out oracle (loops over queries and keys), its minimiser property, the fallbacks,
and calibrate()'s choice of estimator."""

import math

import pytest
import torch

from pagedkv.cache import calibration as cal
from pagedkv.cache.calibration import CalibrationOptions, attention_key_centre, calibrate, key_centre


def _oracle_weights(keys, values, queries, k_codec, positions=None):
    """Per KV head, per key token j (and channel i for fp8): sum over the query rows of
    p_qj^2 ||v_j - o_q||^2 q_i^2 (or ||q||^2), written out with loops (causal softmax at D^-0.5)."""
    b, h, t, d = keys.shape
    hq, tq = queries.shape[1], queries.shape[2]
    g = hq // h
    positions = list(range(t - tq, t)) if positions is None else positions
    w = torch.zeros(b, h, t, d, dtype=torch.float64)
    for bi in range(b):
        for qh in range(hq):
            kh = qh // g
            for qi, pos in enumerate(positions):
                q = queries[bi, qh, qi].double()
                s = torch.tensor([float(q @ keys[bi, kh, j].double()) / math.sqrt(d) if j <= pos
                                  else -math.inf for j in range(t)], dtype=torch.float64)
                p = torch.softmax(s, dim=0)
                o = (p[:, None] * values[bi, kh].double()).sum(0)
                for j in range(t):
                    a = float(p[j]) ** 2 * float(((values[bi, kh, j].double() - o) ** 2).sum())
                    w[bi, kh, j] += a * (q * q if k_codec == "fp8" else (q * q).sum().expand(d))
    return w


def _oracle_centre(keys, values, queries, k_codec, positions=None):
    w = _oracle_weights(keys, values, queries, k_codec, positions)
    return ((w * keys.double()).sum(dim=(0, 2)) / w.sum(dim=(0, 2))).float()


def _data(b=2, h=2, g=2, t=7, d=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(b, h, t, d, generator=gen)
    k[:, :, 0] += 4.0  # a sink-like outlier key
    v = torch.randn(b, h, t, d, generator=gen)
    q = 2 * torch.randn(b, h * g, t, d, generator=gen)
    return k, v, q


@pytest.mark.parametrize("k_codec", ["fp8", "turbo3", "q4_0"])
def test_attention_key_centre_matches_the_oracle(k_codec):
    k, v, q = _data()
    torch.testing.assert_close(attention_key_centre(k, v, q, k_codec), _oracle_centre(k, v, q, k_codec),
                               rtol=1e-4, atol=1e-5)


def test_fewer_queries_than_keys_sit_at_the_end_and_subsample_evenly():
    k, v, q = _data(t=9, seed=1)
    last = q[:, :, -4:]  # queries of the last 4 positions (5..8)
    torch.testing.assert_close(attention_key_centre(k, v, last, "fp8"),
                               _oracle_centre(k, v, last, "fp8", positions=[5, 6, 7, 8]), rtol=1e-4, atol=1e-5)
    # max_queries=3 of 9: rows 0, 4, 8 (linspace rounded)
    sub = q[:, :, [0, 4, 8]]
    torch.testing.assert_close(attention_key_centre(k, v, q, "turbo4", max_queries=3),
                               _oracle_centre(k, v, sub, "turbo4", positions=[0, 4, 8]), rtol=1e-4, atol=1e-5)


def test_memory_slices_do_not_change_the_result(monkeypatch):
    k, v, q = _data(b=1, t=40, d=8, seed=2)
    whole = attention_key_centre(k, v, q, "fp8")
    monkeypatch.setattr(cal, "_CHUNK_ELEMENTS", 1)  # one query per slice
    torch.testing.assert_close(attention_key_centre(k, v, q, "fp8"), whole, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("k_codec", ["fp8", "turbo3"])
def test_the_centre_minimises_the_weighted_logit_error(k_codec):
    """J(c) = sum w (k - c)^2 with the oracle weights: the fitted centre beats every perturbation
    of it and the median / plain-mean centres."""
    k, v, q = _data(b=1, t=12, d=6, seed=4)
    w = _oracle_weights(k, v, q, k_codec)

    def J(c):
        return float((w * (k.double() - c.double()[None, :, None, :]) ** 2).sum())

    c = attention_key_centre(k, v, q, k_codec)
    gen = torch.Generator().manual_seed(5)
    for _ in range(20):
        assert J(c) <= J(c + 0.05 * torch.randn(c.shape, generator=gen)) + 1e-9
    assert J(c) < J(key_centre(k, k_codec))
    assert J(c) < J(k.mean(dim=(0, 2)))


def test_an_outlier_key_no_query_attends_to_does_not_pull_the_centre():
    """The weights go with p^2: a far key that every query scores low (p ~ 0) barely counts,
    so moving it further leaves the centre where it was, while the plain mean follows it."""
    gen = torch.Generator().manual_seed(6)
    t, d = 32, 8
    k = 0.3 * torch.randn(1, 1, t, d, generator=gen)
    v = torch.randn(1, 1, t, d, generator=gen)
    q = torch.ones(1, 2, t, d) + 0.1 * torch.randn(1, 2, t, d, generator=gen)
    far, farther = k.clone(), k.clone()
    far[0, 0, 5] = -12.0  # q . k / sqrt(d) ~ -34: p ~ e^-34
    farther[0, 0, 5] = -24.0
    for codec in ("fp8", "turbo3"):
        moved = attention_key_centre(farther, v, q, codec) - attention_key_centre(far, v, q, codec)
        assert float(moved.abs().max()) < 1e-4
    assert float((farther.mean(dim=(0, 2)) - far.mean(dim=(0, 2))).abs().min()) == pytest.approx(12 / t)


def test_zero_weights_fall_back_to_the_robust_centre():
    """Constant values: every ||v_j - o||^2 is 0, no weight anywhere: the median fallback."""
    k, _, q = _data(b=1, t=6, seed=7)
    v = torch.ones(1, 2, 6, 4)
    for codec in ("fp8", "turbo4"):
        torch.testing.assert_close(attention_key_centre(k, v, q, codec), key_centre(k, codec))
    k16, q16 = torch.cat([k] * 4, -1), torch.cat([q] * 4, -1)  # turbo needs head_dim 16
    torch.testing.assert_close(cal.bias_aware_key_centre(k16, torch.ones(1, 2, 6, 16), q16, "turbo3"),
                               key_centre(k16, "turbo3"))


def test_calibrate_uses_queries_when_given_and_is_deterministic():
    k, v, q = _data(b=1, t=10, seed=8)
    opts = CalibrationOptions()
    with_q = calibrate(k, v, q, "fp8", "fp8", opts, "cpu")
    torch.testing.assert_close(with_q.k_centre, attention_key_centre(k, v, q, "fp8"))
    again = calibrate(k, v, q, "fp8", "fp8", opts, "cpu")
    assert torch.equal(with_q.k_centre, again.k_centre) and torch.equal(with_q.k_scale, again.k_scale)
    without = calibrate(k, v, None, "turbo3", "turbo3", opts, "cpu")
    torch.testing.assert_close(without.k_centre, key_centre(k, "turbo3"))
    # the fp8 scale is fitted to the centred keys
    kc = k - with_q.k_centre[None, :, None, :]
    assert float(with_q.k_scale) == pytest.approx(cal.FP8_HEADROOM * float(kc.abs().max()) / cal.FP8_MAX)
    off = calibrate(k, v, q, "fp8", "fp8", CalibrationOptions(key_centring=False), "cpu")
    assert off.k_centre is None and off.v_centre is None


def _second_order_objective(c, k, v, q, kappa):
    """sum over all queries of sum_j p^2 sigma^2 ||v_j - o||^2 + 1/4 ||sum_j p sigma^2 (v_j - o)||^2
    with sigma_j^2 = kappa ||q||^2 ||k_j - c||^2 / D^2 (float64, written out per query)."""
    b, h, t, d = k.shape
    g = q.shape[1] // h
    total = 0.0
    for bi in range(b):
        for qh in range(q.shape[1]):
            kh = qh // g
            K, V = k[bi, kh].double(), v[bi, kh].double()
            for pos in range(t):
                qq = q[bi, qh, pos].double()
                s = (K[: pos + 1] @ qq) / math.sqrt(d)
                p = torch.softmax(s, 0)
                o = p @ V[: pos + 1]
                dv = V[: pos + 1] - o
                sig = kappa * float(qq @ qq) / d ** 2 * ((K[: pos + 1] - c[kh].double()) ** 2).sum(-1)
                total += float((p ** 2 * sig * (dv ** 2).sum(-1)).sum())
                total += 0.25 * float(((p * sig)[:, None] * dv).sum(0).pow(2).sum())
    return total


def test_bias_aware_centre_minimises_the_second_order_error():
    """Oracle: the written-out second-order objective (spread + bias of e^delta) over every
    query; the CG solution beats perturbations of itself and the first-order centre."""
    gen = torch.Generator().manual_seed(9)
    b, h, g, t, d = 1, 2, 2, 12, 16
    k = 2 * torch.randn(b, h, t, d, generator=gen)
    k[:, :, 0] += 6.0
    v = torch.randn(b, h, t, d, generator=gen)
    q = 3 * torch.randn(b, h * g, t, d, generator=gen)
    kappa = cal.relative_error("turbo3", d)
    c = cal.bias_aware_key_centre(k, v, q, "turbo3", steps=d)
    best = _second_order_objective(c, k, v, q, kappa)
    for _ in range(10):
        assert best <= _second_order_objective(c + 0.05 * torch.randn(c.shape, generator=gen), k, v, q, kappa) + 1e-9
    assert best < _second_order_objective(attention_key_centre(k, v, q, "turbo3"), k, v, q, kappa)
    # the default few CG steps already land on the solution here
    torch.testing.assert_close(cal.bias_aware_key_centre(k, v, q, "turbo3"), c, rtol=1e-3, atol=1e-3)


def test_relative_error_orders_the_codecs():
    kappas = [cal.relative_error(name, 64) for name in ("turbo2", "turbo3", "turbo4", "turbo8")]
    assert kappas == sorted(kappas, reverse=True) and 0 < kappas[-1] and kappas[0] < 0.2
    assert cal.relative_error("turbo3", 64) == pytest.approx(0.021, abs=0.003)  # Lloyd-Max-like 3 bits


def test_calibrate_picks_the_estimator_by_codec():
    gen = torch.Generator().manual_seed(10)
    k, v, q = (torch.randn(1, h, 20, 16, generator=gen) for h in (2, 2, 4))
    opts = CalibrationOptions()
    torch.testing.assert_close(calibrate(k, v, q, "turbo3", "turbo3", opts, "cpu").k_centre,
                               cal.bias_aware_key_centre(k, v, q, "turbo3"))
    for codec in ("q4_0", "fp8"):
        torch.testing.assert_close(calibrate(k, v, q, codec, codec, opts, "cpu").k_centre,
                                   attention_key_centre(k, v, q, codec))


def test_bias_aware_slices_do_not_change_the_result(monkeypatch):
    """Long chunks recompute the attention slice by slice: same centre as one kept slice."""
    gen = torch.Generator().manual_seed(11)
    k, v = (torch.randn(1, 2, 30, 16, generator=gen) for _ in range(2))
    q = 2 * torch.randn(1, 4, 30, 16, generator=gen)
    whole = cal.bias_aware_key_centre(k, v, q, "turbo3")
    monkeypatch.setattr(cal, "_CHUNK_ELEMENTS", 1)  # one query per slice
    torch.testing.assert_close(cal.bias_aware_key_centre(k, v, q, "turbo3"), whole, rtol=1e-4, atol=1e-5)


def test_attention_value_centre_is_the_p_squared_weighted_mean():
    """Oracle: u_j = sum over queries (every one here) of p_qj^2, written out with loops."""
    k, v, q = _data(t=9, seed=12)
    b, h, t, d = k.shape
    g = q.shape[1] // h
    u = torch.zeros(b, h, t, dtype=torch.float64)
    for bi in range(b):
        for qh in range(q.shape[1]):
            for pos in range(t):
                s = (k[bi, qh // g, : pos + 1].double() @ q[bi, qh, pos].double()) / math.sqrt(d)
                u[bi, qh // g, : pos + 1] += torch.softmax(s, 0) ** 2
    want = ((u[..., None] * v.double()).sum(dim=(0, 2)) / u.sum(dim=(0, 2))[:, None]).float()
    torch.testing.assert_close(cal.attention_value_centre(k, v, q), want, rtol=1e-4, atol=1e-5)
    opts = CalibrationOptions(key_centring=False, value_centring=True)
    torch.testing.assert_close(calibrate(k, v, q, "turbo3", "turbo3", opts, "cpu").v_centre, want,
                               rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(calibrate(k, v, None, "turbo3", "turbo3", opts, "cpu").v_centre,
                               v.mean(dim=(0, 2)))
