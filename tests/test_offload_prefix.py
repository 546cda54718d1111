"""The shared prefix store on the disk tier: a second cache loads stored blocks instead of
recomputing them, only when model, format, layout and salt match; faults cost hits, never data."""

from __future__ import annotations

import errno
import os
import warnings

import pytest
import torch

from pagedkv.cache import CacheConfig, PagedCache
from pagedkv.offload import OffloadConfig, TierWarning
from pagedkv.bench.toy import ToyLM

PROMPT = [(5 * i + 1) % 97 for i in range(45)]  # 45 tokens, block 8: 5 full blocks can hit


def _cfg(fmt="q8_0", model_id="toy", **kw):
    base = dict(num_layers=2, num_kv_heads=2, head_dim=32, kv_format=fmt, block_size=8,
                num_blocks=32, high_precision_layers=0, model_id=model_id)
    base.update(kw)
    return CacheConfig(**base)


def _cache(tmp_path, cfg=None, **kw):
    return PagedCache(cfg or _cfg(), OffloadConfig(prefix_store="disk",
                                                    prefix_dir=str(tmp_path / "prefix"), **kw))


@pytest.fixture(scope="module")
def baseline():
    return ToyLM(PagedCache(_cfg())).generate(PROMPT, 8)


def test_second_cache_loads_the_prefix_and_skips_its_prefill(tmp_path, baseline):
    a = _cache(tmp_path)
    ra = ToyLM(a).generate(PROMPT, 8)
    assert ra.hit_tokens == 0 and ra.tokens == baseline.tokens
    # 45 prompt + 7 decoded tokens committed: 6 full blocks published
    assert a.offload_stats()["prefix"]["blocks_published"] == 6
    b = _cache(tmp_path)
    rb = ToyLM(b).generate(PROMPT, 8)
    assert rb.hit_tokens == 40 and rb.prefilled == 5
    assert b.offload_stats()["tier_hit_tokens"] == 40
    assert b.offload_stats()["prefix"]["blocks_loaded"] == 5
    assert rb.tokens == baseline.tokens
    for x, y in zip(rb.outputs, baseline.outputs):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
    # the loaded blocks are byte-identical to the ones the first cache computed
    for layer in range(2):
        ka, va = a.gather(layer, ra.seq_id)
        kb, vb = b.gather(layer, rb.seq_id)
        assert torch.equal(ka[:40], kb[:40]) and torch.equal(va[:40], vb[:40])
    b.seqs.check_invariants()
    # a third sequence in b hits in memory (no tier read)
    reads = b.prefix.tier.stats.gets
    assert b.add_sequence(PROMPT).hit_tokens == 40 and b.prefix.tier.stats.gets == reads


@pytest.mark.parametrize("change", ["model_id", "format", "salt", "dims"])
def test_keys_separate_models_formats_layouts_and_tenants(tmp_path, change):
    a = _cache(tmp_path)
    ToyLM(a).generate(PROMPT, 2, salt="tenant-a")
    cfg = {"model_id": _cfg(model_id="other"), "format": _cfg(fmt="bf16"),
           "dims": _cfg(layer_dims=[(2, 32), (1, 32)])}.get(change, _cfg())
    b = _cache(tmp_path, cfg)
    new = b.add_sequence(PROMPT, salt="tenant-b" if change == "salt" else "tenant-a")
    assert new.hit_tokens == 0


def test_corrupted_stored_block_is_a_miss_and_is_recomputed(tmp_path, baseline):
    a = _cache(tmp_path)
    ToyLM(a).generate(PROMPT, 8)
    files = sorted((tmp_path / "prefix").rglob("pkv*"), key=lambda p: p.stat().st_mtime_ns)
    assert len(files) == 6
    # damage the third published block (tokens 16..23): hits stop before it
    raw = bytearray(files[2].read_bytes())
    raw[len(raw) // 2] ^= 0x40
    files[2].write_bytes(bytes(raw))
    files[4].write_bytes(files[4].read_bytes()[:100])  # and truncate a later one
    b = _cache(tmp_path)
    rb = ToyLM(b).generate(PROMPT, 8)
    assert rb.hit_tokens == 16 and rb.prefilled == 29
    assert rb.tokens == baseline.tokens
    b.seqs.check_invariants()
    # the damaged entry was deleted and b's publish replaced it: the next cache hits it all
    # (SET-NX publishing used to keep the bad value forever)
    assert b.offload_stats()["prefix"]["damaged_removed"] == 1
    # the truncated block 4, behind the miss, was never read: b's publish replaced it too (a
    # publish skips a value of the right size only; issue 28)
    c = _cache(tmp_path)
    rc = ToyLM(c).generate(PROMPT, 8)
    assert rc.hit_tokens == 40 and rc.tokens == baseline.tokens
    assert c.offload_stats()["prefix"]["damaged_removed"] == 0


def test_disk_full_while_publishing_warns_once_and_continues(tmp_path, baseline, monkeypatch):
    a = _cache(tmp_path)

    def full(*args, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ra = ToyLM(a).generate(PROMPT, 8)
    assert ra.tokens == baseline.tokens
    tier_warnings = [w for w in caught if issubclass(w.category, TierWarning)]
    assert len(tier_warnings) == 1 and "no space left" in str(tier_warnings[0].message)
    assert str(tier_warnings[0].message).count(a.prefix.tier.name) == 1  # named once, not twice
    assert a.offload_stats()["prefix"]["publish_failures"] == 6
    assert list((tmp_path / "prefix" / ".tmp").iterdir()) == []
    a.seqs.check_invariants()


def test_prefix_store_with_resident_cap(tmp_path, baseline):
    ToyLM(_cache(tmp_path)).generate(PROMPT, 8)
    b = _cache(tmp_path, resident_blocks_per_seq=1, cache_dir=str(tmp_path / "c"))
    rb = ToyLM(b).generate(PROMPT, 8)
    assert rb.hit_tokens == 40 and rb.tokens == baseline.tokens
    assert b.resident_blocks(rb.seq_id) == (1,)
    b.seqs.check_invariants()
    b.close()


def test_small_pool_loads_what_fits(tmp_path, baseline):
    ToyLM(_cache(tmp_path)).generate(PROMPT, 8)
    b = _cache(tmp_path, _cfg(num_blocks=8))
    rb = ToyLM(b).generate(PROMPT, 8)
    assert rb.hit_tokens == 40 and rb.tokens == baseline.tokens
    b.seqs.check_invariants()
