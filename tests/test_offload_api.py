"""PagedCache(offload=...) / tier configuration errors: clear, typed, raised before any state changes."""

from __future__ import annotations

import pytest
import torch

from pagedkv.cache import CacheConfig, PagedCache
from pagedkv.errors import CacheFull, ConfigError, UnknownSequence
from pagedkv.offload import OffloadConfig
from pagedkv.bench.toy import ToyLM


def _cfg(num_blocks=16):
    return CacheConfig(num_layers=1, num_kv_heads=1, head_dim=16, kv_format="bf16", block_size=4,
                       num_blocks=num_blocks, high_precision_layers=0)


def test_config_errors_name_the_value():
    with pytest.raises(ConfigError, match="OffloadConfig"):
        PagedCache(_cfg(), "disk")
    with pytest.raises(ConfigError, match="swap must be one of disk, memory"):
        OffloadConfig(swap="tape")
    with pytest.raises(ConfigError, match="prefetch"):
        OffloadConfig(prefetch=1)
    with pytest.raises(ConfigError, match="swap_limit_bytes"):
        OffloadConfig(swap_limit_bytes=-5)


def test_redis_tier_argument_errors():
    pytest.importorskip("redis")
    from pagedkv.offload import RedisTier

    with pytest.raises(ConfigError, match="redis url"):
        RedisTier("localhost:6379")
    with pytest.raises(ConfigError, match="timeout_s"):
        RedisTier("redis://127.0.0.1:1/0", timeout_s=0)
    with pytest.raises(ConfigError, match="ttl_s"):
        RedisTier("redis://127.0.0.1:1/0", ttl_s=1.5)


def _swapped_cache():
    tc = PagedCache(_cfg(), OffloadConfig(resident_blocks_per_seq=1, swap="memory"))
    run = ToyLM(tc).generate(list(range(9)), 1)  # 9 tokens: blocks 0, 1 swapped, 2 resident
    assert tc.swapped_blocks(run.seq_id) == ([0, 1],)
    return tc, run.seq_id


def test_swapped_positions_and_unknown_sequences():
    tc, sid = _swapped_cache()
    with pytest.raises(ConfigError, match=r"swapped-out blocks \[1\]"):
        tc.slot_mapping(sid, 5, 9)
    assert tc.slot_mapping(sid, 8, 9).shape == (1,)
    with pytest.raises(UnknownSequence):
        tc.swapped_blocks("nope")
    with pytest.raises(ConfigError):
        tc.pop(sid, 10)


def test_pop_into_a_swapped_block_with_no_room_raises_before_changing_anything():
    tc, sid = _swapped_cache()
    child = tc.fork(sid)  # shares the resident last block: popping it frees nothing
    filler = tc.add_sequence([50] * (4 * tc.pool.num_available))
    tc.commit(filler.seq_id)
    tc.enforce_cap(filler.seq_id)
    while tc.pool.num_available:  # take whatever the cap gave back
        tc.allocate(filler.seq_id, 4)
    before = (list(tc.seqs.table(child)), tc.seq_len(child), dict(tc.seqs.rec_refs), tc.swap.keys())
    with pytest.raises(CacheFull, match="swapped block 1"):
        tc.pop(child, 2)
    assert (list(tc.seqs.table(child)), tc.seq_len(child), dict(tc.seqs.rec_refs), tc.swap.keys()) == before
    tc.free(filler.seq_id)
    tc.pop(child, 2)  # now it fits: block 1 comes back as the partly filled last block
    assert tc.swapped_blocks(child) == ([0],)
    k, _ = tc.gather(0, child)
    k0, _ = tc.gather(0, sid)
    assert torch.equal(k, k0[:7])
    tc.seqs.check_invariants()
