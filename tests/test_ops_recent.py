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
    monkeypatch.setattr(rec, "split_prefill_applies", lambda *a: False)  # its own test below
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


# -- decode split: the C kernel over the pages, torch over the tail (ops/recent_decode.py) ----------
from pagedkv.ops import cpu  # noqa: E402
from pagedkv.ops import recent_decode  # noqa: E402

needs_kernel = pytest.mark.skipif(not cpu.available(), reason="the C attention kernel is not built here")
WINDOW_CODECS = [name for name, c in CODECS.items() if not c.traits.tensor_scaled]  # what a tail may use
DECODE_LENS = (300, 5, 200, 1, 97, 0)  # several contexts, one token, a padding row


def _spy(monkeypatch):
    calls = []
    real = recent_decode.split_decode
    from pagedkv.ops import recent as rec

    spy = lambda *a, **k: calls.append(1) or real(*a, **k)  # noqa: E731
    monkeypatch.setattr(rec, "split_decode", spy)  # the prefill op's decode rows
    monkeypatch.setattr(recent_decode, "split_decode", spy)  # the decode op (`split_rows`)
    return calls


def _close(got, want):
    assert torch.isfinite(got).all()
    assert (got - want).abs().max() < 2e-5 * max(1.0, float(want.abs().max()))


@needs_kernel
@pytest.mark.parametrize("tail", WINDOW_CODECS)
def test_split_decode_is_the_reference_for_every_tail_codec(tail, monkeypatch):
    calls = _spy(monkeypatch)
    kw = dict(seq_lens=DECODE_LENS, num_kv_heads=2, group=3, seed=3)
    main = make_case(CODECS["turbo3"], CODECS["turbo3"], **kw)
    hp = make_case(CODECS[tail], CODECS[tail], **kw)
    params = AttentionParams(scale=0.125)
    for recent, sinks in ((16, 0), (64, 16), (40, 3), (500, 0)):
        args = (main.q_decode, main.layer, hp.layer, main.block_tables, main.seq_lens, params)
        got = recent_decode_attention(*args, recent=recent, sinks=sinks)
        want = recent_decode_attention(*args, recent=recent, sinks=sinks, reference=True)
        _close(got, want)
        assert torch.equal(got[-1], torch.zeros_like(got[-1]))  # the padding row
    assert len(calls) == 4


@needs_kernel
@pytest.mark.parametrize("fmt, tail, extra", [
    (("turbo3", "turbo2"), "q8_0", dict(transform=True)),  # rotated K and V, k_mult, both centres
    (("q4_0", "turbo3"), "bf16", dict(centre=True, k_offset=3.0)),
    (("fp8", "turbo4"), "q8_0", dict(k_scale=3.0, v_scale=0.5)),  # tensor-scaled K
    (("turbo2g64", "fp8"), "f16", {}),  # a tail the kernel does not read: decoded in torch
    (("bf16", "bf16"), "f16", dict(transform=True)),  # the same, with the transform
    (("bf16", "bf16"), "turbo5", dict(transform=True)),  # a rotated 5-bit tail, read by the kernel
])
@pytest.mark.parametrize("setting", ["plain", "soft-cap", "sink logits"])
@pytest.mark.parametrize("recent, sinks", [(16, 16), (64, 20), (1, 0), (7, 1)])
def test_split_decode_is_the_reference(fmt, tail, extra, setting, recent, sinks, monkeypatch):
    """GQA (3 query heads per kv head), sinks on and off a block boundary, contexts shorter than
    S + R (every key in the tail) and longer; soft-cap and sink logits in every part."""
    calls = _spy(monkeypatch)
    kw = dict(seq_lens=DECODE_LENS, num_kv_heads=2, group=3, seed=13, **extra)
    main, hp = make_case(CODECS[fmt[0]], CODECS[fmt[1]], **kw), make_case(CODECS[tail], CODECS[tail], **kw)
    params = {"plain": AttentionParams(scale=0.125), "soft-cap": AttentionParams(scale=0.125, soft_cap=4.0),
              "sink logits": AttentionParams(scale=0.125, sinks=torch.linspace(-2, 3, 6))}[setting]
    args = (main.q_decode, main.layer, hp.layer, main.block_tables, main.seq_lens, params)
    got = recent_decode_attention(*args, recent=recent, sinks=sinks)
    want = recent_decode_attention(*args, recent=recent, sinks=sinks, reference=True)
    _close(got, want)
    taken = not (setting == "sink logits" and main.layer.v_centre is not None)  # the kernel's reference case
    assert len(calls) == int(taken)


def _released_tail(lens, q_lens, page_block, tail_block, sinks, recent):
    """(pages case, tail case, tail tables) in vLLM's layout: the tail in its own block group
    (another block size, its own tables; the blocks no query of the call reads released: their
    entries point anywhere, a spare block full of NaN bytes or -1), the last blocks' unwritten
    slots NaN bytes too."""
    kw = dict(seq_lens=lens, q_lens=q_lens, num_kv_heads=3, group=3, seed=21)
    main = make_case(CODECS["turbo3"], CODECS["turbo3"], block_size=page_block, **kw)
    hp = make_case(CODECS["q8_0"], CODECS["q8_0"], block_size=tail_block, **kw)
    tables = hp.block_tables.clone()
    spare = sorted(set(range(hp.layer.num_blocks)) - set(tables.flatten().tolist()))[0]
    hp.layer.k_pool[spare] = 255  # a released block holds any bytes: NaN (bf16/f16 0xffff, scales too)
    hp.layer.v_pool[spare] = 255
    from pagedkv.codecs.layout import block_views

    for b, n in enumerate(lens):  # the last block's unwritten slots hold any bytes too
        if n % tail_block:
            for pool in (hp.layer.k_pool, hp.layer.v_pool):
                for view in block_views(hp.layer.k_codec, pool, tail_block, 3, 64):
                    view[int(hp.block_tables[b, n // tail_block]), n % tail_block:] = 255
    for b, (n, ql) in enumerate(zip(lens, q_lens)):  # released blocks: neither sinks' nor any query's window
        keep = set(range(-(-sinks // tail_block))) | set(range(max(0, n - ql - recent + 1) // tail_block,
                                                               -(-n // tail_block)))
        for i in range(tables.shape[1]):
            if i not in keep:
                tables[b, i] = spare if i % 2 else -1
    return main, hp, tables


@needs_kernel
@pytest.mark.parametrize("page_block, tail_block, sinks, recent", [(64, 16, 16, 64), (16, 32, 20, 64),
                                                                   (128, 32, 0, 64), (32, 16, 40, 8)])
def test_split_decode_with_the_tails_own_block_group(page_block, tail_block, sinks, recent, monkeypatch):
    """vLLM's layout: the tail in its own block group (another block size, its own tables, blocks
    outside the window released: their table entries point anywhere), sinks not on a page block
    boundary (the kernel skips them by key_start); more sinks than recent tokens (the tail in
    torch)."""
    calls = _spy(monkeypatch)
    lens = (700, 3, 129, 0)
    main, hp, tables = _released_tail(lens, (1, 1, 1, 0), page_block, tail_block, sinks, recent)
    params = AttentionParams(scale=0.125)
    args = (main.q_decode, main.layer, hp.layer, main.block_tables, main.seq_lens, params)
    kw = dict(recent=recent, sinks=sinks, tail_block_tables=tables)
    want = recent_decode_attention(*args, **kw, reference=True)
    _close(recent_decode_attention(*args, **kw), want)
    # the drop-in decodes through the prefill op: one query per sequence, padding rows without one
    qsl = torch.tensor([0, 1, 2, 3, 3], dtype=torch.int32)
    got = recent_prefill_attention(main.q_decode[:3], main.layer, hp.layer, main.block_tables, main.seq_lens,
                                   qsl, params, **kw)
    _close(got, want[:3])
    assert len(calls) == 2


@needs_kernel
def test_split_decode_is_taken_only_where_it_applies(monkeypatch):
    calls = _spy(monkeypatch)
    main, hp = _pair(("turbo3", "turbo3"), "bf16")
    dec = (main.q_decode, main.layer, hp.layer, main.block_tables, main.seq_lens)
    for params in (AttentionParams(scale=0.1, sliding_window=16), AttentionParams(scale=0.1, sparse_v_threshold=1e-3)):
        recent_decode_attention(*dec, params, recent=8)
    recent_decode_attention(*dec, AttentionParams(scale=0.1), recent=8, reference=True)
    recent_prefill_attention(main.q_prefill, main.layer, hp.layer, main.block_tables, main.seq_lens,
                             main.query_start_loc, AttentionParams(scale=0.1), recent=8)  # several queries
    assert not calls
    recent_decode_attention(*dec, AttentionParams(scale=0.1), recent=8)
    assert calls


def test_sinks_and_window_are_bounded_and_clamped_to_the_sequence(monkeypatch):
    """Issue 28 N5: S and R past 2**24 are a ConfigError (a label's 5000-digit count too, not a
    ValueError); a large S or R costs what the sequence's length does, per step (2**22 sinks on
    a 45-token prompt took 82 s and 5.8 GB, 2**40 tried to allocate 1 TiB)."""
    import time

    from pagedkv.ops.recent import window_from_label

    for bad in (dict(tokens=1 << 40), dict(tokens=4, sinks=1 << 40), dict(tokens=4, sinks=-1)):
        with pytest.raises(ConfigError, match=r"\[[01], 16777216\]"):
            RecentWindow(**bad)
    with pytest.raises(ConfigError, match="12|digit"):
        window_from_label("r4s" + "9" * 5000)
    with pytest.raises(ConfigError, match="digit"):
        window_from_label("9" * 5000)
    kw = dict(seq_lens=(45, 9, 0), num_kv_heads=2, group=2, seed=4)
    main = make_case(CODECS["turbo3"], CODECS["turbo3"], **kw)
    hp = make_case(CODECS["q8_0"], CODECS["q8_0"], **kw)
    args = (main.q_decode, main.layer, hp.layer, main.block_tables, main.seq_lens,
            AttentionParams(scale=0.125))
    for reference in (False, True):
        want = recent_decode_attention(*args, recent=45, sinks=45, reference=reference)
        t0 = time.perf_counter()
        got = recent_decode_attention(*args, recent=1 << 22, sinks=1 << 22, reference=reference)
        assert time.perf_counter() - t0 < 10
        assert torch.equal(got, want)
    with pytest.raises(ConfigError, match="sinks must be an integer in"):
        recent_decode_attention(*args, recent=8, sinks=1 << 40)


# -- prefill split: the C kernel over the pages and the tail's band, torch over the sinks (ops/recent_prefill.py)
def _spy_prefill(monkeypatch):
    from pagedkv.ops import recent as rec
    from pagedkv.ops import recent_prefill

    calls = []
    real = recent_prefill.split_prefill
    monkeypatch.setattr(rec, "split_prefill", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@needs_kernel
@pytest.mark.parametrize("fmt, tail, extra", [
    (("turbo3", "turbo2"), "q8_0", dict(transform=True)),  # rotated K and V, k_mult, both centres
    (("q4_0", "turbo3"), "bf16", dict(centre=True, k_offset=3.0)),
    (("fp8", "turbo4"), "q8_0", dict(k_scale=3.0, v_scale=0.5)),  # tensor-scaled K
])
@pytest.mark.parametrize("setting", ["plain", "soft-cap", "window 50", "window 7"])
@pytest.mark.parametrize("recent, sinks", [(16, 16), (64, 20), (1, 0), (7, 9), (500, 0)])
def test_split_prefill_is_the_reference(fmt, tail, extra, setting, recent, sinks, monkeypatch):
    """Rows longer than a kernel tile, a short row and a chunk (queries after cached tokens), GQA,
    sinks on and off a block boundary and more sinks than recent tokens, a window covering every
    key; soft-cap in every part; sliding windows wider and narrower than R."""
    calls = _spy_prefill(monkeypatch)
    kw = dict(seq_lens=(300, 5, 200, 0), q_lens=(300, 5, 77, 0), num_kv_heads=2, group=3, seed=11, **extra)
    main, hp = make_case(CODECS[fmt[0]], CODECS[fmt[1]], **kw), make_case(CODECS[tail], CODECS[tail], **kw)
    params = {"plain": AttentionParams(scale=0.125), "soft-cap": AttentionParams(scale=0.125, soft_cap=4.0),
              "window 50": AttentionParams(scale=0.125, sliding_window=50),
              "window 7": AttentionParams(scale=0.125, sliding_window=7)}[setting]
    args = (main.q_prefill, main.layer, hp.layer, main.block_tables, main.seq_lens, main.query_start_loc, params)
    got = recent_prefill_attention(*args, recent=recent, sinks=sinks)
    _close(got, recent_prefill_attention(*args, recent=recent, sinks=sinks, reference=True))
    assert len(calls) == 1


@needs_kernel
@pytest.mark.parametrize("page_block, tail_block, sinks, recent", [(64, 16, 16, 64), (16, 32, 20, 64),
                                                                   (128, 32, 0, 64), (32, 16, 40, 8)])
def test_split_prefill_with_the_tails_own_block_group(page_block, tail_block, sinks, recent, monkeypatch):
    """A chunked prefill in vLLM's layout (`_released_tail`): the tail's blocks before each chunk's
    first window released, sinks not on a page block boundary, more sinks than recent tokens."""
    calls = _spy_prefill(monkeypatch)
    lens, q_lens = (700, 3, 129, 0), (150, 3, 40, 0)
    main, hp, tables = _released_tail(lens, q_lens, page_block, tail_block, sinks, recent)
    args = (main.q_prefill, main.layer, hp.layer, main.block_tables, main.seq_lens, main.query_start_loc,
            AttentionParams(scale=0.125))
    kw = dict(recent=recent, sinks=sinks, tail_block_tables=tables)
    _close(recent_prefill_attention(*args, **kw), recent_prefill_attention(*args, **kw, reference=True))
    assert len(calls) == 1


@needs_kernel
def test_split_prefill_is_taken_only_where_it_applies(monkeypatch):
    calls = _spy_prefill(monkeypatch)
    main, hp = _pair(("turbo3", "turbo3"), "bf16")
    args = (main.q_prefill, main.layer, hp.layer, main.block_tables, main.seq_lens, main.query_start_loc)
    for params in (AttentionParams(scale=0.1, sinks=torch.zeros(4)), AttentionParams(scale=0.1, sparse_v_threshold=1e-3)):
        recent_prefill_attention(*args, params, recent=8)
    recent_prefill_attention(*args, AttentionParams(scale=0.1), recent=8, reference=True)
    assert not calls
    recent_prefill_attention(*args, AttentionParams(scale=0.1), recent=8)
    assert calls
