"""PagedCache: config, memory accounting, prefix caching, COW, store/gather, failures, stats."""

from __future__ import annotations

import pytest
import torch

from pagedkv.cache import CacheConfig, PagedCache, slots_from_block_table
from pagedkv.codecs import CODECS
from pagedkv.codecs.reference import roundtrip
from pagedkv.errors import CacheFull, ConfigError, InvalidInput, UnknownSequence
from pagedkv.formats import parse_format


def _cfg(**kw):
    base = dict(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, num_blocks=16,
                high_precision_layers=0)
    base.update(kw)
    return CacheConfig(**base)


def _kv(n, h=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, h, d, generator=g), torch.randn(n, h, d, generator=g)


# ---- config ---------------------------------------------------------------------------------
def test_config_parses_formats_once_and_applies_high_precision_layers():
    plain = CacheConfig(num_layers=8, num_kv_heads=2, head_dim=32, kv_format="turbo3", num_blocks=4)
    assert plain.num_high_precision_layers == 0  # a name means one thing: turbo3 everywhere
    assert CacheConfig(num_layers=8, num_kv_heads=2, head_dim=32, kv_format="turbo3+hp2",
                       num_blocks=4).num_high_precision_layers == 2
    with pytest.raises(ConfigError, match="names its high-precision layers"):
        CacheConfig(num_layers=8, num_kv_heads=2, head_dim=32, kv_format="turbo3+hp",
                    high_precision_layers=1, num_blocks=4)
    cfg = CacheConfig(num_layers=8, num_kv_heads=2, head_dim=32, kv_format="turbo3+hp", num_blocks=4)
    assert cfg.num_high_precision_layers == 3  # auto: 3-bit K
    names = [f.name for f in cfg.layer_formats]
    assert names == ["q8_0"] * 3 + ["turbo3"] * 2 + ["q8_0"] * 3  # default hp_format q8_0
    assert all(not isinstance(f, str) for f in cfg.layer_formats)
    assert CacheConfig(num_layers=8, num_kv_heads=2, head_dim=32, kv_format="fp8+hp",
                       num_blocks=4).num_high_precision_layers == 0
    two = CacheConfig(num_layers=8, num_kv_heads=2, head_dim=32, kv_format="turbo2",
                      high_precision_layers=2, hp_format="turbo8", num_blocks=4)
    assert [f.name for f in two.layer_formats].count("turbo8") == 4
    # hp never lowers precision: a bf16 K stays bf16 under an fp8 hp format
    mixed = CacheConfig(num_layers=2, num_kv_heads=1, head_dim=16, kv_format="bf16k_turbo2v",
                        high_precision_layers=1, hp_format="fp8", num_blocks=4)
    assert mixed.layer_formats[0].name == "bf16k_fp8v"


def test_config_per_layer_dims_formats_and_windows():
    cfg = CacheConfig(num_layers=3, num_kv_heads=1, head_dim=16,
                      layer_dims=[(4, 32), (1, 64), (2, 32)],
                      kv_format=["turbo4", parse_format("bf16k_turbo3v"), "q8_0k_fp8v"],
                      sliding_window=[None, 128, None], high_precision_layers=0, num_blocks=3)
    assert [(s.num_kv_heads, s.head_dim) for s in cfg.layers] == [(4, 32), (1, 64), (2, 32)]
    assert [f.name for f in cfg.layer_formats] == ["turbo4", "bf16k_turbo3v", "q8_0k_fp8v"]
    assert [s.sliding_window for s in cfg.layers] == [None, 128, None]
    cache = PagedCache(cfg)
    assert [tuple(pl.k_pool.shape) for pl in cache.layers] == [
        (3, s.k_block_bytes) for s in cfg.layers]
    assert cache.layers[1].v_pool.shape[1] != cache.layers[1].k_pool.shape[1]  # own strides


@pytest.mark.parametrize("kw, match", [
    (dict(num_layers=0), "num_layers"),
    (dict(kv_format="turbo9"), "unknown KV format"),
    (dict(kv_format=["bf16"]), "kv_format has 1"),
    (dict(kv_format="q4_0"), "multiple of 32"),
    (dict(layer_dims=[(2, 16)]), "layer_dims has 1"),
    (dict(high_precision_layers=-1), "high_precision_layers"),
    (dict(high_precision_layers="most"), "high_precision_layers"),
    (dict(num_blocks=None), "exactly one"),
    (dict(memory_bytes=100), "exactly one"),
    (dict(num_blocks=None, memory_bytes=100), "less than one block"),
    (dict(sliding_window=0), "sliding_window"),
    (dict(device="gpu9"), "torch device"),
    (dict(block_size=0), "block_size"),
])
def test_config_rejects_bad_values(kw, match):
    with pytest.raises(ConfigError, match=match):
        _cfg(**kw)


def test_memory_budget_and_pool_bytes_match_the_catalogue():
    cfg = CacheConfig(num_layers=3, num_kv_heads=2, head_dim=32, block_size=16,
                      kv_format=["turbo3", "bf16k_turbo4v", "q8_0k_fp8v"],
                      high_precision_layers=0, memory_bytes=1_000_000)
    per_block = 0
    for f in cfg.layer_formats:
        per_block += f.k.block_bytes(16, 2, 32) + f.v.block_bytes(16, 2, 32)
    assert cfg.bytes_per_block == per_block
    assert cfg.total_blocks == 1_000_000 // per_block
    cache = PagedCache(cfg)
    st = cache.stats()
    n = cfg.total_blocks
    for (kb, vb), f in zip(st.layer_bytes, cfg.layer_formats):
        assert kb == n * f.k.block_bytes(16, 2, 32) and vb == n * f.v.block_bytes(16, 2, 32)
    assert st.total_bytes == n * per_block <= 1_000_000
    # turbo3 K: 3 bits data + one E4M3 scale per 16 -> 3.5 bits per element
    assert st.layer_bytes[0][0] == n * 16 * 2 * 32 * 3.5 / 8
    assert st.blocks_free == n and st.blocks_used == st.blocks_cached == 0


# ---- store / gather ---------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "turbo3", "bf16k_turbo2v", "q8_0k_q4_0v", "turbo8"])
def test_store_gather_roundtrip_every_side(fmt):
    d = 32
    cache = PagedCache(_cfg(kv_format=fmt, head_dim=d))
    k, v = _kv(7, d=d)
    new = cache.add_sequence(list(range(7)))
    for layer in range(2):
        cache.store(layer, k, v, new.slot_mapping)
    f = parse_format(fmt)
    got_k, got_v = cache.gather(1, new.seq_id)
    assert got_k.dtype == torch.float32 and got_k.shape == (7, 2, d)
    assert torch.allclose(got_k, roundtrip(f.k, k), atol=1e-6, rtol=0)
    assert torch.allclose(got_v, roundtrip(f.v, v), atol=1e-6, rtol=0)


def test_fp8_scale_and_key_centring_are_applied_and_undone():
    cache = PagedCache(_cfg(kv_format="fp8", key_centring=True))
    centre = torch.randn(2, 16) * 5
    cache.configure_layer(0, k_scale=0.01, v_scale=2.0, k_centre=centre)
    k, v = _kv(5)
    k = k * 0.5 + centre
    new = cache.add_sequence([1, 2, 3, 4, 5])
    cache.store(0, k, v, new.slot_mapping)
    got_k, got_v = cache.gather(0, new.seq_id)
    fp8 = CODECS["fp8"]
    assert torch.allclose(got_k, roundtrip(fp8, k - centre, 0.01) + centre, atol=1e-6)
    assert torch.allclose(got_v, roundtrip(fp8, v, 2.0), atol=1e-6)
    assert (got_k - k).abs().max() < 0.1  # the centred keys fit the small scale
    with pytest.raises(ConfigError, match="empty cache"):
        cache.configure_layer(0, k_scale=1.0)


@pytest.mark.parametrize("fmt", ["bf16", "turbo3", "q8_0k_q4_0v"])
def test_gather_undoes_the_whole_layer_transform(fmt):
    """gather returns keys and values in the model's basis: the ops store `k * k_mult - k_centre`
    and `v - v_centre`; the oracle is the reference round trip of exactly those stored values."""
    import dataclasses

    from pagedkv.ops.reference import store as ref_store

    d = 32
    cache = PagedCache(_cfg(kv_format=fmt, head_dim=d))
    g = torch.Generator().manual_seed(5)
    mult = torch.rand(2, d, generator=g) * 1.5 + 0.5
    kc, vc = torch.randn(2, d, generator=g), torch.randn(2, d, generator=g) * 3
    layers = list(cache.layers)
    layers[0] = dataclasses.replace(layers[0], k_mult=mult, k_centre=kc, v_centre=vc)
    cache.layers = tuple(layers)
    k, v = _kv(6, d=d)
    new = cache.add_sequence(list(range(6)))
    cache.store(0, k, v, new.slot_mapping)
    f = parse_format(fmt)
    got_k, got_v = cache.gather(0, new.seq_id)
    assert torch.allclose(got_k, (roundtrip(f.k, k * mult - kc) + kc) / mult, atol=1e-5, rtol=1e-5)
    assert torch.allclose(got_v, roundtrip(f.v, v - vc) + vc, atol=1e-5, rtol=1e-5)
    if fmt == "bf16":  # and that is the input, to bf16 rounding
        assert torch.allclose(got_k, k, atol=0.05, rtol=0.02)
    twin = dataclasses.replace(layers[0], k_pool=torch.zeros_like(layers[0].k_pool),
                               v_pool=torch.zeros_like(layers[0].v_pool))
    ref_store(twin, k, v, new.slot_mapping)  # the reference store wrote the same bytes
    assert torch.equal(twin.k_pool, cache.layers[0].k_pool)
    assert torch.equal(twin.v_pool, cache.layers[0].v_pool)


# ---- prefix caching -------------------------------------------------------------------------
def test_shared_prefix_reuses_full_blocks_with_identical_kv():
    cache = PagedCache(_cfg(kv_format=["bf16", "turbo4k3v"], num_blocks=12))
    prompt = list(range(100, 111))  # 11 tokens: 2 full blocks + 3
    k, v = _kv(11)
    a = cache.add_sequence(prompt)
    for layer in range(2):
        cache.store(layer, k, v, a.slot_mapping)
    cache.commit(a.seq_id)
    other = prompt[:9] + [7, 7, 7]
    b = cache.add_sequence(other)
    assert b.hit_tokens == 8 and b.slot_mapping.shape == (4,)
    assert cache.seqs.table(b.seq_id)[:2] == cache.seqs.table(a.seq_id)[:2]
    k2, v2 = _kv(4, seed=1)
    for layer in range(2):
        cache.store(layer, k2, v2, b.slot_mapping)
    cache.commit(b.seq_id)
    for layer in range(2):
        ka, va = cache.gather(layer, a.seq_id)
        kb, vb = cache.gather(layer, b.seq_id)
        assert torch.equal(ka[:8], kb[:8]) and torch.equal(va[:8], vb[:8])
    # a different salt (tenant) sees none of it; the hit rate counts prompt tokens
    c = cache.add_sequence(prompt, salt="other-tenant")
    assert c.hit_tokens == 0
    st = cache.stats()
    assert st.prefix_hit_tokens == 8 and st.prefix_query_tokens == 11 + 12 + 11
    # after free, the blocks stay cached and still hit
    cache.free(a.seq_id)
    cache.free(b.seq_id)
    assert cache.stats().blocks_cached == 3  # a's 2 full blocks + b's third (full, committed)
    d = cache.add_sequence(prompt)
    assert d.hit_tokens == 8
    assert cache.reset_prefix_cache() == 1  # b's third block; a's two are held by d again
    e = cache.add_sequence(other)
    assert e.hit_tokens == 0  # every key is forgotten, also those of blocks in use


def test_uncommitted_blocks_are_never_hits():
    cache = PagedCache(_cfg())
    a = cache.add_sequence(list(range(9)))
    b = cache.add_sequence(list(range(9)))  # a's K/V not stored/committed yet
    assert b.hit_tokens == 0


def test_caches_of_different_formats_never_share_keys():
    one = PagedCache(_cfg(kv_format="bf16"))
    two = PagedCache(_cfg(kv_format="turbo3"))
    assert one.config.fingerprint != two.config.fingerprint
    assert one.config.fingerprint == PagedCache(_cfg(kv_format="bf16")).config.fingerprint


# ---- copy-on-write, rollback ----------------------------------------------------------------
def test_fork_copy_on_write_in_every_layer():
    cache = PagedCache(_cfg(kv_format=["bf16", "turbo3"], trace=True))
    k, v = _kv(6)
    a = cache.add_sequence(list(range(6)))
    for layer in range(2):
        cache.store(layer, k, v, a.slot_mapping)
    cache.commit(a.seq_id)
    b = cache.fork(a.seq_id)
    kx, vx = _kv(1, seed=5)
    ky, vy = _kv(1, seed=6)
    sb = cache.allocate(b, [42])
    sa = cache.allocate(a.seq_id, [43])
    assert sb.item() // 4 != sa.item() // 4  # b got its own copy of the shared block
    for layer in range(2):
        cache.store(layer, kx, vx, sb)
        cache.store(layer, ky, vy, sa)
    f = cache.config.layer_formats[1]
    for layer, exp in ((0, lambda x: x.bfloat16().float()), (1, None)):
        ka, _ = cache.gather(layer, a.seq_id)
        kb, _ = cache.gather(layer, b)
        assert torch.equal(ka[:6], kb[:6])
        ref = (lambda x: roundtrip(f.k, x)) if exp is None else exp
        assert torch.allclose(ka[6], ref(ky)[0], atol=1e-6) and torch.allclose(kb[6], ref(kx)[0], atol=1e-6)
    assert [e.kind for e in cache.trace if e.kind == "copy"] == ["copy"]


def test_pop_rolls_back_and_frees_blocks():
    cache = PagedCache(_cfg())
    a = cache.add_sequence(list(range(10)))
    used = cache.stats().blocks_used
    cache.pop(a.seq_id, 3)
    assert cache.seq_len(a.seq_id) == 7 and cache.stats().blocks_used == used - 1
    assert cache.tokens(a.seq_id) == list(range(7))
    cache.reset(a.seq_id)
    assert cache.seq_len(a.seq_id) == 0 and cache.stats().blocks_used == 0


# ---- failures -------------------------------------------------------------------------------
def test_failures_raise_before_any_change():
    cache = PagedCache(_cfg(num_blocks=4))
    k, v = _kv(10)
    a = cache.add_sequence(list(range(10)))
    for layer in range(2):
        cache.store(layer, k, v, a.slot_mapping)
    cache.commit(a.seq_id)
    before = [cache.gather(layer, a.seq_id) for layer in range(2)]
    snap = (cache.tokens(a.seq_id), cache.stats())
    with pytest.raises(CacheFull):
        cache.add_sequence(list(range(50, 59)))
    with pytest.raises(CacheFull):
        cache.allocate(a.seq_id, list(range(7)))
    with pytest.raises(UnknownSequence, match="unknown sequence 'nope'"):
        cache.allocate("nope", [1])
    with pytest.raises(UnknownSequence):
        cache.gather(0, "nope")
    with pytest.raises(ConfigError, match="layer"):
        cache.store(2, k[:1], v[:1], a.slot_mapping[:1])
    with pytest.raises(ConfigError, match="layer"):
        cache.gather(-1, a.seq_id)
    free_slot = torch.tensor([3 * 4 + 1])  # block 3 is not held by anyone
    with pytest.raises(InvalidInput, match="not allocated"):
        cache.store(0, k[:1], v[:1], free_slot)
    past_end = torch.tensor([cache.seqs.table(a.seq_id)[2] * 4 + 2])  # position 10: not allocated
    with pytest.raises(InvalidInput, match="not allocated"):
        cache.store(0, k[:1], v[:1], past_end)
    with pytest.raises(InvalidInput, match="committed prefix block"):
        cache.store(0, k, v, a.slot_mapping)  # positions 0-7 sit in keyed (shareable) blocks
    with pytest.raises(InvalidInput, match="outside the pool"):
        cache.store(0, k[:1], v[:1], torch.tensor([999]))
    with pytest.raises(InvalidInput, match="twice"):
        cache.store(0, k[:2], v[:2], a.slot_mapping[-1:].repeat(2))
    with pytest.raises(InvalidInput, match="int64"):
        cache.store(0, k[:1], v[:1], a.slot_mapping[:1].int())
    with pytest.raises(InvalidInput):
        cache.store(0, k[:2], v[:2], a.slot_mapping[-1:])  # shape mismatch (ops validation)
    assert (cache.tokens(a.seq_id), cache.stats()) == snap
    for layer in range(2):
        got = cache.gather(layer, a.seq_id)
        assert torch.equal(got[0], before[layer][0]) and torch.equal(got[1], before[layer][1])


# ---- tensors --------------------------------------------------------------------------------
def test_step_tensors_and_slot_helper_agree():
    cache = PagedCache(_cfg(num_blocks=32))
    ids = [cache.add_sequence(list(range(n))).seq_id for n in (3, 8, 13)]
    cache.commit(ids)
    step = cache.step(ids, [[1], [2, 3], [4]])
    assert step.block_tables.dtype == torch.int32 and step.slot_mapping.dtype == torch.int64
    assert step.seq_lens.tolist() == [4, 10, 14]
    assert step.query_start_loc.tolist() == [0, 1, 3, 4]
    assert step.block_tables.shape == (3, 4)
    rows = torch.tensor([0, 1, 1, 2])
    pos = torch.tensor([3, 8, 9, 13])
    assert torch.equal(slots_from_block_table(step.block_tables, pos, 4, rows), step.slot_mapping)
    one = slots_from_block_table(step.block_tables[2], torch.arange(14), 4)
    assert torch.equal(one, cache.slot_mapping(ids[2]))
    with pytest.raises(InvalidInput):
        slots_from_block_table(step.block_tables[0], torch.tensor([16]), 4)
    assert torch.equal(cache.block_tables(ids), step.block_tables)
    assert torch.equal(cache.seq_lens(ids), step.seq_lens)


def test_trace_is_off_by_default():
    assert PagedCache(_cfg()).trace is None


def test_slot_check_is_redone_after_rollback():
    cache = PagedCache(_cfg())
    a = cache.add_sequence(list(range(6)))
    k, v = _kv(6)
    cache.store(0, k, v, a.slot_mapping)  # checked once, remembered for the other layers
    cache.store(1, k, v, a.slot_mapping)
    cache.pop(a.seq_id, 2)
    with pytest.raises(InvalidInput, match="not allocated"):
        cache.store(1, k, v, a.slot_mapping)  # positions 4, 5 were rolled back
    cache.store(1, k[:4], v[:4], a.slot_mapping[:4])
    cache.free(a.seq_id)
    with pytest.raises(InvalidInput, match="not allocated"):
        cache.store(0, k[:4], v[:4], a.slot_mapping[:4])
