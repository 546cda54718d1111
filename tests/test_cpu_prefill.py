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

import importlib

import pytest
import torch

from helpers.attention_oracle import run_op
from helpers.backend_check import CheckCase, all_pairs, check_backend

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

    def spy(kernel):
        fn = real(kernel)
        if fn is None:
            return None
        return lambda *args: calls.append(1) or fn(*args)

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
]


@needs_tile
@pytest.mark.parametrize("pair,extra", SETTINGS)
def test_settings_long_chunk(pair, extra, tile_calls):
    base = dict(seq_lens=(300, 1, 129), q_lens=(260, 1, 129), num_kv_heads=1, group=3)
    base.update(extra)
    _check([CheckCase(*pair, **base)])
    assert tile_calls


@needs_tile
@pytest.mark.parametrize("pair", [("turbo3", "turbo3"), ("turbo4", "turbo4"), ("fp8", "turbo3")])
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
@pytest.mark.parametrize("extra", [dict(sparse_v_threshold=1e-2), dict(int8_scores=True)])
def test_other_settings_stay_on_the_general_kernel(extra, tile_calls):
    """Sparse V and the approximate integer scores are not the tile's: the general kernel runs them."""
    case = CheckCase("turbo3", "turbo3", seq_lens=(100,), q_lens=(80,)).build()
    params = AttentionParams(scale=0.125, **extra)
    out = run_op(case, params, mode="prefill", fn=cpu.prefill_attention)
    assert torch.isfinite(out).all() and not tile_calls


@needs_tile
def test_decode_batches_do_not_take_the_tile(tile_calls):
    case = CheckCase("turbo3", "turbo3", seq_lens=(100, 7)).build()
    out = run_op(case, AttentionParams(scale=0.125), mode="decode", fn=cpu.decode_attention)
    assert torch.isfinite(out).all() and not tile_calls
