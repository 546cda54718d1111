"""The reference attention ops against fp64 oracles.

Tight: against oracle attention over the dequantized K/V (what the cache holds), fp32 rounding
only. Loose: against attention over the unquantized K/V, with a tolerance derived from each
codec's NMSE measured on the same data (`expected_error_rms`, a first-order error model).
Every codec pair of the format registry runs decode and prefill on a tiny ragged batch.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.attention_oracle import (expected_error_rms, make_case, oracle_attention, oracle_outputs,
                                      rms, run_op)
from pagedkv.codecs import CODECS
from pagedkv.formats import all_formats
from pagedkv.ops import AttentionParams

TIGHT = dict(atol=2e-5, rtol=2e-5)  # fp32 arithmetic over <= a few hundred keys
MODEL_SLACK = 2.5  # measured error / first-order prediction: 0.67-1.70 over 12 seeds x 5 K-heavy pairs


def _check_case(case, params, modes=("decode", "prefill")):
    """Tight vs the dequantized oracle; codec-derived bound vs the unquantized oracle."""
    ratios = {}
    for mode in modes:
        out = run_op(case, params, mode=mode).double()
        torch.testing.assert_close(out, oracle_outputs(case, params, mode=mode), **TIGHT)
        err = rms(out - oracle_outputs(case, params, mode=mode, quantized=False))
        predicted = expected_error_rms(case, params, mode=mode)
        assert err <= MODEL_SLACK * predicted + 1e-5, (mode, err, predicted)
        ratios[mode] = err / max(predicted, 1e-12)
    return ratios


def test_oracle_math_path_matches_sdpa():
    torch.manual_seed(0)
    q, k, v = torch.randn(4, 6, 64), torch.randn(30, 2, 64), torch.randn(30, 2, 64)
    params = AttentionParams(scale=0.125, sliding_window=7)
    pos = torch.arange(26, 30)
    sdpa = oracle_attention(q, k, v, pos, params)
    math, _ = oracle_attention(q, k, v, pos, params, return_weights=True)
    torch.testing.assert_close(sdpa, math, atol=1e-12, rtol=1e-12)


FORMATS = list(all_formats())


@pytest.mark.parametrize("fmt", FORMATS, ids=[f.name for f in FORMATS])
def test_every_pair_decode_and_prefill(fmt):
    assert len(FORMATS) == len(CODECS) ** 2
    case = make_case(fmt.k, fmt.v, seq_lens=[19, 1, 33], num_kv_heads=1, group=2, head_dim=64, seed=1)
    _check_case(case, AttentionParams(scale=0.125))


GRID = [
    # (k, v, kv heads, group, head_dim, block_size, lens, window, cap, sinks)
    ("turbo3", "turbo3", 2, 1, 64, 16, [50, 17, 1], None, None, False),
    ("turbo4", "turbo3", 1, 3, 128, 32, [70, 33], 16, None, False),
    ("bf16", "turbo2", 2, 8, 64, 16, [40, 64, 5], None, 30.0, True),
    ("fp8", "turbo4", 3, 3, 256, 16, [24, 9], 5, 20.0, True),
    ("turbo2", "bf16", 1, 8, 128, 16, [80], 32, None, True),
    ("q4_0", "nvfp4", 2, 3, 64, 32, [45, 2, 31], None, 10.0, False),
    ("turbo8", "q8_0", 1, 1, 256, 32, [66], 20, None, False),
    ("nvfp4", "turbo8", 2, 3, 128, 16, [16, 32, 48], 1, 5.0, True),
]


@pytest.mark.parametrize("k,v,h,g,d,bs,lens,window,cap,sinks", GRID,
                         ids=[f"{r[0]}k_{r[1]}v-g{r[3]}-d{r[4]}-bs{r[5]}" for r in GRID])
def test_parameter_grid(k, v, h, g, d, bs, lens, window, cap, sinks):
    case = make_case(CODECS[k], CODECS[v], seq_lens=lens, num_kv_heads=h, group=g, head_dim=d,
                     block_size=bs, q_lens=[min(n, 7) for n in lens], seed=2)
    sink_logits = torch.linspace(-2.0, 3.0, h * g) if sinks else None
    params = AttentionParams(scale=d ** -0.5, sliding_window=window, soft_cap=cap, sinks=sink_logits)
    _check_case(case, params)


def test_window_of_one_returns_the_last_value():
    case = make_case(CODECS["turbo3"], CODECS["turbo4"], seq_lens=[21, 40], group=3, seed=3)
    out = run_op(case, AttentionParams(scale=0.125, sliding_window=1), mode="decode")
    for b, n in enumerate(case.seq_lens.tolist()):
        last = case.v_deq[b][n - 1].float().repeat_interleave(3, dim=0)
        torch.testing.assert_close(out[b], last, atol=1e-5, rtol=1e-5)


def test_prefill_is_bottom_right_aligned_and_matches_decode():
    """Prefill query j of a sequence equals decode of the same query over the first n - L + j + 1 tokens."""
    case = make_case(CODECS["turbo3"], CODECS["fp8"], seq_lens=[30], q_lens=[6], group=2, seed=4)
    params = AttentionParams(scale=0.125, soft_cap=15.0)
    pre = run_op(case, params, mode="prefill")
    from pagedkv.ops import decode_attention

    for j in range(6):
        n = 30 - 6 + j + 1
        one = decode_attention(case.q_prefill[j : j + 1], case.layer, case.block_tables,
                               torch.tensor([n], dtype=torch.int32), params, backend="reference")
        torch.testing.assert_close(pre[j], one[0], atol=1e-6, rtol=1e-6)


def test_zero_length_decode_rows_are_zero():
    case = make_case(CODECS["turbo3"], CODECS["turbo3"], seq_lens=[12, 0, 5], seed=5)
    out = run_op(case, AttentionParams(scale=0.125), mode="decode")
    assert bool((out[1] == 0).all()) and bool(out[0].abs().sum() > 0)
    torch.testing.assert_close(out.double(), oracle_outputs(case, AttentionParams(scale=0.125), mode="decode"), **TIGHT)


@pytest.mark.parametrize("k", ["bf16", "turbo3", "q4_0"])
def test_k_centre_is_exact_with_cap_and_sinks(k):
    """Keys with a large common offset: stored as k - centre, q . centre added back exactly."""
    params = AttentionParams(scale=0.125, soft_cap=20.0, sinks=torch.tensor([0.5, -1.0, 2.0]))
    centred = make_case(CODECS[k], CODECS["bf16"], seq_lens=[48, 9], num_kv_heads=1, group=3,
                        k_offset=3.0, centre=True, seed=6)
    _check_case(centred, params)  # the oracle attends over (deq(k - c) + c): exact centre handling
    if k != "bf16":  # centring shrinks what the codec must store, and with it the error
        plain = make_case(CODECS[k], CODECS["bf16"], seq_lens=[48, 9], num_kv_heads=1, group=3,
                          k_offset=3.0, centre=False, seed=6)
        exact = oracle_outputs(plain, params, mode="decode", quantized=False)
        err_plain = rms(run_op(plain, params, mode="decode").double() - exact)
        err_centred = rms(run_op(centred, params, mode="decode").double() - exact)
        assert err_centred < 0.5 * err_plain, (err_centred, err_plain)


TRANSFORM_PARAMS = [AttentionParams(scale=0.125),
                    AttentionParams(scale=0.125, soft_cap=20.0, sinks=torch.tensor([0.5, -1.0, 2.0, 1.0, 0.0, -0.5]))]


@pytest.mark.parametrize("fmt", FORMATS, ids=[f.name for f in FORMATS])
def test_every_pair_with_the_layer_transform(fmt):
    """k_mult, k_centre and v_centre set (keys with per-channel scales over ~e^+-1 and an offset,
    values with a per-head offset): the op's output equals attention over the dequantized rows
    with the transform undone (fp32 rounding only, sinks included: v_centre enters times the
    token weights' sum) and attention over the untransformed K/V within the codec's error."""
    case = make_case(fmt.k, fmt.v, seq_lens=[19, 1, 33], num_kv_heads=2, group=3, head_dim=64,
                     transform=True, seed=11)
    assert case.layer.k_mult is not None and case.layer.v_centre is not None
    for params in TRANSFORM_PARAMS:
        _check_case(case, params)


def test_bf16_transform_is_nearly_exact():
    """bf16 with the transform (sinks and soft-cap on): within bf16 rounding of attention over
    the untransformed K/V."""
    params = TRANSFORM_PARAMS[1]
    case = make_case(CODECS["bf16"], CODECS["bf16"], seq_lens=[40, 7], num_kv_heads=2, group=3,
                     transform=True, seed=12)
    for mode in ("decode", "prefill"):
        exact = oracle_outputs(case, params, mode=mode, quantized=False)
        out = run_op(case, params, mode=mode).double()
        assert rms(out - exact) <= 2e-2 * rms(exact), (mode, rms(out - exact), rms(exact))


def test_transform_tensors_are_validated():
    from pagedkv.errors import InvalidInput
    from pagedkv.ops import api, make_layer

    layer = make_layer(CODECS["turbo3"], CODECS["turbo3"], 2, 16, 2, 64)
    k = torch.randn(3, 2, 64)
    slots = torch.arange(3)
    bad_shape = make_layer(CODECS["turbo3"], CODECS["turbo3"], 2, 16, 2, 64, v_centre=torch.zeros(2, 32))
    with pytest.raises(InvalidInput, match=r"layer.v_centre must be None or float32 \[2, 64\]"):
        api.store(bad_shape, k, k, slots)
    zero = torch.ones(2, 64)
    zero[1, 3] = 0.0
    for name, value, match in (("k_mult", zero, "k_mult holds zeros"),
                               ("k_centre", torch.full((2, 64), float("nan")), "k_centre holds NaN"),
                               ("v_centre", torch.full((2, 64), float("inf")), "v_centre holds NaN or Inf")):
        bad = make_layer(CODECS["turbo3"], CODECS["turbo3"], 2, 16, 2, 64, **{name: value})
        with pytest.raises(InvalidInput, match=match):
            api.store(bad, k, k, slots)
        assert not bool(bad.k_pool.any()) and not bool(bad.v_pool.any())  # nothing was written
    api.store(layer, k, k, slots)


@pytest.mark.parametrize("threshold", [1e-3, 2e-2])
def test_sparse_v_error_is_bounded_and_measured(threshold):
    case = make_case(CODECS["turbo3"], CODECS["turbo3"], seq_lens=[90, 60], group=3, q_scale=3.0, seed=7)
    exact_p = AttentionParams(scale=0.125)
    sparse_p = AttentionParams(scale=0.125, sparse_v_threshold=threshold)
    for mode in ("decode", "prefill"):
        exact = run_op(case, exact_p, mode=mode).double()
        sparse = run_op(case, sparse_p, mode=mode).double()
        torch.testing.assert_close(sparse, oracle_outputs(case, sparse_p, mode=mode), **TIGHT)
        # Bound: out_exact - out_sparse = sum over dropped j of p_j v_j (no renormalisation).
        dropped_mass = []
        qs = case.q_decode if mode == "decode" else case.q_prefill
        starts = [b for b in range(case.batch)] if mode == "decode" else case.query_start_loc.tolist()
        for b in range(case.batch):
            n = int(case.seq_lens[b])
            lo, hi = (b, b + 1) if mode == "decode" else (starts[b], starts[b + 1])
            pos = torch.arange(n - (hi - lo), n)
            _, p = oracle_attention(qs[lo:hi], case.k_deq[b], case.v_deq[b], pos, exact_p, return_weights=True)
            small = p * (p < threshold)  # [Hq, Tq, n]
            vmax = case.v_deq[b].abs().amax(-1).amax(-1)  # [n]
            bound = (small * vmax).sum(-1).transpose(0, 1)  # [Tq, Hq]
            err = (sparse[lo:hi] - exact[lo:hi]).abs().amax(-1)
            assert bool((err <= bound + 1e-5).all())
            dropped_mass.append(float(small.sum(-1).mean()))
        assert max(dropped_mass) > 0  # the threshold did drop positions here


def test_sparse_threshold_zero_is_exact():
    case = make_case(CODECS["turbo4"], CODECS["turbo2"], seq_lens=[40], seed=8)
    a = run_op(case, AttentionParams(scale=0.125), mode="decode")
    b = run_op(case, AttentionParams(scale=0.125, sparse_v_threshold=0.0), mode="decode")
    assert torch.equal(a, b)


def test_prefill_query_chunking_changes_nothing(monkeypatch):
    from pagedkv.ops.reference import attention as ref_attention

    case = make_case(CODECS["turbo2"], CODECS["q8_0"], seq_lens=[40, 23], q_lens=[17, 9], group=3, seed=9)
    params = AttentionParams(scale=0.125, sliding_window=12, sinks=torch.zeros(6))
    whole = run_op(case, params, mode="prefill")
    monkeypatch.setattr(ref_attention, "LOGIT_BUDGET", 6 * 40 * 4)  # 4 queries per chunk
    torch.testing.assert_close(run_op(case, params, mode="prefill"), whole, atol=1e-6, rtol=1e-6)


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_random_cases_match_the_oracle(data):
    """Random pair, head_dim (96 = 64 + 32 WHT blocks), GQA, block size, lengths and settings."""
    fmt = data.draw(st.sampled_from(FORMATS), label="format")
    d = data.draw(st.sampled_from([d for d in (32, 64, 96) if all(d % max(c.group_size, 1) == 0 for c in (fmt.k, fmt.v))]),
                  label="head_dim")  # a codec's group divides head_dim (turbo2g64: 64 only)
    h = data.draw(st.integers(1, 3), label="kv_heads")
    g = data.draw(st.sampled_from([1, 2, 3, 8]), label="group")
    bs = data.draw(st.sampled_from([1, 8, 16, 32]), label="block_size")
    lens = data.draw(st.lists(st.integers(1, 60), min_size=1, max_size=3), label="seq_lens")
    q_lens = [data.draw(st.integers(1, n), label="q_len") for n in lens]
    window = data.draw(st.one_of(st.none(), st.integers(1, 70)), label="window")
    cap = data.draw(st.one_of(st.none(), st.floats(1.0, 50.0)), label="soft_cap")
    sinks = data.draw(st.booleans(), label="sinks")
    centre = data.draw(st.booleans(), label="centre")
    case = make_case(fmt.k, fmt.v, seq_lens=lens, q_lens=q_lens, num_kv_heads=h, group=g, head_dim=d,
                     block_size=bs, centre=centre, k_offset=2.0 if centre else 0.0,
                     seed=data.draw(st.integers(0, 2**16), label="seed"))
    params = AttentionParams(scale=d ** -0.5, sliding_window=window, soft_cap=cap,
                             sinks=torch.linspace(-1, 1, h * g) if sinks else None)
    for mode in ("decode", "prefill"):
        torch.testing.assert_close(run_op(case, params, mode=mode).double(),
                                   oracle_outputs(case, params, mode=mode), **TIGHT)


def test_measure_sparse_v_reports_the_oracle_numbers():
    from pagedkv.ops.reference import measure_sparse_v

    case = make_case(CODECS["turbo4"], CODECS["turbo3"], seq_lens=[80, 33], group=3, q_scale=3.0, seed=10)
    params = AttentionParams(scale=0.125, sparse_v_threshold=5e-3, sinks=torch.full((6,), 1.0))
    stats = measure_sparse_v(case.q_decode, case.layer, case.block_tables, case.seq_lens, params)
    exact_params = AttentionParams(scale=0.125, sinks=params.sinks)
    skipped = total = 0
    for b, n in enumerate(case.seq_lens.tolist()):
        _, p = oracle_attention(case.q_decode[b : b + 1], case.k_deq[b], case.v_deq[b], torch.tensor([n - 1]),
                                exact_params, return_weights=True)
        skipped += int((p < 5e-3).sum())
        total += p.numel()
    assert abs(stats.skipped - skipped / total) < 0.01 and 0 < stats.skipped < 1
    exact = oracle_outputs(case, exact_params, mode="decode")
    sparse = oracle_outputs(case, params, mode="decode")
    assert stats.rel_error == pytest.approx(float((sparse - exact).norm() / exact.norm()), rel=1e-3, abs=1e-6)
    assert stats.dropped_mass_max >= stats.dropped_mass_mean > 0
