"""The CPU kernel's chunked-prefill tile (`prefill_kernel.h`, `pkv_prefill`) against the reference.

The tile takes prefill calls (more than one query in some sequence) on AVX2 and AVX-512 builds
when scores are exact and sparse V is off; it decodes each 64-token K/V chunk once for up to ~384 query
vectors of a kv head and sweeps it with 6-vector micro-blocks, skipping chunks a micro-block
does not see and masking only chunks it sees in part. The cases here are long enough for several
row blocks per kv head (rows per task: 384 / GQA group), chunk boundaries, the causal tail and
a sliding window's head, for every (K, V) pair the kernel declares (looped from the registry).
Tolerances as in test_cpu_kernel.py: the tile computes the reference's fp32 math in another
order (|out - ref| ~1e-6; 2e-4 of rms(v) = 1 leaves room for summation order only).
"""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

from helpers.attention_oracle import oracle_outputs, run_op
from helpers.backend_check import CheckCase, all_pairs, check_backend

from pagedkv.errors import InvalidInput
from pagedkv.ops import AttentionParams, cpu

att = importlib.import_module("pagedkv.ops.cpu.attention")  # the module (cpu.attention is a function)
pytestmark = pytest.mark.skipif(not cpu.available(), reason="the C attention kernel is not built here")


def _tile_available() -> bool:
    return att._prefill_entry(cpu._require()) is not None


needs_tile = pytest.mark.skipif(not cpu.available() or not _tile_available(),
                                reason="this build has no prefill tile (AVX2 and AVX-512 builds only)")


@pytest.fixture
def tile_calls(monkeypatch):
    """Counts the calls that reach pkv_prefill."""
    calls = []
    real = att._prefill_entry

    def spy(kernel, bf16=False):
        fn = real(kernel, bf16)
        if fn is None:
            return None
        return lambda *args: calls.append(fn.__name__) or fn(*args)

    monkeypatch.setattr(att, "_prefill_entry", spy)
    return calls


def _check(cases):
    return check_backend(prefill_attention=cpu.prefill_attention, cases=cases)


@needs_tile
def test_every_codec_pair_long_chunk(tile_calls):
    """Every declared pair: 3 row blocks for the long sequence, a decode row, a short prefill."""
    pairs = all_pairs(att.ATTENTION_SUPPORT)
    assert len(pairs) >= 81
    cases = [CheckCase(k, v, seq_lens=(290, 1, 70), q_lens=(270, 1, 40), num_kv_heads=1, group=3,
                       transform=bool(i % 2), seed=i) for i, (k, v) in enumerate(pairs)]
    results = _check(cases)
    assert max(r["prefill_max_err"] for r in results) < 2e-4
    assert len(tile_calls) == len(cases)


SETTINGS = [
    # (pair, CheckCase fields): each with another pair; lengths give several chunks and row blocks
    (("turbo3", "turbo4"), dict(sliding_window=50)),  # chunks before the window are skipped per block
    (("fp8", "turbo3"), dict(sliding_window=1, group=1)),
    (("turbo4", "q8_0"), dict(soft_cap=5.0, sinks=True)),
    (("turbo3", "turbo3"), dict(centre=True, k_offset=6.0, soft_cap=10.0)),
    (("q4_0", "turbo2"), dict(sinks=True, sliding_window=77, group=8, num_kv_heads=1)),
    (("bf16", "nvfp4"), dict(block_size=24, head_dim=80)),  # chunks of 48 tokens, D not a multiple of 64
    (("turbo2", "fp8"), dict(block_size=128, head_dim=48)),  # blocks larger than the 64-token chunk
    (("turbo8", "turbo3"), dict(head_dim=256, group=2, num_kv_heads=2, transform=True)),
    (("fp8", "q4_0"), dict(group=1, seq_lens=(400, 0, 65), q_lens=(399, 0, 64))),  # 2 row blocks of 384 / 15
    # AVX-512 remainders (4 x 16 keys, 4 x 16 dims per register tile): chunks of 80 tokens (64 + 16
    # keys) with 32 dims; chunks of 96 (64 + 32 keys) with 112 dims (64 + 48)
    (("turbo4", "fp8"), dict(block_size=80, head_dim=32, group=2)),
    (("fp8", "nvfp4"), dict(block_size=96, head_dim=112, sliding_window=100)),
    # 5-bit codes (turbo5) as K and as V: window, cap and sinks; D = 80 (a 16-dim remainder pass)
    (("turbo5", "turbo4"), dict(sliding_window=50, soft_cap=8.0, sinks=True)),
    (("nvfp4", "turbo5"), dict(block_size=24, head_dim=80, group=4, num_kv_heads=2)),
]


@needs_tile
@pytest.mark.parametrize("pair,extra", SETTINGS)
def test_settings_long_chunk(pair, extra, tile_calls):
    base = dict(seq_lens=(300, 1, 129), q_lens=(260, 1, 129), num_kv_heads=1, group=3)
    base.update(extra)
    _check([CheckCase(*pair, **base)])
    assert tile_calls


@needs_tile
@pytest.mark.parametrize("pair", [("turbo3", "turbo3"), ("turbo4", "turbo4"), ("fp8", "turbo3"), ("turbo5", "turbo5")])
def test_tile_matches_general_kernel(pair):
    """The tile and the general kernel's prefill path agree to fp32 rounding, lse and key_start too."""
    case = CheckCase(*pair, seq_lens=(333, 40), q_lens=(300, 40), num_kv_heads=3, group=3).build()
    params = AttentionParams(scale=64 ** -0.5, sliding_window=200)
    outs = []
    for tile in (True, False):
        lse = torch.empty(case.q_prefill.shape[:2], dtype=torch.float32)
        out = att.run_attention(cpu._require(), case.q_prefill, case.layer, case.block_tables, case.seq_lens,
                            case.query_start_loc, params, lse=lse, key_start=60, prefill_tile=tile)
        outs.append((out, lse))
    (a, la), (b, lb) = outs
    assert torch.allclose(a, b, atol=2e-5, rtol=1e-5)
    fin = torch.isfinite(lb)
    assert bool((torch.isfinite(la) == fin).all())
    assert torch.allclose(la[fin], lb[fin], atol=1e-5, rtol=1e-6)


@needs_tile
def test_sparse_v_stays_on_the_general_kernel(tile_calls):
    """Sparse V is not the tile's: the general kernel runs it."""
    case = CheckCase("turbo3", "turbo3", seq_lens=(100,), q_lens=(80,)).build()
    params = AttentionParams(scale=0.125, sparse_v_threshold=1e-2)
    out = run_op(case, params, mode="prefill", fn=cpu.prefill_attention)
    assert torch.isfinite(out).all() and not tile_calls


@needs_tile
def test_int8_scores_leave_prefill_on_the_exact_tile(tile_calls):
    """int8_scores is a decode path: a prefill call with it takes the tile, exactly (the same
    output as without the setting)."""
    case = CheckCase("turbo3", "turbo3", seq_lens=(100, 30), q_lens=(80, 1)).build()
    exact = run_op(case, AttentionParams(scale=0.125), mode="prefill", fn=cpu.prefill_attention)
    out = run_op(case, AttentionParams(scale=0.125, int8_scores=True), mode="prefill", fn=cpu.prefill_attention)
    assert len(tile_calls) == 2 and torch.equal(out, exact)


@needs_tile
def test_decode_batches_do_not_take_the_tile(tile_calls):
    case = CheckCase("turbo3", "turbo3", seq_lens=(100, 7)).build()
    out = run_op(case, AttentionParams(scale=0.125), mode="decode", fn=cpu.decode_attention)
    assert torch.isfinite(out).all() and not tile_calls


# ---------------------------------------------------------------- bf16 products (AttentionParams.bf16_dots)
def _bf16_available() -> bool:
    return cpu.available() and bool(cpu._require().lib.pkv_prefill_bf16_available())


needs_bf16 = pytest.mark.skipif(not _bf16_available(), reason="this build has no bf16 prefill tile (AVX-512 BF16)")

U = 2.0 ** -8  # bf16 round-to-nearest-even: relative error <= 2^-8 (8 significant bits: unit roundoff 2^-p, p = 8)


def bf16_bound(case, params: AttentionParams, *, scores: bool = False) -> torch.Tensor:
    """Per (query token, q head) bound on ||out_bf16 - out_exact||_2 of the bf16 tile (scores=True:
    the score bound E itself, which also bounds the log-sum-exp's change: lse is 1-Lipschitz in
    the max norm of the logits).

    Scores: the kernel's s_j = sum_d q_d k_jd (q with the scale folded in, k as stored: centred,
    multiplied, rotated) from bf16 q~ = q (1 + a), k~ = k (1 + b), |a|, |b| <= U, the products
    exact in fp32 and summed in fp32 (<= D 2^-24 relative to sum |q k|): |s~_j - s_j| <= e_j =
    (2U + U^2 + D 2^-24) sum_d |q_d k_jd|; bias, sinks are exact, the soft-cap is 1-Lipschitz.
    Weights: with E = max_j e_j, each softmax weight moves by a factor within [e^-2E, e^2E], so
    sum_j |w'_j - w_j| <= e^2E - 1. Values: the kernel sums bf16(p_j) bf16(v_j) over fp32 p
    normalised by the fp32 denominator: relative error <= 2U + U^2 on each term. Hence
    ||out~ - out|| <= ((e^2E - 1) + (2U + U^2) e^2E) max_j ||v_j||, v as stored (centred; the
    inverse rotation keeps norms); the maxima run over all keys of the sequence (visible or not).
    """
    from pagedkv.codecs import wht

    layer = case.layer
    h, d = layer.num_kv_heads, layer.head_dim
    g = case.num_q_heads // h
    cs = 2 * U + U * U + d * 2.0 ** -24
    starts = case.query_start_loc.tolist()
    out = []
    for b in range(case.batch):
        q = case.q_prefill[starts[b]:starts[b + 1]].double()  # [T, Hq, D]
        k, v = case.k_deq[b].double(), case.v_deq[b].double()  # [n, H, D], original basis
        if layer.k_mult is not None:
            k = k * layer.k_mult.double()
            q = q / layer.k_mult.double().repeat_interleave(g, 0)
        if layer.k_centre is not None:
            k = k - layer.k_centre.double()
        if layer.v_centre is not None:
            v = v - layer.v_centre.double()
        if layer.k_codec.rotated:
            r = wht.rotation_matrix(d).double()
            q, k = q @ r.T, k @ r.T
        t = q.shape[0]
        if k.shape[0] == 0 or t == 0:
            out.append(torch.zeros(t, case.num_q_heads, dtype=torch.float64))
            continue
        sabs = torch.einsum("thgd,nhd->thgn", q.abs().reshape(t, h, g, d), k.abs()) * params.scale
        e = cs * sabs.amax(-1).reshape(t, h * g)
        if scores:
            out.append(e)
            continue
        vmax = v.norm(dim=-1).amax(0).repeat_interleave(g)  # [Hq]
        out.append(((torch.exp(2 * e) - 1) + (2 * U + U * U) * torch.exp(2 * e)) * vmax)
    return torch.cat(out)


BF16_CASES = [
    (("turbo3", "turbo3"), dict()),
    (("turbo4", "turbo4"), dict(transform=True)),
    (("fp8", "turbo3"), dict(sliding_window=50, group=1)),
    (("turbo3", "turbo4"), dict(soft_cap=5.0, sinks=True, group=8)),
    (("turbo4", "q8_0"), dict(centre=True, k_offset=6.0)),
    (("bf16", "nvfp4"), dict(block_size=24, head_dim=96, group=2, num_kv_heads=2)),
    (("q4_0", "fp8"), dict(block_size=128, head_dim=128, sliding_window=77)),
    (("turbo4", "fp8"), dict(block_size=80, head_dim=32, group=2)),  # 64 + 16 keys, 32 dims
    (("fp8", "turbo3"), dict(block_size=96, head_dim=64, group=3)),  # 64 + 32 keys
]


@needs_bf16
@pytest.mark.parametrize("pair,extra", BF16_CASES)
def test_bf16_dots_within_bound(pair, extra, tile_calls):
    """bf16_dots=True: the bf16 tile runs, its output differs from the exact tile's (it is the
    approximate path) and stays within bf16_bound of the fp64 oracle over the dequantized cache
    (plus the exact tile's own fp32 slack, 2e-4 per element)."""
    base = dict(seq_lens=(300, 1, 129), q_lens=(260, 1, 129), num_kv_heads=1, group=3, seed=5)
    base.update(extra)
    case = CheckCase(*pair, **base).build()
    p = CheckCase(*pair, **base).params()
    exact = cpu.prefill_attention(case.q_prefill, case.layer, case.block_tables, case.seq_lens,
                                  case.query_start_loc, p)
    pb = dataclasses.replace(p, bf16_dots=True)
    approx = cpu.prefill_attention(case.q_prefill, case.layer, case.block_tables, case.seq_lens,
                                   case.query_start_loc, pb)
    assert "pkv_prefill_bf16" in tile_calls and "pkv_prefill" in tile_calls
    want = oracle_outputs(case, p, mode="prefill")
    d = case.layer.head_dim
    err = (approx.double() - want).norm(dim=-1)
    bound = bf16_bound(case, p) + 2e-4 * d ** 0.5
    assert bool((err <= bound).all()), f"worst err/bound {float((err / bound).max()):.3f}"
    assert float((approx - exact).abs().max()) > 0  # the approximate path ran
    assert float((exact.double() - want).norm(dim=-1).max()) < 2e-4 * d ** 0.5


@needs_bf16
@pytest.mark.parametrize("head_dim", [80, 112])
def test_bf16_dots_head_dim_not_multiple_of_32(head_dim, tile_calls):
    """head_dim % 32 != 0 (the bf16 K panel pairs dims in 32-dim vectors): exact scores, bf16 values
    (pairs of keys), within the same bound."""
    cc = CheckCase("bf16", "nvfp4", seq_lens=(200,), q_lens=(150,), head_dim=head_dim, block_size=16)
    case, p = cc.build(), cc.params()
    args = (case.q_prefill, case.layer, case.block_tables, case.seq_lens, case.query_start_loc)
    exact = cpu.prefill_attention(*args, p)
    approx = cpu.prefill_attention(*args, dataclasses.replace(p, bf16_dots=True))
    assert "pkv_prefill_bf16" in tile_calls
    err = (approx.double() - oracle_outputs(case, p, mode="prefill")).norm(dim=-1)
    assert bool((err <= bf16_bound(case, p) + 2e-4 * head_dim ** 0.5).all())
    assert float((approx - exact).abs().max()) > 0


def test_bf16_dots_is_validated():
    case = CheckCase("turbo3", "turbo3", seq_lens=(40,), q_lens=(20,)).build()
    with pytest.raises(InvalidInput, match="bf16_dots must be True or False"):
        run_op(case, AttentionParams(scale=0.125, bf16_dots=1), mode="prefill", backend=None)


@needs_bf16
def test_bf16_dots_leaves_decode_and_the_general_kernel_exact():
    """Decode batches and prefill_tile=False (the general kernel) ignore bf16_dots."""
    case = CheckCase("turbo3", "turbo3", seq_lens=(100, 7), q_lens=(60, 7)).build()
    p = AttentionParams(scale=0.125)
    pb = dataclasses.replace(p, bf16_dots=True)
    assert torch.equal(run_op(case, p, mode="decode", fn=cpu.decode_attention),
                       run_op(case, pb, mode="decode", fn=cpu.decode_attention))
    k = cpu._require()
    args = (case.q_prefill, case.layer, case.block_tables, case.seq_lens, case.query_start_loc)
    assert torch.equal(att.run_attention(k, *args, p, prefill_tile=False),
                       att.run_attention(k, *args, pb, prefill_tile=False))


@needs_bf16
def test_bf16_dots_lse_within_score_bound():
    """The log-sum-exp of the bf16 tile (lse=, key_start=) moves by at most the score bound E."""
    case = CheckCase("turbo3", "fp8", seq_lens=(333, 40), q_lens=(300, 40), num_kv_heads=3, group=3).build()
    p = AttentionParams(scale=64 ** -0.5, sliding_window=200)
    lses = []
    for bf in (False, True):
        lse = torch.empty(case.q_prefill.shape[:2], dtype=torch.float32)
        att.run_attention(cpu._require(), case.q_prefill, case.layer, case.block_tables, case.seq_lens,
                          case.query_start_loc, dataclasses.replace(p, bf16_dots=bf), lse=lse, key_start=60)
        lses.append(lse)
    exact, approx = lses
    fin = torch.isfinite(exact)
    assert bool((torch.isfinite(approx) == fin).all()) and not bool(fin.all())
    e = bf16_bound(case, p, scores=True).float()
    assert bool(((approx - exact).abs()[fin] <= e[fin] + 1e-5).all())
    assert float((approx - exact).abs()[fin].max()) > 0
