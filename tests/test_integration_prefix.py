"""Prefix caching and the offload tiers across `generate` calls in the transformers drop-in, on
the embedded SmolLM2.

Two chat prompts share SmolLM2's system prompt. After the first `generate`, `cache.begin(ids2)`
finds the shared whole blocks; the second `generate` then runs the model on the other tokens only
(counted by a forward hook) and produces the same tokens as without the hits: exactly the bf16
DynamicCache tokens for bf16 K/V, and for turbo3 the same tokens as the same cache (same
first-chunk statistics) computing the whole prompt (`begin(..., reuse=False)`).

Tiers (turbo3):
- Resident cap: `PagedKVCache(model, "turbo3", offload=OffloadConfig(resident_blocks_per_seq=2))`
  generates the same tokens as the uncapped cache while the row never holds more than the cap
  (+ the block being written) in the pool: the older blocks are swapped to disk and read back,
  byte for byte, for attention.
- Prefix store on disk: a cache that published a chat prompt's blocks lets a fresh cache (its own
  pools, nothing shared but the directory) load the shared system prompt instead of computing it,
  adopting the stored transform, with the same tokens as the publisher computing the same prompt.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gguf")
from helpers.embedded import embedded_lm  # noqa: E402
from pagedkv.offload import OffloadConfig  # noqa: E402

pytestmark = pytest.mark.model
KW = dict(max_new_tokens=12, do_sample=False)


@pytest.fixture(scope="module")
def lm():
    out = embedded_lm()
    from pagedkv.integrations.transformers import enable

    enable(out.model)
    return out


def _chat(tok, question: str) -> torch.Tensor:
    msgs = [{"role": "system", "content": "You are a careful assistant. Answer in one short "
             "sentence, plainly, without lists, and say when you are not sure of a fact."},
            {"role": "user", "content": question}]
    return tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt",
                                   return_dict=True)["input_ids"]


def _shared(a: torch.Tensor, b: torch.Tensor) -> int:
    n = 0
    while n < min(a.shape[1], b.shape[1]) and a[0, n] == b[0, n]:
        n += 1
    return n


class _Counter:
    """Tokens each forward of the model was given."""

    def __init__(self, model):
        self.seen: list[int] = []
        self.handle = model.register_forward_pre_hook(
            lambda m, a, kw: self.seen.append(kw["input_ids"].shape[1]), with_kwargs=True)


@pytest.mark.parametrize("fmt,recent", [("bf16", None), ("turbo3", None), ("turbo3", 16)])
def test_second_generate_reuses_the_shared_system_prompt(lm, fmt, recent):
    """recent=16: a high-precision recent window of 16 tokens, whose tails live in a sliding
    block group: the hit holds only the tail blocks covering its last 16 positions there."""
    from transformers import DynamicCache

    from pagedkv.integrations.transformers import PagedKVCache

    tok, model = lm.tokenizer, lm.model
    ids1, ids2 = _chat(tok, "What is a Python decorator?"), _chat(tok, "Why is the sky blue?")
    shared = _shared(ids1, ids2)
    assert shared >= 32
    kw = dict(KW, pad_token_id=tok.eos_token_id)
    with torch.inference_mode():
        cache = PagedKVCache(model, fmt, recent_window=recent)
        first = model.generate(ids1, cache=cache, **kw)
        hits = cache.begin(ids2)
        assert hits == shared // 16 * 16 and cache.get_seq_length() == hits
        if recent is not None:  # the tail group holds only the window's blocks of the hit
            tail = cache.tail_group.seqs
            assert tail.window == recent and tail.dead(cache._rows[0]) == (hits - recent + 1) // 16 > 0
        counter = _Counter(model)
        try:
            out = model.generate(ids2, cache=cache, **kw)
        finally:
            counter.handle.remove()
        assert counter.seen[0] == ids2.shape[1] - hits  # the hit tokens were not recomputed
        assert cache.prefix_hit_tokens == hits
        cache.core.check_invariants()
        # the oracle: the same tokens without the hits
        if fmt == "bf16":
            model.set_attn_implementation("sdpa")
            ref = model.generate(ids2, cache=DynamicCache(config=model.config), **kw)
            model.set_attn_implementation("pagedkv")
        else:
            again = PagedKVCache(model, fmt, recent_window=recent)
            assert model.generate(ids1, cache=again, **kw).tolist() == first.tolist()
            assert again.begin(ids2, reuse=False) == 0
            ref = model.generate(ids2, cache=again, **kw)
    assert out.tolist() == ref.tolist()


def test_resident_cap_generates_the_same_tokens_holding_at_most_the_cap(lm, tmp_path):
    from pagedkv.integrations.transformers import PagedKVCache

    tok, model = lm.tokenizer, lm.model
    ids = _chat(tok, "What is a Python decorator?")
    kw = dict(max_new_tokens=40, do_sample=False, pad_token_id=tok.eos_token_id)
    cap = 2
    capped = PagedKVCache(model, "turbo3", offload=OffloadConfig(
        resident_blocks_per_seq=cap, swap_dir=str(tmp_path / "swap")))
    held = []
    hook = model.register_forward_hook(lambda *a: held.append(capped.blocks.used))
    try:
        with torch.inference_mode():
            ref = model.generate(ids, cache=PagedKVCache(model, "turbo3"), **kw)
            out = model.generate(ids, cache=capped, **kw)
    finally:
        hook.remove()
    assert out.tolist() == ref.tolist()
    total = -(-(out.shape[1] - 1) // 16)
    assert total >= cap + 3
    # after each step's commit the row is swapped down to the cap; a step adds at most the
    # prompt's blocks (first forward) or one block
    assert max(held[1:]) <= cap + 1, held
    stats = capped.offload_stats()
    assert stats["swapped_blocks"] >= total - cap - 1 and stats["swap"]["swap_outs"] > 0
    capped.core.check_invariants()
    capped.crop(-20)  # back into the swapped region: the last block is read back
    capped.core.check_invariants()
    capped.close()


def test_prefix_store_on_disk_lets_a_fresh_cache_load_the_shared_prompt(lm, tmp_path):
    from pagedkv.integrations.transformers import PagedKVCache

    tok, model = lm.tokenizer, lm.model
    ids1, ids2 = _chat(tok, "What is a Python decorator?"), _chat(tok, "Why is the sky blue?")
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=tok.eos_token_id)
    cfg = OffloadConfig(prefix_store="disk", prefix_dir=str(tmp_path / "prefix"))
    with torch.inference_mode():
        first = PagedKVCache(model, "turbo3", offload=cfg)
        model.generate(ids1, cache=first, **kw)
        assert first.begin(ids2, reuse=False) == 0  # same transform, whole prompt computed
        ref = model.generate(ids2, cache=first, **kw)
        first.begin(ids2[:, :1], reuse=False)  # commits: ids2's blocks are published too
        first.close()
        fresh = PagedKVCache(model, "turbo3", offload=cfg)
        hits = fresh.begin(ids2)
        assert hits == (ids2.shape[1] - 1) // 16 * 16 and fresh.layers[0].is_initialized
        assert fresh.offload_stats()["prefix"]["blocks_loaded"] == hits // 16
        out = model.generate(ids2, cache=fresh, **kw)
        fresh.close()
    assert out.tolist() == ref.tolist()


def test_tiers_with_a_recent_window(lm, tmp_path):
    """The resident cap and the prefix store cover the recent window's tail group: a capped
    cache generates what an uncapped one does, and a fresh cache loads the shared prompt's
    pages and only the tail blocks the hit's last 16 positions need."""
    from pagedkv.integrations.transformers import PagedKVCache

    tok, model = lm.tokenizer, lm.model
    ids1, ids2 = _chat(tok, "What is a Python decorator?"), _chat(tok, "Why is the sky blue?")
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=tok.eos_token_id)
    cfg = OffloadConfig(resident_blocks_per_seq=1, swap_dir=str(tmp_path / "swap"),
                        prefix_store="disk", prefix_dir=str(tmp_path / "prefix"))
    with torch.inference_mode():
        plain = model.generate(ids1, cache=PagedKVCache(model, "turbo3", recent_window=16), **kw)
        first = PagedKVCache(model, "turbo3", recent_window=16, offload=cfg)
        assert model.generate(ids1, cache=first, **kw).tolist() == plain.tolist()
        assert first.offload_stats()["swapped_blocks"] > 0
        assert first.tail_group.seqs.swapped(first._rows[0])  # the tail group swapped too
        first.core.check_invariants()
        assert first.begin(ids2, reuse=False) == 0
        ref = model.generate(ids2, cache=first, **kw)
        first.begin(ids2[:, :1], reuse=False)  # commits: ids2's blocks are published too
        first.close()
        fresh = PagedKVCache(model, "turbo3", recent_window=16, offload=cfg)
        hits = fresh.begin(ids2)
        n = hits // 16
        assert hits == (ids2.shape[1] - 1) // 16 * 16
        tail = fresh.tail_group.seqs
        assert fresh.offload_stats()["prefix"]["blocks_loaded"] == n + len(tail.hit_blocks(n))
        assert len(tail.hit_blocks(n)) < n
        out = model.generate(ids2, cache=fresh, **kw)
        fresh.close()
    assert out.tolist() == ref.tolist()


def test_beams_and_crop_with_a_recent_window_group_and_tiers(lm, tmp_path):
    """Beam search (reorder = fork + free, in every group, with swapped records shared) and crop
    (pop, back into swapped blocks of the pages and within the tail group's crop limit) on a
    cache with a recent window's block group, a resident cap of one block and a prefix store:
    the same tokens as the cache without tiers, and a crop then `generate` again continues
    exactly as the uncropped run did."""
    from pagedkv.integrations.transformers import PagedKVCache

    tok, model = lm.tokenizer, lm.model
    ids = _chat(tok, "What is a Python decorator?")
    cfg = OffloadConfig(resident_blocks_per_seq=1, swap_dir=str(tmp_path / "swap"),
                        prefix_store="disk", prefix_dir=str(tmp_path / "prefix"))
    beams = dict(max_new_tokens=6, do_sample=False, num_beams=2, pad_token_id=tok.eos_token_id)
    greedy = dict(max_new_tokens=10, do_sample=False, pad_token_id=tok.eos_token_id)
    with torch.inference_mode():
        plain = model.generate(ids, cache=PagedKVCache(model, "turbo3", recent_window=16), **beams)
        tiered = PagedKVCache(model, "turbo3", recent_window=16, offload=cfg)
        out = model.generate(ids, cache=tiered, **beams)
        assert out.tolist() == plain.tolist()
        stats = tiered.offload_stats()
        assert tiered.batch_rows == 2 and stats["swap"]["swap_outs"] > 0
        assert stats["prefix"]["blocks_published"] > 0
        tiered.core.check_invariants()
        tiered.close()

        runs = {}
        for name, off in (("plain", None), ("tiered", cfg)):
            cache = PagedKVCache(model, "turbo3", recent_window=16, offload=off)
            full = model.generate(ids, cache=cache, **greedy)
            if off is not None:
                assert cache.offload_stats()["swapped_blocks"] > 0
            k = cache.get_seq_length() - cache.crop_limit()  # as far back as the tail group allows
            assert k >= 2
            ins = 0 if off is None else cache.offload_stats()["swap"]["swap_ins"]
            cache.crop(-k)
            if off is not None:  # the new last block of the pages was swapped: read back
                assert cache.offload_stats()["swap"]["swap_ins"] > ins
            assert cache.get_seq_length() == full.shape[1] - 1 - k
            cache.core.check_invariants()
            again = model.generate(full[:, :cache.get_seq_length()], cache=cache,
                                   **dict(greedy, max_new_tokens=k + 1))
            runs[name] = (full.tolist(), again.tolist())
            cache.close()
    assert runs["tiered"] == runs["plain"]
    full, again = runs["plain"]
    assert again == full  # crop + generate continues as the uncropped run did
