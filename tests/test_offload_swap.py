"""Resident cap with swap: capped runs give bit-identical attention outputs and tokens.

The oracle is the same toy model on a plain PagedCache (no cap) calling the reference ops with
the cache's own block tables; the capped PagedCache must match it exactly (torch.equal), since
read-back restores the very bytes the attention would have read.
"""

from __future__ import annotations

import os

import pytest
import torch

from pagedkv.cache import CacheConfig, PagedCache
from pagedkv.errors import CacheFull, InvalidInput
from pagedkv.cache import PagedCache
from pagedkv.offload import OffloadConfig, SwapLost, TierWriteError
from pagedkv.offload.swapfile import SwapFileTier
from pagedkv.bench.toy import ToyLM
from pagedkv.ops import api as ops

PROMPT = [(7 * i + 3) % 97 for i in range(45)]


def _cfg(fmt="turbo3", **kw):
    base = dict(num_layers=3, num_kv_heads=2, head_dim=32, kv_format=fmt, block_size=8,
                num_blocks=48, high_precision_layers=0)
    base.update(kw)
    return CacheConfig(**base)


def _tiered(tmp_path, cfg, cap, **kw):
    return PagedCache(cfg, OffloadConfig(resident_blocks_per_seq=cap, cache_dir=str(tmp_path), **kw))


def _same(a, b):
    assert a.tokens == b.tokens
    assert len(a.outputs) == len(b.outputs)
    for i, (x, y) in enumerate(zip(a.outputs, b.outputs)):
        assert torch.equal(x, y), f"step {i}: max diff {(x - y).abs().max()}"


@pytest.mark.parametrize("fmt,cap,prefetch", [
    ("turbo3", 1, True),
    (["bf16", "bf16k_turbo3v", "q4_0"], 2, False),
    ("fp8", 3, True),
])
def test_capped_generation_is_bit_identical(tmp_path, fmt, cap, prefetch):
    cfg = _cfg(fmt)
    base = ToyLM(PagedCache(cfg)).generate(PROMPT, 24)
    with _tiered(tmp_path, cfg, cap, prefetch=prefetch) as tc:
        run = ToyLM(tc).generate(PROMPT, 24)
        _same(base, run)
        n_blocks = len(tc.seqs.table(run.seq_id))
        assert tc.resident_blocks(run.seq_id) == (max(cap, 1),)
        assert tc.swapped_blocks(run.seq_id) == (list(range(n_blocks - cap)),)
        tc.seqs.check_invariants()
        st = tc.offload_stats()["swap"]
        assert st["swap_outs"] == n_blocks - cap and st["sections_read"] > 0
        if prefetch:
            assert st["prefetch_hits"] > 0
        # swapped entries read as -1 so a direct op call fails loudly instead of misreading
        tables = tc.block_tables([run.seq_id])
        assert (tables[0, : n_blocks - cap] == -1).all()
        q = torch.randn(1, 4, 32)
        with pytest.raises(InvalidInput):
            ops.decode_attention(q, tc.layers[0], tables, tc.seq_lens([run.seq_id]), ToyLM(tc).params[0])
        # gather reads swapped blocks back too
        k, v = tc.gather(1, run.seq_id)
        assert k.shape[0] == len(PROMPT) + 23
        swap_dir = tc.swap.tier.root
        assert tc.swap.tier.path.stat().st_size >= len(tc.swap.tier) * tc.swap.tier.slot_bytes
    assert not swap_dir.exists()  # close() removed this cache's swap file and directory


def _batch_run(cache, steps=12):
    """Two prompts prefilled one by one, then decoded together in one batch per step."""
    m = ToyLM(cache, seed=3)
    prompts = [PROMPT[:30], PROMPT[5:42]]
    ids, toks, outs = [], [], []
    for p in prompts:
        new = cache.add_sequence(p)
        logits, o = m.forward(p[new.hit_tokens:], [new.seq_id], new.slot_mapping,
                              torch.tensor([0, len(p) - new.hit_tokens], dtype=torch.int32))
        cache.commit(new.seq_id)
        ids.append(new.seq_id)
        toks.append(int(logits[-1].argmax()))
    for _ in range(steps):
        batch = cache.step(ids, [[t] for t in toks])
        logits, o = m.forward(toks, ids, batch.slot_mapping, None)
        cache.commit(ids)
        toks = [int(x) for x in logits.argmax(-1)]
        outs.append(o.clone())
    return ids, toks, outs


def test_batched_decode_with_shared_prefix_is_bit_identical(tmp_path):
    cfg = _cfg("turbo3")
    _, t0, o0 = _batch_run(PagedCache(cfg))
    with _tiered(tmp_path, cfg, 2) as tc:
        ids, t1, o1 = _batch_run(tc)
        assert t0 == t1 and all(torch.equal(a, b) for a, b in zip(o0, o1))
        assert all(tc.resident_blocks(i) == (2,) for i in ids)
        tc.seqs.check_invariants()


def test_fork_pop_free_with_swapped_blocks(tmp_path):
    cfg = _cfg("turbo3")

    def scenario(cache):
        m = ToyLM(cache, seed=1)
        run = m.generate(PROMPT, 10)  # 54 tokens: blocks 0..6
        sid = run.seq_id
        child = cache.fork(sid)
        cache.pop(child, 13)  # 41 tokens: block 5 becomes the partly filled last block
        outs = []
        tok = {sid: run.tokens[-1], child: 5}
        for _ in range(6):
            ids = [sid, child]
            batch = cache.step(ids, [[tok[i]] for i in ids])
            logits, o = m.forward([tok[i] for i in ids], ids, batch.slot_mapping, None)
            cache.commit(ids)
            tok = {i: int(x) for i, x in zip(ids, logits.argmax(-1))}
            outs.append(o.clone())
        return cache, sid, child, outs

    _, _, _, want = scenario(PagedCache(cfg))
    tc, sid, child, got = scenario(_tiered(tmp_path, cfg, 1))
    try:
        assert all(torch.equal(a, b) for a, b in zip(want, got))
        tc.seqs.check_invariants()
        assert tc.offload_stats()["swap"]["swap_ins"] == 1
        tc.reset(child)
        tc.free(child)
        tc.free(sid)
        tc.seqs.check_invariants()
        assert tc.pool.num_used == 0
        assert tc.seqs.rec_refs == {} and len(tc.swap.tier) == 0  # every record deleted
    finally:
        tc.close()


def test_swap_write_failure_keeps_blocks_resident_and_loses_nothing(tmp_path, monkeypatch):
    cfg = _cfg("turbo3")
    base = ToyLM(PagedCache(cfg)).generate(PROMPT, 16)
    tc = _tiered(tmp_path, cfg, 1)
    m = ToyLM(tc)
    real_put = SwapFileTier._put
    full = {"on": True}

    def put(self, key, value, if_absent):
        if full["on"]:
            raise TierWriteError(f"{self.name}: no space left on the device (simulated ENOSPC)")
        return real_put(self, key, value, if_absent)

    monkeypatch.setattr(SwapFileTier, "_put", put)
    new = tc.add_sequence(PROMPT)
    sid = new.seq_id
    logits, o = m.forward(PROMPT, [sid], new.slot_mapping, torch.tensor([0, len(PROMPT)], dtype=torch.int32))
    errors = 0
    try:
        tc.commit(sid)
    except TierWriteError as exc:
        errors += 1
        assert "no space left" in str(exc)
    assert tc.seqs.committed(sid) == len(PROMPT)  # the commit itself took effect
    assert tc.swapped_blocks(sid) == ([],) and tc.resident_blocks(sid) == (6,)
    tc.seqs.check_invariants()
    toks, outs = [int(logits[-1].argmax())], [o[-1].clone()]
    for step in range(15):
        if step == 8:
            full["on"] = False  # space again: the next commit swaps the backlog out
        batch = tc.step([sid], [[toks[-1]]])
        logits, o = m.forward([toks[-1]], [sid], batch.slot_mapping, None)
        try:
            tc.commit(sid)
        except TierWriteError:
            errors += 1
        toks.append(int(logits[-1].argmax()))
        outs.append(o[-1].clone())
    assert errors == 9
    assert toks == base.tokens and all(torch.equal(a, b) for a, b in zip(base.outputs, outs))
    assert tc.resident_blocks(sid) == (1,)
    tc.seqs.check_invariants()
    tc.close()


def test_corrupted_swap_record_raises_swap_lost(tmp_path):
    cfg = _cfg("turbo3")
    tc = _tiered(tmp_path, cfg, 1, prefetch=False)
    m = ToyLM(tc)
    run = m.generate(PROMPT, 2)
    tier = tc.swap.tier
    keys = sorted(tier._slots, key=lambda k: tier._slots[k][0])
    slot, n = tier._slots[keys[0]]
    with open(tier.path, "r+b") as f:  # flip a byte inside the last layer's section of record 0
        f.seek(slot * tier.slot_bytes + n - 5)
        b = f.read(1)
        f.seek(slot * tier.slot_bytes + n - 5)
        f.write(bytes([b[0] ^ 0xFF]))
    q = torch.randn(1, 4, 32)
    tc.decode_attention(0, q, [run.seq_id], m.params[0])  # layer 0 sections are intact
    # the error names the sequence and tokens whose K/V is gone, not an internal record key
    with pytest.raises(SwapLost, match=r"layer 2 .* sequence 0 \(tokens 0\.\.7\)") as err:
        tc.decode_attention(2, q, [run.seq_id], m.params[2])
    assert keys[0] not in str(err.value)
    tier.delete(keys[1])  # a record gone from the tier
    with pytest.raises(SwapLost, match=r"sequence 0 \(tokens 8\.\.15\)"):
        tc.decode_attention(0, q, [run.seq_id], m.params[0])
    tc.close()


def test_memory_swap_tier_and_config_checks(tmp_path):
    cfg = _cfg("bf16")
    base = ToyLM(PagedCache(cfg)).generate(PROMPT, 6)
    tc = PagedCache(cfg, OffloadConfig(resident_blocks_per_seq=2, swap="memory"))
    _same(base, ToyLM(tc).generate(PROMPT, 6))
    assert tc.swap.tier.used_bytes > 0
    tc.close()
    assert tc.swap.tier.used_bytes == 0


def test_shared_prefix_blocks_are_swapped_once(tmp_path):
    cfg = _cfg("bf16")
    prompts = [PROMPT[:40] + [1, 2, 3], PROMPT[:40] + [4, 5]]  # 5 shared full blocks

    def run(cache):
        m = ToyLM(cache, seed=2)
        return [m.generate(p, 4) for p in prompts]

    want = run(PagedCache(cfg))
    with _tiered(tmp_path, cfg, 1) as tc:
        got = run(tc)
        for a, b in zip(want, got):
            _same(a, b)
        assert got[1].hit_tokens == 40
        # the second sequence's 5 prefix blocks reuse the first one's records
        assert tc.offload_stats()["swap"]["swap_outs"] == len(tc.seqs.rec_refs) == 5
        assert sorted(tc.seqs.rec_refs.values()) == [2] * 5  # one record, two table entries
        assert len(tc.swap.tier) == 5
        tc.free(got[0].seq_id)
        assert sorted(tc.seqs.rec_refs.values()) == [1] * 5 and len(tc.swap.tier) == 5
        tc.free(got[1].seq_id)
        assert tc.seqs.rec_refs == {} and tc.seqs.rec_chain == {} and len(tc.swap.tier) == 0
        tc.seqs.check_invariants()


def test_stale_swap_dirs_of_dead_processes_are_removed(tmp_path):
    import subprocess
    import sys

    from pagedkv.offload.policy import _HOST

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    swap = tmp_path / "swap"
    for name in (f"{_HOST}-{dead}-abc", f"otherhost-{dead}-abc", f"{_HOST}-{os.getpid()}-live"):
        (swap / name).mkdir(parents=True)
        (swap / name / "x").write_bytes(b"1")
    tc = _tiered(tmp_path, _cfg("bf16"), 2)
    left = sorted(p.name for p in swap.iterdir())
    assert f"{_HOST}-{dead}-abc" not in left  # its process is gone
    assert f"otherhost-{dead}-abc" in left and f"{_HOST}-{os.getpid()}-live" in left
    tc.close()


def _chunked(cache, prompt, chunk=16, steps=6):
    """Chunked prefill then decode; returns (tokens, last-layer outputs)."""
    m = ToyLM(cache, seed=4)
    new = cache.add_sequence(prompt[:chunk])
    sid = new.seq_id
    logits, _ = m.forward(prompt[:chunk], [sid], new.slot_mapping, torch.tensor([0, chunk], dtype=torch.int32))
    cache.commit(sid)
    for s in range(chunk, len(prompt), chunk):
        part = prompt[s:s + chunk]
        slots = cache.allocate(sid, part)
        logits, _ = m.forward(part, [sid], slots, torch.tensor([0, len(part)], dtype=torch.int32))
        cache.commit(sid)
    toks, outs = [int(logits[-1].argmax())], []
    for _ in range(steps):
        batch = cache.step([sid], [[toks[-1]]])
        logits, o = m.forward([toks[-1]], [sid], batch.slot_mapping, None)
        cache.commit(sid)
        toks.append(int(logits[-1].argmax()))
        outs.append(o.clone())
    return toks, outs


def test_capped_context_longer_than_the_pool(tmp_path):
    prompt = [(3 * i + 1) % 97 for i in range(200)]  # 200 tokens = 25 blocks of 8
    want_toks, want_outs = _chunked(PagedCache(_cfg("turbo3", num_blocks=40)), prompt)
    with pytest.raises(CacheFull):
        _chunked(PagedCache(_cfg("turbo3", num_blocks=8)), prompt)
    with _tiered(tmp_path, _cfg("turbo3", num_blocks=8), 3) as tc:  # 8 blocks hold 26 in use
        toks, outs = _chunked(tc, prompt)
        assert toks == want_toks and all(torch.equal(a, b) for a, b in zip(want_outs, outs))
        assert tc.pool.num_used <= 5 and len(tc.seqs.table(0)) == 26
        tc.seqs.check_invariants()
