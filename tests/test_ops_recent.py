"""The high-precision recent window (`pagedkv.ops.recent`) against an fp64 oracle.

The oracle attends, for a query at position p, over keys 0..p whose K/V are the tail codec's
round trip for p - R < j <= p and the format's round trip for j <= p - R (the K/V of each
layer dequantized independently of the pools, `helpers.attention_oracle.make_case`), in one
softmax with the same mask, soft-cap, sinks and window. Both layers hold the same tokens at the
same slots (two cases from one seed).
"""

from __future__ import annotations

import pytest
import torch

from helpers.attention_oracle import make_case, oracle_attention, prefill_positions
from pagedkv.codecs import CODECS
from pagedkv.errors import ConfigError
from pagedkv.ops import AttentionParams, api
from pagedkv.ops.recent import RecentWindow, recent_decode_attention, recent_prefill_attention, stored_tail_tokens

LENS, QLENS = (40, 9, 70), (40, 3, 25)  # whole-window teacher forcing, short rows, a chunk


def _pair(fmt, tail, **kw):
    kw = dict(seq_lens=LENS, q_lens=QLENS, num_kv_heads=2, group=2, seed=5, **kw)
    return make_case(CODECS[fmt[0]], CODECS[fmt[1]], **kw), make_case(CODECS[tail], CODECS[tail], **kw)


def _oracle(main, tail, params, recent):
    outs = []
    starts = main.query_start_loc.tolist()
    for b, pos in enumerate(prefill_positions(main)):
        q = main.q_prefill[starts[b]:starts[b + 1]]
        for i, p in enumerate(pos.tolist()):
            j = torch.arange(main.seq_lens[b].item())[:, None, None]
            near = j > p - recent
            k = torch.where(near, tail.k_deq[b], main.k_deq[b])
            v = torch.where(near, tail.v_deq[b], main.v_deq[b])
            outs.append(oracle_attention(q[i:i + 1], k, v, torch.tensor([p]), params))
    return torch.cat(outs)


@pytest.mark.parametrize("fmt, tail, recent, extra", [
    (("turbo3", "turbo3"), "bf16", 8, {}),
    (("turbo2", "q4_0"), "q8_0", 16, dict(transform=True)),
    (("fp8", "turbo2"), "bf16", 1, dict(centre=True, k_offset=3.0)),
    (("turbo4", "turbo3"), "q8_0", 100, {}),  # the window covers every key
])
@pytest.mark.parametrize("setting", ["plain", "window+cap+sinks"])
def test_recent_window_matches_the_oracle(fmt, tail, recent, extra, setting):
    main, hp = _pair(fmt, tail, **extra)
    params = AttentionParams(scale=0.125)
    if setting != "plain":
        params = AttentionParams(scale=0.125, sliding_window=23, soft_cap=5.0, sinks=torch.linspace(-1, 1, 4))
    got = recent_prefill_attention(main.q_prefill, main.layer, hp.layer, main.block_tables, main.seq_lens,
                                   main.query_start_loc, params, recent=recent)
    want = _oracle(main, hp, params, recent)
    assert (got.double() - want).abs().max() < 2e-5


def test_limits_are_the_plain_ops():
    """R >= every position: the tail alone; the tail in the format's own codecs: the format alone."""
    main, hp = _pair(("turbo3", "turbo2"), "q8_0")
    params = AttentionParams(scale=0.125)
    args = (main.block_tables, main.seq_lens, main.query_start_loc, params)
    whole = recent_prefill_attention(main.q_prefill, main.layer, hp.layer, *args, recent=1000)
    assert torch.allclose(whole, api.prefill_attention(main.q_prefill, hp.layer, *args, backend="reference"), atol=1e-5)
    same = recent_prefill_attention(main.q_prefill, main.layer, main.layer, *args, recent=7)
    assert torch.allclose(same, api.prefill_attention(main.q_prefill, main.layer, *args, backend="reference"), atol=1e-5)
    # and the window changes the result (the tail's codecs are used for recent keys)
    near = recent_prefill_attention(main.q_prefill, main.layer, hp.layer, *args, recent=7)
    assert (near - same).abs().max() > 1e-3


def test_decode_is_the_last_query_and_padding_rows_are_zero():
    main, hp = _pair(("turbo3", "turbo3"), "bf16")
    lens = main.seq_lens.clone()
    lens[1] = 0
    params = AttentionParams(scale=0.125)
    out = recent_decode_attention(main.q_decode, main.layer, hp.layer, main.block_tables, lens, params, recent=12)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    for b in (0, 2):
        n = int(lens[b])
        j = torch.arange(n)[:, None, None]
        k = torch.where(j > n - 1 - 12, hp.k_deq[b], main.k_deq[b])
        v = torch.where(j > n - 1 - 12, hp.v_deq[b], main.v_deq[b])
        want = oracle_attention(main.q_decode[b:b + 1], k, v, torch.tensor([n - 1]), params)
        assert (out[b:b + 1].double() - want).abs().max() < 2e-5


def test_settings_and_bad_input():
    assert RecentWindow(64).name == "r64" and RecentWindow(64, "q8_0").name == "r64q8_0"
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ConfigError, match="recent window tokens"):
            RecentWindow(bad)
    with pytest.raises(ConfigError, match="unknown codec"):
        RecentWindow(8, "nope")
    main, hp = _pair(("turbo3", "turbo3"), "bf16")
    small = make_case(CODECS["bf16"], CODECS["bf16"], seq_lens=(4,), head_dim=32)
    with pytest.raises(ConfigError, match="tail layer"):
        recent_prefill_attention(main.q_prefill, main.layer, small.layer, main.block_tables, main.seq_lens,
                                 main.query_start_loc, AttentionParams(scale=0.1), recent=4)
    # stored tail: the blocks covering the last R positions
    assert stored_tail_tokens(1024, 64, 16) == 64 and stored_tail_tokens(1030, 64, 16) == 80
    assert stored_tail_tokens(10, 64, 16) == 16 and stored_tail_tokens(0, 64, 16) == 0


@pytest.mark.parametrize("fmt, tail, extra", [
    (("turbo3", "turbo2"), "q8_0", dict(transform=True)),  # rotated K and V, k_mult, centres
    (("q4_0", "turbo3"), "bf16", dict(centre=True, k_offset=3.0)),
    (("turbo2g64", "turbo2g64"), "q8_0", {}),
])
@pytest.mark.parametrize("recent, sinks, window", [(16, 16, None), (64, 20, 50), (1, 0, None), (40, 3, 7),
                                                   (500, 0, None)])
def test_fast_path_is_the_reference_across_query_blocks(fmt, tail, extra, recent, sinks, window):
    """The default (fast) path against `reference=True` on rows longer than QUERY_BLOCK, one short row,
    GQA, with attention sinks not on a block boundary, sliding windows narrower and wider than R."""
    from pagedkv.ops import recent as rec

    kw = dict(seq_lens=(300, 5, 200), q_lens=(300, 5, 77), num_kv_heads=2, group=3, seed=11, **extra)
    main, hp = make_case(CODECS[fmt[0]], CODECS[fmt[1]], **kw), make_case(CODECS[tail], CODECS[tail], **kw)
    params = AttentionParams(scale=0.125, sliding_window=window)
    assert rec.fast_path_applies(params) and max(kw["q_lens"]) > rec.QUERY_BLOCK
    args = (main.q_prefill, main.layer, hp.layer, main.block_tables, main.seq_lens, main.query_start_loc, params)
    fast = recent_prefill_attention(*args, recent=recent, sinks=sinks)
    ref = recent_prefill_attention(*args, recent=recent, sinks=sinks, reference=True)
    assert (fast - ref).abs().max() < 2e-5 * max(1.0, float(ref.abs().max()))
    lens = main.seq_lens.clone()
    lens[1] = 0
    dec = [recent_decode_attention(main.q_decode, main.layer, hp.layer, main.block_tables, lens, params,
                                   recent=recent, sinks=sinks, reference=r) for r in (False, True)]
    assert (dec[0] - dec[1]).abs().max() < 2e-5 * max(1.0, float(dec[1].abs().max()))


def test_fast_path_is_taken_only_where_it_applies(monkeypatch):
    from pagedkv.ops import recent as rec

    main, hp = _pair(("turbo3", "turbo3"), "bf16")
    calls = []
    real = rec._attend_fast
    monkeypatch.setattr(rec, "_attend_fast", lambda *a, **k: calls.append(1) or real(*a, **k))
    args = (main.q_prefill, main.layer, hp.layer, main.block_tables, main.seq_lens, main.query_start_loc)
    recent_prefill_attention(*args, AttentionParams(scale=0.1), recent=8)
    assert calls
    calls.clear()
    for params in (AttentionParams(scale=0.1, soft_cap=5.0), AttentionParams(scale=0.1, sinks=torch.zeros(4)),
                   AttentionParams(scale=0.1, sparse_v_threshold=1e-3)):
        recent_prefill_attention(*args, params, recent=8)
    recent_prefill_attention(*args, AttentionParams(scale=0.1), recent=8, reference=True)
    assert not calls
