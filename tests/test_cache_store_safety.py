"""A store may only write the slots of a sequence's pending (uncommitted) new tokens (issue 12
item 9): another live sequence's committed K/V in a partly filled block, and a stale slot tensor
after free + reuse, are refused before any byte is written."""

from __future__ import annotations

import pytest
import torch

from pagedkv.cache import CacheConfig, PagedCache
from pagedkv.errors import InvalidInput

BS = 4


def _cache(**kw):
    return PagedCache(CacheConfig(num_layers=2, num_kv_heads=1, head_dim=16, kv_format="turbo3",
                                  block_size=BS, num_blocks=8,
                                  high_precision_layers=0, **kw))


def _kv(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 16, generator=g), torch.randn(n, 1, 16, generator=g)


def _fill(c, new, seed):
    k, v = _kv(new.slot_mapping.shape[0], seed)
    for layer in range(2):
        c.store(layer, k, v, new)
    c.commit(new.seq_id)


def _bytes(c):
    return [(pl.k_pool.clone(), pl.v_pool.clone()) for pl in c.layers]


def _same(a, b):
    return all(torch.equal(x, y) and torch.equal(p, q) for (x, p), (y, q) in zip(a, b))


def test_another_sequences_committed_slots_are_refused():
    c = _cache()
    a = c.add_sequence(list(range(6)))  # block 1 partly filled: positions 4, 5 committed
    _fill(c, a, 0)
    b = c.add_sequence(list(range(50, 53)))
    before = _bytes(c)
    k, v = _kv(1, 1)
    target = a.slot_mapping[5:6].clone()  # one of A's committed slots, in a block A still fills
    with pytest.raises(InvalidInput, match="not pending"):
        c.store(0, k, v, target)
    with pytest.raises(InvalidInput, match="not pending"):  # mixed into B's own slots
        c.store(0, *_kv(4, 2), torch.cat([b.slot_mapping, target]))
    assert _same(before, _bytes(c))  # A's bytes unchanged
    _fill(c, b, 3)  # B's own pending slots are fine
    # A's next token goes into its partly filled block: that slot is pending, the old ones not
    step = c.step([a.seq_id], [[6]])
    for layer in range(2):
        c.store(layer, *_kv(1, 4), step)
    with pytest.raises(InvalidInput, match="committed or popped"):  # after commit: stale
        c.commit(a.seq_id)
        c.store(0, *_kv(1, 4), step)


def test_a_stale_slot_tensor_after_free_and_reuse_is_refused():
    c = _cache()
    a = c.add_sequence(list(range(7)))
    c.free(a.seq_id)  # never stored
    b = c.add_sequence(list(range(30, 37)))  # takes the same blocks
    assert torch.equal(a.slot_mapping, b.slot_mapping)
    before = _bytes(c)
    with pytest.raises(InvalidInput, match="freed"):
        c.store(0, *_kv(7, 5), a)
    with pytest.raises(InvalidInput, match="freed"):
        c.store(0, *_kv(7, 5), a.slot_mapping)
    assert _same(before, _bytes(c))
    _fill(c, b, 6)
    # popped tokens: their handed-out slots go stale too
    step = c.step([b.seq_id], [[1, 2]])
    c.pop(b.seq_id, 2)
    before = _bytes(c)
    # (the popped positions' slots are past the fill: the allocation check refuses them first)
    with pytest.raises(InvalidInput, match="committed or popped|not allocated"):
        c.store(0, *_kv(2, 7), step)
    assert _same(before, _bytes(c))
    # a caller-built tensor of pending slots (here: slot_mapping of the new positions) works
    c.allocate(b.seq_id, [9])
    c.store(0, *_kv(1, 8), c.slot_mapping(b.seq_id, 7, 8))


def test_compaction_makes_earlier_slots_stale():
    c = PagedCache(CacheConfig(num_layers=2, num_kv_heads=1, head_dim=16, kv_format="turbo3",
                               block_size=BS, num_blocks=64, sliding_window=[None, 5],
                               high_precision_layers=0))
    a = c.add_sequence(list(range(100)))  # the window-5 group grows to 32 blocks
    _fill(c, a, 9)
    b = c.add_sequence([1, 2, 3])  # pending, in high blocks of the sliding group
    c.step([a.seq_id], [[7]])  # compacts the sliding group: b's blocks may move
    moved = c.handouts.moves[c.group_of(1)]
    assert moved == 1
    before = _bytes(c)
    # (where the pool also shrank below a moved slot, the range check refuses it first)
    with pytest.raises(InvalidInput, match="moved its blocks|outside the pool"):
        c.store(1, *_kv(3, 10), b)
    assert _same(before, _bytes(c))
    c.store(0, *_kv(3, 10), b)  # the global group did not move


def test_checks_off_skips_the_bookkeeping():
    c = _cache(check_slots=False)
    a = c.add_sequence(list(range(6)))
    _fill(c, a, 0)
    c.store(0, *_kv(1, 1), a.slot_mapping[5:6].clone())  # trusted caller: not checked
