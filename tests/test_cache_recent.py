"""The high-precision recent window in the one core (issue 13 item 1): `CacheConfig.recent_window`
keeps every layer's last R tokens in a tail (the window's codec) held in a block group of window
R, so only the blocks covering the last R positions stay resident, in the engine loop and in the
transformers drop-in.

Oracle: fp64 attention where a query at position p reads keys p - R < j <= p through the tail
codec's round trip and older keys through the layer format's round trip (both of the same K/V),
with the layer's sliding window.
"""

from __future__ import annotations

import pytest
import torch

from helpers.attention_oracle import oracle_attention
from pagedkv.cache import CacheConfig, PagedCache
from pagedkv.codecs.reference import roundtrip
from pagedkv.errors import ConfigError, InvalidInput
from pagedkv.offload import OffloadConfig
from pagedkv.ops import AttentionParams
from pagedkv.ops.recent import RecentWindow, stored_tail_tokens

BS, H, D, HQ = 4, 2, 32, 4
WINDOWS = [None, 9]


def _cfg(recent=RecentWindow(6), **kw):
    base = dict(num_layers=2, num_kv_heads=H, head_dim=D, kv_format=["turbo2", "turbo3k_turbo2v"],
                block_size=BS, num_blocks=96, sliding_window=WINDOWS, high_precision_layers=0,
                recent_window=recent)
    base.update(kw)
    return CacheConfig(**base)


def _retained(n_before: int, w: int) -> int:
    return n_before // BS - max(0, n_before - w + 1) // BS + 1


def _params(cfg, layer):
    return AttentionParams(scale=D ** -0.5, sliding_window=cfg.layers[layer].sliding_window)


def _oracle(cfg, layer, q, k, v, q_pos):
    fmt, tail, r = cfg.layers[layer].format, cfg.recent_window.codec, cfg.recent_window.tokens
    sinks = cfg.recent_window.sinks
    params = _params(cfg, layer)
    km, vm, kt, vt = roundtrip(fmt.k, k), roundtrip(fmt.v, v), roundtrip(tail, k), roundtrip(tail, v)
    out = []
    for i, p in enumerate(q_pos.tolist()):
        j = torch.arange(k.shape[0])[:, None, None]
        in_tail = (j > p - r) | (j < sinks)
        ke, ve = torch.where(in_tail, kt, km), torch.where(in_tail, vt, vm)
        out.append(oracle_attention(q[i:i + 1], ke, ve, torch.tensor([p]), params))
    return torch.cat(out)


class Loop:
    def __init__(self, cache, seed=0):
        self.c, self.g = cache, torch.Generator().manual_seed(seed)
        self.hist: dict = {}
        self.err = 0.0

    def _run(self, sids, counts, slots, decode):
        t = sum(counts)
        for layer in range(2):
            k, v, q = (torch.randn(t, h, D, generator=self.g) for h in (H, H, HQ))
            self.c.store(layer, k, v, slots)
            at = 0
            for sid, n in zip(sids, counts):
                hk, hv = self.hist.setdefault((sid, layer), ([], []))
                hk.append(k[at:at + n])
                hv.append(v[at:at + n])
                at += n
            params = _params(self.c.config, layer)
            if decode:
                out = self.c.decode_attention(layer, q, sids, params)
            else:
                qsl = torch.tensor([0] + list(torch.tensor(counts).cumsum(0)), dtype=torch.int32)
                out = self.c.prefill_attention(layer, q, sids, qsl, params)
            at = 0
            for sid, n in zip(sids, counts):
                k_all, v_all = (torch.cat(x) for x in self.hist[(sid, layer)])
                L = k_all.shape[0]
                ref = _oracle(self.c.config, layer, q[at:at + n], k_all, v_all, torch.arange(L - n, L))
                self.err = max(self.err, float((out[at:at + n].double() - ref).abs().max() / ref.abs().max()))
                at += n
        self.c.commit(list(sids))

    def prefill(self, tokens):
        new = self.c.add_sequence(tokens)
        self._run([new.seq_id], [len(tokens)], new, decode=False)
        return new.seq_id

    def decode(self, sids):
        batch = self.c.step(sids, [[5]] * len(sids))
        self._run(sids, [1] * len(sids), batch, decode=True)
        return batch


@pytest.mark.parametrize("recent", [RecentWindow(6), RecentWindow(11, "q8_0"),
                                    RecentWindow(9, "q8_0", sinks=5)])
def test_engine_loop_with_a_recent_window_matches_the_oracle(recent):
    c = PagedCache(_cfg(recent))
    r, keep = recent.tokens, -(-recent.sinks // BS)
    loop = Loop(c)
    sids = [loop.prefill([100 * n + i for i in range(n)]) for n in (23, 5)]
    tail = c.groups.tail_group
    assert c.core.groups[tail].window == r and c.tails[0].k_codec is recent.codec
    for _ in range(12):
        lens = [c.seq_len(s) for s in sids]
        batch = loop.decode(sids)
        # only the tail blocks covering the last R positions are resident
        assert c.core.groups[tail].pool.num_used == sum(
            stored_tail_tokens(n + 1, r, BS, recent.sinks) // BS for n in lens)
        if not keep:
            assert c.core.groups[tail].pool.num_used == sum(_retained(n, r) for n in lens)
        assert batch.tail_slots is not None and batch.tail_tables is not None
    assert loop.err < 1e-4
    # a chunked prefill of a third sequence after the others (queries span the window edge)
    new = c.add_sequence(list(range(7)))
    loop._run([new.seq_id], [7], new, decode=False)
    batch = c.step([new.seq_id], [list(range(9))])
    loop._run([new.seq_id], [9], batch, decode=False)
    assert loop.err < 1e-4
    c.core.check_invariants()
    # the tail's stored rows are the tail codec's round trip, only inside the window
    k, _ = c.gather(1, sids[0], tail=True)
    n = c.seq_len(sids[0])
    hist = torch.cat(loop.hist[(sids[0], 1)][0])
    assert torch.equal(k[n - r:], roundtrip(recent.codec, hist)[n - r:])
    assert torch.isnan(k[keep * BS:n - r - BS]).all()
    assert torch.equal(k[:keep * BS], roundtrip(recent.codec, hist)[:keep * BS])  # the sinks' blocks


def test_one_group_holding_the_pages_and_the_tails():
    c = PagedCache(_cfg(RecentWindow(9), sliding_window=[9, 9]))  # every layer slides with W = R
    assert len(c.core.groups) == 1 and c.groups.tail_group == 0
    loop = Loop(c, seed=5)
    sid = loop.prefill(list(range(15)))
    for _ in range(6):
        batch = loop.decode([sid])
        assert torch.equal(batch.tail_slots, batch.layer_slots(1))
    assert loop.err < 1e-4
    with pytest.raises(InvalidInput, match="keeps only the last 9"):
        c.decode_attention(0, torch.randn(1, HQ, D), [sid], AttentionParams(scale=1.0))


def test_tail_memory_is_released_and_counted():
    c = PagedCache(_cfg(RecentWindow(6), num_blocks=128))
    loop = Loop(c, seed=3)
    sid = loop.prefill(list(range(90)))
    tail = c.groups.tail_group
    grown = c.stats().groups[tail]
    assert grown.num_blocks >= 23
    for _ in range(2):
        loop.decode([sid])
    st = c.stats()
    now = st.groups[tail]
    assert now.blocks_used == _retained(91, 6) and now.num_blocks <= 16
    assert st.tail_bytes == sum(t.k_pool.numel() + t.v_pool.numel() for t in c.tails)
    assert st.tail_bytes <= now.pool_bytes and st.tail_bytes * 2 <= grown.pool_bytes
    assert st.total_bytes == sum(g.pool_bytes for g in st.groups)
    # what the eval counts as stored is what the tail group holds per layer and side
    assert now.blocks_used * BS == stored_tail_tokens(92, 6, BS)
    assert loop.err < 1e-4


def test_config_fingerprint_and_refusals():
    assert _cfg(8).recent_window == RecentWindow(8)
    assert _cfg(None).recent_window is None
    with pytest.raises(ConfigError, match="recent_window must be"):
        _cfg("64")
    fps = {_cfg(r).fingerprint for r in (None, RecentWindow(6), RecentWindow(7), RecentWindow(6, "q8_0"),
                                         RecentWindow(6, sinks=4))}
    assert len(fps) == 5
    assert len(PagedCache(_cfg(RecentWindow(9, sinks=4))).core.groups) == 3  # not shared with W = 9
    with pytest.raises(ConfigError, match="multiple of 32"):  # the tail codec is checked up front
        _cfg(RecentWindow(6, "q8_0"), head_dim=16)
    capped = PagedCache(_cfg(), OffloadConfig(resident_blocks_per_seq=2, swap="memory"))
    assert capped.tiers is not None  # the tail is in swap records (tests/test_cache_tiers_groups.py)
    c = PagedCache(_cfg(key_centring=True))
    new = c.add_sequence([1, 2, 3])
    with pytest.raises(ConfigError, match="StepBatch or NewSequence"):
        c.store(0, torch.zeros(3, H, D), torch.zeros(3, H, D), new.slot_mapping)
    c.free(new.seq_id)
    c.clear()
    centre = torch.randn(H, D)
    c.configure_layer(0, k_centre=centre)
    assert torch.equal(c.tails[0].k_centre, c.layers[0].k_centre)  # the tail stores the same rows


def test_drop_in_tail_lives_in_its_own_group():
    transformers = pytest.importorskip("transformers")
    from pagedkv.integrations.transformers import ATTN_IMPLEMENTATION, PagedKVCache, register

    register()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=128)).eval()
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    ids = torch.randint(3, 64, (2, 50), generator=torch.Generator().manual_seed(1))
    for recent in (RecentWindow(6), RecentWindow(6, sinks=3)):
        cache = PagedKVCache(model, "turbo3", block_size=4, recent_window=recent)
        with torch.no_grad():
            model(ids[:, :30], cache=cache, use_cache=True)
            for t in range(30, 50):
                model(ids[:, t:t + 1], cache=cache, use_cache=True)
        g = cache.tail_group
        assert g.window == 6 and g.tails == [0, 1] and g.layers == []
        assert g.used == 2 * stored_tail_tokens(50, 6, 4, recent.sinks) // 4  # two rows
    assert g.used == 2 * (_retained(49, 6) + 1)  # the sinks' block is kept besides the window
    for layer in cache.layers:
        assert layer.tail.num_blocks == g.num_blocks <= 16 < layer.paged.num_blocks
    from pagedkv.codecs import get_codec

    pages = sum(v.used * cache.group_bytes_per_block(v) for v in cache.groups if v is not g)
    assert cache.used_bytes() == pages + g.used * 2 * 2 * get_codec("bf16").block_bytes(4, 2, 16)
    # with sinks, token-by-token decoding (tail blocks released as it goes) sees what one pass sees
    fixed = dict(key_centring=False, value_centring=False, block_size=4,
                 recent_window=RecentWindow(6, "turbo8", sinks=3))
    with torch.no_grad():
        one = model(ids, cache=PagedKVCache(model, "turbo2", **fixed), use_cache=True).logits
        cache = PagedKVCache(model, "turbo2", **fixed)
        steps = [model(ids[:, :5], cache=cache, use_cache=True).logits]
        steps += [model(ids[:, t:t + 1], cache=cache, use_cache=True).logits for t in range(5, 50)]
    assert cache.tail_group.dead[0] > 1  # blocks between the sinks and the window were released
    assert (one - torch.cat(steps, 1)).abs().max() < 1e-3 * one.abs().max()
