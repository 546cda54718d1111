"""MLA in the engine loop (issue 17): `PagedCache(CacheConfig(latent=...))` driven directly, as an
engine does (add_sequence with prefix hits, step, commit, fork, pop, the offload tiers), running
a tiny random-weight DeepSeek-V3 model through `integrations.deepseek_engine.engine_forward`.

Oracles: the drop-in `PagedLatentCache` (the same stored bytes and the same ops, one sequence at
a time: only fp32 summation order differs), transformers' own eager attention over bf16-rounded
latents (what a bf16 cache stores), the reference latent ops (`backend="reference"`), and a
fresh cache that computed every token (for prefix hits, forks and pops). A resident cap must
not change one bit.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers.mla import RoundingCache, enabled_model  # noqa: E402
from pagedkv.cache import CacheConfig, PagedCache  # noqa: E402
from pagedkv.cache.latent import LatentLayout  # noqa: E402
from pagedkv.errors import ConfigError, InvalidInput  # noqa: E402
from pagedkv.integrations.deepseek import PagedLatentCache, disable, enable  # noqa: E402
from pagedkv.integrations.deepseek_engine import engine_forward, latent_config  # noqa: E402
from pagedkv.offload import MemoryTier, OffloadConfig  # noqa: E402
from pagedkv.ops import latent as latent_ops  # noqa: E402

BS = 4


model = pytest.fixture(scope="module", name="model")(enabled_model)


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _cache(model, fmt="turbo4", **kw) -> PagedCache:
    return PagedCache(latent_config(model, fmt, num_blocks=64, block_size=BS, model_id="tiny-mla"),
                      **kw)


def _prefill(model, c: PagedCache, tokens, **kw):
    """Admit `tokens`, run the tokens after the hit; (seq id, hit tokens, logits of those)."""
    new = c.add_sequence(tokens)
    logits = engine_forward(model, c, [new.seq_id], [tokens[new.hit_tokens:]], new, **kw)
    c.commit(new.seq_id)
    return new.seq_id, new.hit_tokens, logits


def _decode(model, c: PagedCache, sids, toks, **kw):
    """One packed decode step: token toks[b] for sequence sids[b]; logits [B, vocab]."""
    batch = c.step(sids, [[t] for t in toks])
    logits = engine_forward(model, c, sids, [[t] for t in toks], batch, **kw)
    c.commit(sids)
    return logits


def _engine_run(model, c, prompts, steps: int, **kw):
    """Prompts admitted one after another (each prefilled alone), then `steps` greedy decode
    steps of all of them packed. Returns per prompt (tokens, logits [len, vocab])."""
    sids, toks, outs = [], [], []
    for p in prompts:
        sid, _, lg = _prefill(model, c, p, **kw)
        sids.append(sid)
        toks.append(list(p))
        outs.append([lg])
    for _ in range(steps):
        nxt = [int(o[-1][-1].argmax()) for o in outs]
        lg = _decode(model, c, sids, nxt, **kw)
        for b, t in enumerate(nxt):
            toks[b].append(t)
            outs[b].append(lg[b:b + 1])
    return [(t, torch.cat(o)) for t, o in zip(toks, outs)]


@torch.no_grad()
def _drop_in(model, fmt, tokens, prompt_len):
    """The drop-in's logits for `tokens`: the prompt in one forward, then one token at a time."""
    d = PagedLatentCache(model, fmt, block_size=BS)
    ids = torch.tensor(tokens)[None]
    parts = [model(ids[:, :prompt_len], cache=d).logits[0]]
    parts += [model(ids[:, j:j + 1], cache=d).logits[0] for j in range(prompt_len, len(tokens))]
    return torch.cat(parts)


@torch.no_grad()
def _fresh(model, fmt, tokens, first=None):
    """Logits of every position of `tokens` from a cache that computed all of them (after
    fitting its fp8 scales to the prompt `first`, when given, whose blocks it then forgets)."""
    c = _cache(model, fmt)
    if first is not None:
        sid = _prefill(model, c, first)[0]
        c.free(sid)
        c.reset_prefix_cache()
    return _prefill(model, c, tokens)[2]


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "turbo4"])
@torch.no_grad()
def test_engine_loop_matches_the_drop_in_the_reference_ops_and_eager(model, fmt):
    prompts = [_prompt(1, 13), _prompt(2, 7)]  # ragged: one packed decode batch, no padding
    c = _cache(model, fmt)
    runs = _engine_run(model, c, prompts, steps=4)
    assert c.layers[0].spec.name == ("fp8+q8_0rope" if fmt == "fp8" else fmt)
    scale = max(float(lg.abs().max()) for _, lg in runs)
    for b, (toks, lg) in enumerate(runs):
        # the drop-in: same bytes, same ops (fp8 scales are fitted to the first chunk stored,
        # which is prompt 0 for both front doors; prompt 1's drop-in fits its own)
        if fmt != "fp8" or b == 0:
            torch.testing.assert_close(lg, _drop_in(model, fmt, toks, len(prompts[b])),
                                       atol=1e-4 * scale, rtol=0)
        if fmt == "bf16":  # transformers' eager attention over the same bf16-rounded latents
            disable(model)
            try:
                rounded = model(torch.tensor(toks)[None], cache=RoundingCache(config=model.config))
            finally:
                enable(model)
            torch.testing.assert_close(lg, rounded.logits[0], atol=2e-3 * scale, rtol=0)
    # the reference latent ops: fp32 rounding only while both caches hold the same pages. An fp32
    # rounding difference upstream can move a stored value across a rounding boundary of the
    # codec (one bf16 ulp flip in a deeper layer, seen on an AVX-512 build), after which the two
    # runs differ by what a bf16 cache's rounding moves: the eager comparison's allowance above.
    rc = _cache(model, fmt)
    ref = _engine_run(model, rc, prompts, steps=4, backend="reference")
    # (once a value flipped, the layers after it see inputs ~1e-4 apart, so a few more flip: 53
    # of 16104 bytes there; a wrong store or attention would differ in most of them)
    flipped = sum(int((a.pool != b.pool).sum()) for a, b in zip(c.layers, rc.layers))
    written = sum(int((a.pool != 0).sum()) for a in c.layers)
    assert flipped <= 0.01 * written, f"{flipped} of {written} stored bytes differ from the reference ops' store"
    for (toks, lg), (rtoks, rlg) in zip(runs, ref):
        assert toks == rtoks
        torch.testing.assert_close(lg, rlg, atol=(1e-4 if flipped == 0 else 2e-3) * scale, rtol=0)


@torch.no_grad()
def test_prefix_hit_fork_and_pop_on_latent_layers(model):
    fmt = "turbo4"
    c = _cache(model, fmt)
    first = _prompt(3, 14)
    _prefill(model, c, first)
    second = first[:12] + _prompt(4, 5)
    sid, hit, lg = _prefill(model, c, second)
    assert hit == 12  # three whole blocks shared
    used = c.stats().blocks_used
    fresh = _fresh(model, fmt, second)
    scale = float(fresh.abs().max())
    torch.testing.assert_close(lg, fresh[hit:], atol=1e-4 * scale, rtol=0)

    fork = c.fork(sid)
    assert c.stats().blocks_used == used  # the fork shares every block
    out = _decode(model, c, [sid, fork], [5, 9])  # the shared last block is copied on write
    for row, tok in zip(out, (5, 9)):
        torch.testing.assert_close(row, _fresh(model, fmt, second + [tok])[-1], atol=1e-4 * scale,
                                   rtol=0)

    for t in (11, 12, 13):
        _decode(model, c, [fork], [t])
    c.pop(fork, 3)  # speculative rollback: back to second + [9]
    assert c.tokens(fork) == second + [9]
    row = _decode(model, c, [fork], [77])[0]
    torch.testing.assert_close(row, _fresh(model, fmt, second + [9, 77])[-1], atol=1e-4 * scale,
                               rtol=0)
    latent, rope = c.gather_latent(0, fork)
    assert latent.shape == (len(second) + 2, 64) and rope.shape == (len(second) + 2, 32)
    c.core.check_invariants()


@pytest.mark.parametrize("fmt", ["turbo4", "fp8"])
@torch.no_grad()
def test_resident_cap_changes_no_bit_and_the_prefix_store_serves_latent_blocks(model, fmt):
    prompts = [_prompt(5, 15), _prompt(6, 10)]
    plain = _engine_run(model, _cache(model, fmt), prompts, steps=3)
    capped = _cache(model, fmt, offload=OffloadConfig(resident_blocks_per_seq=1, swap="memory"))
    runs = _engine_run(model, capped, prompts, steps=3)
    assert capped.offload_stats()["swapped_blocks"] > 0
    for (t, lg), (pt, plg) in zip(runs, plain):
        assert t == pt and torch.equal(lg, plg)
    capped.close()

    store = MemoryTier()
    a = _cache(model, fmt, prefix_tier=store)
    _prefill(model, a, prompts[0])
    b = _cache(model, fmt, prefix_tier=store)  # b adopts a's fp8 scales (fp8) before its lookup
    _, hit, lg = _prefill(model, b, prompts[0][:12] + [1, 2])
    assert hit == 12 and b.tier_hit_tokens == 12  # loaded from the store, not computed
    assert _scales(b) == _scales(a)
    full = _fresh(model, fmt, prompts[0][:12] + [1, 2], first=prompts[0])
    torch.testing.assert_close(lg, full[12:], atol=1e-4 * float(full.abs().max()), rtol=0)


def _scales(c: PagedCache) -> list:
    return [(float(pl.latent_scale), float(pl.rope_scale)) for pl in c.layers]


@torch.no_grad()
def test_fp8_scales_travel_with_the_disk_store_and_conflicts_miss(model, tmp_path):
    """A second cache on the disk store (the scales' record and the blocks, as a second process
    reads them) adopts the publisher's fp8 scales: its hit gives what recomputing with those
    scales gives. A cache that fitted its own scales first keeps them: the store misses."""
    p, other = _prompt(11, 14), _prompt(12, 9)
    off = OffloadConfig(prefix_store="disk", prefix_dir=str(tmp_path / "prefix"))
    a, c = _cache(model, "fp8", offload=off), _cache(model, "fp8", offload=off)
    # a and c run at once: both find nothing stored, both fit their own scales, a commits (and
    # publishes its scales) first
    new_a, new_c = a.add_sequence(p), c.add_sequence(other)
    engine_forward(model, a, [new_a.seq_id], [p], new_a)
    a.commit(new_a.seq_id)
    engine_forward(model, c, [new_c.seq_id], [other], new_c)
    c.commit(new_c.seq_id)
    a.close()
    b = _cache(model, "fp8", offload=off)
    _, hit, lg = _prefill(model, b, p[:12] + [3, 4, 5])
    assert hit == 12 and b.tier_hit_tokens == 12
    assert _scales(b) == _scales(a)
    full = _fresh(model, "fp8", p[:12] + [3, 4, 5], first=p)
    torch.testing.assert_close(lg, full[12:], atol=1e-4 * float(full.abs().max()), rtol=0)
    # recomputing with scales fitted to this prompt itself is only within the fp8 error
    own = _fresh(model, "fp8", p[:12] + [3, 4, 5])
    assert float((own[12:] - lg).abs().max()) > 0

    mine = _scales(c)
    assert mine != _scales(a)
    _, hit, lg = _prefill(model, c, p[:12] + [3, 4, 5])
    assert hit == 0 and c.tier_hit_tokens == 0 and _scales(c) == mine  # a clean miss
    ref = _fresh(model, "fp8", p[:12] + [3, 4, 5], first=other)
    torch.testing.assert_close(lg, ref, atol=1e-4 * float(ref.abs().max()), rtol=0)


@torch.no_grad()
def test_bad_combinations_and_misuse_are_refused_before_any_change(model, monkeypatch):
    lat = LatentLayout(64, 32)
    kw = dict(num_layers=2, num_kv_heads=1, head_dim=96, num_blocks=8, block_size=BS, latent=lat)
    with pytest.raises(ConfigError, match="key_centring"):
        CacheConfig(key_centring=True, **kw)
    with pytest.raises(ConfigError, match="recent window"):
        CacheConfig(recent_window=8, **kw)
    c = PagedCache(CacheConfig(kv_format="fp8", **kw))
    new = c.add_sequence([1, 2, 3, 4, 5])
    before = [pl.pool.clone() for pl in c.layers]
    with pytest.raises(ConfigError, match="latent"):  # the K/V methods name the latent ones
        c.store(0, torch.randn(5, 1, 96), torch.randn(5, 1, 96), new)
    with pytest.raises(ConfigError, match="latent"):
        c.configure_layer(0, k_scale=2.0)
    with pytest.raises(InvalidInput):  # a NaN row: nothing written, the scales not fitted
        c.store_latent(0, torch.full((5, 64), float("nan")), torch.randn(5, 32), new)
    with pytest.raises(InvalidInput, match="rope"):
        c.store_latent(0, torch.randn(5, 64), torch.randn(5, 31), new)
    assert all(torch.equal(a, pl.pool) for a, pl in zip(before, c.layers))
    assert float(c.layers[0].latent_scale) == 1.0
    # the refusals fixed nothing: the first good store fits the scales a fresh cache fits, and
    # encodes once (one store per pool section: latent, rope)
    good = torch.randn(5, 64) * 3, torch.randn(5, 32)
    fresh = PagedCache(CacheConfig(kv_format="fp8", **kw))
    calls = []
    real = latent_ops.api.store
    monkeypatch.setattr(latent_ops.api, "store", lambda *a, **k: calls.append(1) or real(*a, **k))
    fresh.store_latent(0, *good, fresh.add_sequence([1, 2, 3, 4, 5]))
    c.store_latent(0, *good, new)
    monkeypatch.undo()
    assert len(calls) == 4  # two first stores
    assert float(c.layers[0].latent_scale) == float(fresh.layers[0].latent_scale) != 1.0
    assert torch.equal(c.gather_latent(0, new.seq_id)[0], fresh.gather_latent(0, 0)[0])
    kv = PagedCache(CacheConfig(num_layers=1, num_kv_heads=1, head_dim=64, num_blocks=8))
    with pytest.raises(ConfigError, match="K/V"):
        kv.store_latent(0, torch.randn(1, 64), torch.randn(1, 32), kv.add_sequence([1]))
    disable(model)
    try:
        c2 = _cache(model)
        with pytest.raises(ConfigError, match="enable"):
            _prefill(model, c2, [1, 2, 3])
    finally:
        enable(model)


@torch.no_grad()
def test_the_latent_drop_in_gets_the_tiers_prefix_hits_and_crop(model):
    """`PagedLatentCache(..., offload=...)`: the same block manager, tiers and record members as
    the engine: a resident cap of one block gives the uncapped tokens; `begin` shares a prompt's
    whole blocks from memory and, in a fresh cache, from the prefix store (same tokens as a
    cache that computed them); after a crop into a swapped block, `generate` gives the same
    tokens again."""
    ids1 = torch.tensor([_prompt(7, 14)])
    ids2 = torch.tensor([ids1[0, :12].tolist() + _prompt(8, 4)])
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    gen = lambda ids, c, **k: model.generate(ids, attention_mask=torch.ones_like(ids), cache=c,
                                             **dict(kw, **k))
    plain = [gen(ids, PagedLatentCache(model, "turbo4", block_size=BS)) for ids in (ids1, ids2)]
    store = MemoryTier()
    off = OffloadConfig(resident_blocks_per_seq=1, swap="memory")
    capped = PagedLatentCache(model, "turbo4", block_size=BS, offload=off, prefix_tier=store)
    assert gen(ids1, capped).tolist() == plain[0].tolist()
    assert capped.offload_stats()["swapped_blocks"] > 0
    assert capped.begin(ids2) == 12  # three blocks from memory
    assert gen(ids2, capped).tolist() == plain[1].tolist()
    assert capped.offload_stats()["prefix"]["blocks_published"] > 0
    ins = capped.offload_stats()["swap"]["swap_ins"]
    capped.crop(-6)  # to 15 tokens: block 3, swapped out, is the new partly filled last one
    assert capped.offload_stats()["swap"]["swap_ins"] > ins
    assert capped.get_seq_length() == 15 < ids2.shape[1]  # holds a prefix of ids2 now
    assert gen(ids2, capped).tolist() == plain[1].tolist()  # computes only ids2[:, 15:], then on
    capped.core.check_invariants()
    capped.close()

    fresh = PagedLatentCache(model, "turbo4", block_size=BS, offload=OffloadConfig(), prefix_tier=store)
    assert fresh.begin(ids2) == 12 and fresh.offload_stats()["prefix"]["blocks_loaded"] == 3
    assert gen(ids2, fresh).tolist() == plain[1].tolist()


@torch.no_grad()
def test_latent_layers_in_a_sliding_group_release_blocks_and_change_no_output(model):
    """Latent pools in a sliding block group (window 6 for layers 1 and 2; the model attends
    with that window in those layers): window reclaim, growth and compaction act on the latent
    pools; the outputs equal those of the same windows with every token kept
    (`reclaim_sliding=False`, one group), bit for bit."""
    windows = [None, 6, 6]
    runs, held = {}, {}
    for reclaim in (True, False):
        c = PagedCache(latent_config(model, "turbo4", num_blocks=64, block_size=BS,
                                     sliding_window=windows, reclaim_sliding=reclaim))
        runs[reclaim] = _engine_run(model, c, [_prompt(9, 70), _prompt(10, 5)], steps=8)
        groups = c.stats().groups
        held[reclaim] = [g.blocks_used for g in groups]
        if reclaim:
            assert [g.window for g in groups] == [None, 6]
            # the 70-token prefill grew the sliding pools past their 16 blocks; once the
            # window released most of them the pools were compacted (blocks moved, then cut)
            assert c.layers[1].num_blocks == groups[1].num_blocks < -(-70 // BS)
            c.core.check_invariants()
    for (t, lg), (pt, plg) in zip(runs[True], runs[False]):
        assert t == pt and torch.equal(lg, plg)
    # each sequence keeps its last 6 positions (+ the block being written) in the sliding group
    assert held[True][1] <= 2 * (-(-6 // BS) + 1) < held[False][0]


@torch.no_grad()
def test_engine_forward_checks_enable_without_walking_the_modules(model):
    """`engine_forward` checks the modules `enable` noted instead of walking the module tree on
    every call; the error for a model not enabled stays, also after `disable`, and a model
    enabled through a submodule is found (by one walk, then noted)."""
    walks = []
    real = type(model).modules

    def walk(self=model):
        walks.append(1)
        return real(self)

    prompt = _prompt(13, 6)
    ref = _fresh(model, "bf16", prompt)
    model.__dict__["modules"] = walk  # counts every model.modules() walk from here on
    try:
        for _ in range(2):
            torch.testing.assert_close(_fresh(model, "bf16", prompt), ref, atol=0, rtol=0)
        assert walks == []
        disable(model)
        with pytest.raises(ConfigError, match="enable"):
            _prefill(model, _cache(model), prompt)
        enable(model.model)  # the decoder only: nothing noted on the causal-LM wrapper
        walks.clear()
        for _ in range(2):
            torch.testing.assert_close(_fresh(model, "bf16", prompt), ref, atol=0, rtol=0)
        assert len(walks) == 1
        disable(model.model)  # the wrapper's note is stale now: the error again
        with pytest.raises(ConfigError, match="enable"):
            _prefill(model, _cache(model), prompt)
    finally:
        del model.__dict__["modules"]
        enable(model)
