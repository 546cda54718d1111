"""The engine cache with several block groups (issue 17): layers with different sliding windows
get one group each (window reclaim, compaction, crop limit), every layer attends through its own
group's tables, and the memory of positions outside the window is released.

Oracle: fp64 attention (`tests/helpers/attention_oracle.py`) over the whole K/V history of each
sequence after the codec round trip (encoding is row-wise deterministic, so the stored bytes
decode to exactly that), with the window mask. The same loop with `reclaim_sliding=False` (one
group, nothing released) is a second oracle.
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

BS = 4
WINDOWS = [None, 8, 5]
H, D, HQ = 2, 32, 4


def _cfg(**kw):
    base = dict(num_layers=3, num_kv_heads=H, head_dim=D, kv_format=["turbo3", "q8_0", "turbo4k_turbo2v"],
                block_size=BS, num_blocks=64, sliding_window=WINDOWS, high_precision_layers=0)
    base.update(kw)
    return CacheConfig(**base)


class Loop:
    """An engine loop over a PagedCache: random K/V/q per token and layer; keeps each sequence's
    full K/V history for the oracle."""

    def __init__(self, cache: PagedCache, seed: int = 0):
        self.c = cache
        self.g = torch.Generator().manual_seed(seed)
        self.hist: dict = {}  # sid -> layer -> (k list, v list)
        self.err = 0.0

    def _kvq(self, t):
        r = lambda *s: torch.randn(*s, generator=self.g)  # noqa: E731
        return [(r(t, H, D), r(t, H, D), r(t, HQ, D)) for _ in range(3)]

    def params(self, layer):
        return AttentionParams(scale=D ** -0.5, sliding_window=WINDOWS[layer])

    def check(self, layer, sid, q, out):
        k, v = (torch.cat(x) for x in self.hist[sid][layer])
        spec = self.c.config.layers[layer]
        n, t = k.shape[0], q.shape[0]
        ref = oracle_attention(q, roundtrip(spec.format.k, k), roundtrip(spec.format.v, v),
                               torch.arange(n - t, n), self.params(layer))
        scale = float(ref.abs().max())
        self.err = max(self.err, float((out.double() - ref).abs().max()) / scale)

    def prefill(self, tokens):
        new = self.c.add_sequence(tokens)
        sid, t = new.seq_id, len(tokens)
        self.hist[sid] = [([], []) for _ in range(3)]
        qsl = torch.tensor([0, t], dtype=torch.int32)
        for layer, (k, v, q) in enumerate(self._kvq(t)):
            self.c.store(layer, k, v, new)
            self.hist[sid][layer][0].append(k)
            self.hist[sid][layer][1].append(v)
            self.check(layer, sid, q, self.c.prefill_attention(layer, q, [sid], qsl, self.params(layer)))
        self.c.commit(sid)
        return sid

    def decode(self, sids):
        batch = self.c.step(sids, [[1]] * len(sids))
        outs = []
        for layer, (k, v, q) in enumerate(self._kvq(len(sids))):
            self.c.store(layer, k, v, batch)
            for i, sid in enumerate(sids):
                self.hist[sid][layer][0].append(k[i:i + 1])
                self.hist[sid][layer][1].append(v[i:i + 1])
            out = self.c.decode_attention(layer, q, sids, self.params(layer))
            for i, sid in enumerate(sids):
                self.check(layer, sid, q[i:i + 1], out[i:i + 1])
            outs.append(out)
        self.c.commit(sids)
        return batch, outs


def _retained(n_before: int, w: int) -> int:
    """Blocks a sliding group holds after appending one token at length n_before (reclaim
    released those wholly before n_before - w + 1)."""
    return n_before // BS - max(0, n_before - w + 1) // BS + 1


def test_engine_loop_with_mixed_windows_matches_the_oracle_and_releases_blocks():
    c = PagedCache(_cfg())
    assert [c.group_of(i) for i in range(3)] == [0, 2, 1]  # global, then windows 5, 8
    assert [g.window for g in c.core.groups] == [None, 5, 8]
    loop = Loop(c)
    prompts = [[1000 * n + i for i in range(n)] for n in (13, 6, 21)]  # no shared prefix
    sids = [loop.prefill(p) for p in prompts]
    flat = PagedCache(_cfg(reclaim_sliding=False))  # one group, nothing released
    assert len(flat.core.groups) == 1
    ref = Loop(flat)
    for p in prompts:
        ref.prefill(p)
    for step in range(30):
        lens = [c.seq_len(s) for s in sids]
        batch, outs = loop.decode(sids)
        _, flat_outs = ref.decode(sids)
        for a, b in zip(outs, flat_outs):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        # every layer got its own group's slots and tables
        for layer in range(3):
            seqs = c.core.groups[c.group_of(layer)]
            assert batch.layer_slots(layer).tolist() == [
                seqs.table(s)[n // BS] * BS + n % BS for s, n in zip(sids, lens)]
            width = batch.layer_tables(layer).shape[1]
            assert batch.layer_tables(layer).tolist() == [
                [max(e, 0) for e in seqs.table(s)] + [0] * (width - len(seqs.table(s))) for s in sids]
        # memory: a sliding group holds only the blocks covering its window
        for g in c.core.groups[1:]:
            assert g.pool.num_used == sum(_retained(n, g.window) for n in lens)
        assert c.core.groups[0].pool.num_used == sum(-(-(n + 1) // BS) for n in lens)
    assert loop.err < 1e-4 and ref.err < 1e-4
    c.core.check_invariants()
    # gather: released positions are NaN, the rest decode to the round trip of what was stored
    k, _ = c.gather(2, sids[2])
    kept = ~torch.isnan(k[:, 0, 0])
    n = c.seq_len(sids[2])
    assert not kept[:n - 5].all() and kept[n - 5:].all()
    hist = torch.cat(loop.hist[sids[2]][2][0])
    fmt = c.config.layers[2].format
    assert torch.equal(k[kept], roundtrip(fmt.k, hist)[kept])


def test_sliding_pools_shrink_when_blocks_leave_the_window():
    c = PagedCache(_cfg(num_blocks=128))
    loop = Loop(c, seed=1)
    sid = loop.prefill(list(range(100)))  # 25 blocks in every group: the sliding pools grew
    g5 = c.group_of(2)
    grown = c.stats().groups[g5]
    assert grown.num_blocks >= 25 and c.layers[2].num_blocks == grown.num_blocks
    for _ in range(3):
        loop.decode([sid])
    after = c.stats().groups[g5]
    assert after.blocks_used == _retained(102, 5)
    assert after.num_blocks <= 16 and after.pool_bytes * 2 <= grown.pool_bytes  # memory returned
    assert c.layers[2].k_pool.shape[0] == after.num_blocks
    assert c.stats().groups[0].num_blocks == 128  # the global pool is fixed
    assert loop.err < 1e-4
    st = c.stats()
    assert st.total_bytes == sum(g.pool_bytes for g in st.groups)


def test_crop_limit_of_a_sliding_group_and_atomic_failures():
    c = PagedCache(_cfg())
    loop = Loop(c, seed=2)
    sid = loop.prefill(list(range(20)))
    for _ in range(4):
        loop.decode([sid])
    dead = c.core.groups[c.group_of(2)].dead(sid)
    assert dead > 0
    before = [list(g.table(sid)) for g in c.core.groups]
    with pytest.raises(InvalidInput, match="released"):
        c.pop(sid, 20)
    assert [list(g.table(sid)) for g in c.core.groups] == before
    with pytest.raises(InvalidInput, match="keep at least 23"):  # the window-8 group's limit
        c.pop(sid, 2)
    c.pop(sid, 1)  # within the crop limit of every group
    assert c.seq_len(sid) == 23
    c.pop(sid, 23)  # every token dropped is always allowed
    assert c.seq_len(sid) == 0 and all(g.pool.num_used == 0 for g in c.core.groups)
    c.core.check_invariants()


def test_store_takes_the_step_or_the_layers_own_slots():
    c = PagedCache(_cfg())
    new = c.add_sequence(list(range(9)))
    k = torch.randn(9, H, D)
    for layer in range(3):
        c.store(layer, k, k, new)
    c.commit(new.seq_id)
    for i in range(8):  # the window-5 group releases blocks and hands them out again
        batch = c.step([new.seq_id], [[3]])
        for layer in range(3):
            c.store(layer, k[i:i + 1], k[i:i + 1], batch if layer else batch.layer_slots(0))
        c.commit(new.seq_id)
    got, _ = c.gather(2, new.seq_id)
    want = roundtrip(c.config.layers[2].format.k, torch.cat([k, k[:8]]))
    assert torch.equal(got[-5:], want[-5:])
    assert c.allocate(new.seq_id, [4]).shape == (1,)  # the first group's slots


def test_offload_with_groups_and_the_config_is_checked():
    assert len(PagedCache(_cfg(), OffloadConfig(resident_blocks_per_seq=2, swap="memory"))
               .core.groups) == 3  # tiers over every group (tests/test_cache_tiers_groups.py)
    PagedCache(_cfg(reclaim_sliding=False), OffloadConfig(resident_blocks_per_seq=2, swap="memory"))
    with pytest.raises(ConfigError, match="reclaim_sliding must be a bool"):
        _cfg(reclaim_sliding=1)
    assert len(PagedCache(_cfg(sliding_window=[7, 7, 7])).core.groups) == 1  # every layer slides


def test_different_transforms_never_share_prefix_keys(tmp_path):
    """The fitted transform is part of the prefix keys: in the namespace of the cache's chain
    (configure_layer) and in the store's record layout."""
    from pagedkv.bench.toy import ToyLM

    prompt = [(5 * i + 1) % 97 for i in range(45)]
    cfg = CacheConfig(num_layers=2, num_kv_heads=2, head_dim=32, kv_format="fp8", block_size=8,
                      num_blocks=32, high_precision_layers=0, model_id="toy", key_centring=True)

    def cache(scale=None, centre=None):
        c = PagedCache(cfg, OffloadConfig(prefix_store="disk", prefix_dir=str(tmp_path / "p")))
        if scale is not None or centre is not None:
            c.configure_layer(1, k_scale=scale, k_centre=centre)
        return c

    a = cache()
    assert a.seqs.namespace == cfg.fingerprint  # the default transform keeps the plain keys
    ToyLM(a).generate(prompt, 2)
    assert cache().add_sequence(prompt).hit_tokens == 40
    b = cache(scale=2.0)
    assert b.seqs.namespace != cfg.fingerprint
    assert b.add_sequence(prompt).hit_tokens == 0
    ToyLM(cache(scale=2.0)).generate(prompt, 2)
    assert cache(scale=2.0).add_sequence(prompt).hit_tokens == 40  # the same transform shares
    assert cache(centre=torch.full((2, 32), 0.5)).add_sequence(prompt).hit_tokens == 0
    assert cache(scale=3.0).add_sequence(prompt).hit_tokens == 0
