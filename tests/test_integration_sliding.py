"""Sliding-window layers release the blocks that left the window (transformers cache).

Tiny random Gemma2/3 and Mistral models, window W = 8, blocks of 4 tokens, contexts of 5-10
windows. Oracles: transformers' DynamicCache with eager attention (bf16 K/V: within the bf16
rounding of K/V), and the same paged cache without reclaiming (`reclaim_sliding=False`) for a
compressed format: reclaiming must not change a single output bit. Block counts are asserted
exactly: a row whose last chunk started at position s and which holds n tokens keeps, in a
sliding group, the blocks from the one holding position max(0, s - W + 1) up to position n - 1.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import DynamicCache  # noqa: E402

from helpers.cache_checks import check_refcounts  # noqa: E402
from pagedkv.errors import CacheFull, InvalidInput  # noqa: E402
from pagedkv.integrations.transformers import (  # noqa: E402
    ATTN_IMPLEMENTATION, PagedKVCache, paged_attention_forward, register,
)

VOCAB, W, BS = 96, 8, 4


def _model(family: str, impl: str = "eager"):
    register()
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, max_position_embeddings=512)
    if family == "gemma3":  # 3 sliding layers, 1 global
        cfg = transformers.Gemma3TextConfig(**common, num_hidden_layers=4, sliding_window=W,
                                            query_pre_attn_scalar=32,
                                            layer_types=["sliding_attention", "sliding_attention",
                                                         "full_attention", "sliding_attention"])
        model = transformers.Gemma3ForCausalLM(cfg)
    elif family == "gemma2":  # alternating sliding / global, soft-capped logits
        cfg = transformers.Gemma2Config(**common, num_hidden_layers=4, sliding_window=W,
                                        attn_logit_softcapping=20.0, final_logit_softcapping=30.0,
                                        query_pre_attn_scalar=32)
        model = transformers.Gemma2ForCausalLM(cfg)
    elif family == "mistral":  # every layer slides
        cfg = transformers.MistralConfig(**common, num_hidden_layers=2, sliding_window=W)
        model = transformers.MistralForCausalLM(cfg)
    else:
        raise AssertionError(family)
    model.eval()
    with torch.no_grad():  # sharpen attention (random init is nearly uniform)
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(4.0)
    model.set_attn_implementation(impl)
    return model


def _ids(n: int, seed: int = 1, rows: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (rows, n), generator=g)


def _logits(model, ids, cache, **kw):
    with torch.no_grad():
        return model(ids, cache=cache, use_cache=True, **kw).logits.float()


def _live(start: int, length: int) -> int:
    """Blocks a sliding row holds after storing positions start..length-1 (its last chunk)."""
    return -(-length // BS) - max(0, start - W + 1) // BS


def _groups(cache):
    glob = [g for g in cache.groups if g.window is None]
    slid = [g for g in cache.groups if g.window is not None]
    return (glob[0] if glob else None), slid


def test_bf16_decode_far_past_the_window_matches_dynamic_cache_with_bounded_blocks():
    """Prefill 10 tokens, decode 70 one by one: logits match eager DynamicCache; the sliding
    group holds exactly `_live` blocks after every step (2-3), the global group ceil(n / 4)."""
    model = _model("gemma3")
    ids = _ids(80)
    ref = _logits(model, ids, DynamicCache(config=model.config))
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    cache = PagedKVCache(model, "bf16", high_precision_layers=0, block_size=BS)
    glob, (slid,) = _groups(cache)
    assert slid.layers == [0, 1, 3] and glob.layers == [2] and cache.blocks is glob
    outs = [_logits(model, ids[:, :10], cache)]
    assert slid.used == _live(0, 10) == 3 and glob.used == 3
    for t in range(10, 80):
        outs.append(_logits(model, ids[:, t:t + 1], cache))
        assert slid.used == _live(t, t + 1) <= -(-(W - 1) // BS) + 1, t
        assert glob.used == -(-(t + 1) // BS)
    out = torch.cat(outs, dim=1)
    assert (out - ref).abs().max() <= 2e-2 * ref.abs().max(), (out - ref).abs().max()
    assert slid.num_blocks == 16 and glob.num_blocks == 32  # the sliding pools never grew
    check_refcounts(cache)
    # used bytes: the global layer's 20 blocks + the sliding layers' 2, exact catalogue sizes
    per_layer = cache.config.layers[0].k_block_bytes + cache.config.layers[0].v_block_bytes
    assert cache.used_bytes() == (20 * 1 + 2 * 3) * per_layer
    assert cache.global_bytes_per_token() * 4 == cache.bytes_per_token()


@pytest.mark.parametrize("family,fmt,backend", [("gemma3", "turbo3", None), ("gemma2", "q4_0", None),
                                                ("gemma3", "turbo4", "reference")])
def test_compressed_reclaim_changes_no_output(family, fmt, backend):
    """Chunks of 10, 7, 3 then single tokens: bit-identical logits with and without reclaiming
    (the ops never read a block wholly outside the window; the oracle gathers the stale table
    entries and masks them)."""
    model = _model(family, ATTN_IMPLEMENTATION)
    ids = _ids(44, seed=5)
    caches = [PagedKVCache(model, fmt, block_size=BS, backend=backend, reclaim_sliding=r) for r in (True, False)]
    bounds = [0, 10, 17, 20] + list(range(21, 45))
    outs = [[], []]
    for a, b in zip(bounds, bounds[1:]):
        for out, cache in zip(outs, caches):
            out.append(_logits(model, ids[:, a:b], cache))
    torch.testing.assert_close(torch.cat(outs[0], 1), torch.cat(outs[1], 1), atol=0, rtol=0)
    (_, slid), (keep, _) = _groups(caches[0]), _groups(caches[1])
    assert slid[0].used == _live(43, 44) and keep.used == 11 and len(caches[1].groups) == 1
    assert caches[0].used_bytes() < caches[1].used_bytes()
    # greedy generate: same tokens
    with torch.no_grad():
        gen = [model.generate(ids[:, :12], max_new_tokens=20, do_sample=False, pad_token_id=0,
                              cache=PagedKVCache(model, fmt, block_size=BS, reclaim_sliding=r))
               for r in (True, False)]
    assert gen[0].tolist() == gen[1].tolist()


def test_left_padded_generate_matches_eager_with_per_row_bounds():
    """Rows of 21, 12 and 5 tokens, left padded, 12 new tokens, with and without chunked prefill:
    same tokens as eager DynamicCache; each row keeps exactly its own `_live` blocks."""
    model = _model("gemma3")
    lengths = [21, 12, 5]
    ids = torch.zeros(3, 21, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, n in enumerate(lengths):
        ids[r, 21 - n:] = _ids(n, seed=20 + r)[0]
        mask[r, 21 - n:] = 1
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, **kw)
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        for chunk in (None, 4):
            cache = PagedKVCache(model, "bf16", high_precision_layers=0, block_size=BS)
            extra = {} if chunk is None else {"prefill_chunk_size": chunk}
            out = model.generate(ids, attention_mask=mask, cache=cache, **kw, **extra)
            assert out.tolist() == ref.tolist(), chunk
            rows = cache.row_lengths(cache.get_seq_length())
            assert rows == [n + 11 for n in lengths]  # the last token is never fed back
            _, (slid,) = _groups(cache)
            assert [len(t) - d for t, d in zip(slid.tables, slid.dead)] == [_live(n - 1, n) for n in rows]
            assert slid.used == sum(_live(n - 1, n) for n in rows)
            check_refcounts(cache)
    # crop_limit on padded rows: keeping crop_limit() columns works, one fewer is refused
    limit = cache.crop_limit()
    assert 0 < limit < cache.get_seq_length()
    with pytest.raises(InvalidInput, match=f"smallest crop kept is {limit} columns"):
        cache.crop(limit - 1)
    cache.crop(limit)
    assert cache.get_seq_length() == limit
    check_refcounts(cache)
    # re-feeding the cropped columns gives the logits of a fresh cache fed them in one go
    cols = 21 + 11
    full_mask = torch.cat([mask, torch.ones(3, 11, dtype=torch.long)], dim=1)
    pos = (full_mask.cumsum(-1) - 1).clamp(min=0)
    again = _logits(model, out[:, limit:cols], cache, attention_mask=full_mask, position_ids=pos[:, limit:])
    fresh = _logits(model, out[:, :cols], PagedKVCache(model, "bf16", high_precision_layers=0, block_size=BS),
                    attention_mask=full_mask, position_ids=pos)
    torch.testing.assert_close(again, fresh[:, limit:], atol=1e-4, rtol=1e-4)


def test_beam_search_and_reorder_share_blocks_in_both_groups():
    """Beam search (reorder_cache, batch_repeat_interleave) on Gemma2 for 24 new tokens: same
    beams as eager DynamicCache; reference counts consistent in both groups; select keeps rows."""
    model = _model("gemma2")
    ids = _ids(6, seed=3)
    kw = dict(max_new_tokens=24, do_sample=False, pad_token_id=0, num_beams=3)
    with torch.no_grad():
        ref = model.generate(ids, **kw)
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        cache = PagedKVCache(model, "bf16", high_precision_layers=0, block_size=BS)
        out = model.generate(ids, cache=cache, **kw)
    assert out.tolist() == ref.tolist()
    check_refcounts(cache)
    glob, (slid,) = _groups(cache)
    n = cache.get_seq_length()
    assert all(len(t) - d == _live(n - 1, n) for t, d in zip(slid.tables, slid.dead))
    assert slid.used <= 3 * _live(n - 1, n) and glob.used >= -(-n // BS)
    cache.batch_select_indices(torch.tensor([2, 0]))
    assert cache.batch_rows == 2 and len(slid.dead) == 2
    check_refcounts(cache)
    cache.reset()
    assert glob.used == 0 and slid.used == 0 and slid.tables == [] and slid.dead == []


def test_crop_back_to_the_last_chunk_works_and_further_is_refused():
    """Prefill 20 tokens, 3 decode steps (last chunk at 22: positions < 12 released, so the
    smallest crop keeps 12 + W - 1 = 19 columns). crop(-4) then re-feeding gives the same logits;
    crop(-5) raises naming the limit and changes nothing; crop(0) empties the cache."""
    model = _model("gemma3", ATTN_IMPLEMENTATION)
    ids = _ids(23, seed=9)
    cache = PagedKVCache(model, "turbo4", block_size=BS)
    full = torch.cat([_logits(model, ids[:, :20], cache)] +
                     [_logits(model, ids[:, t:t + 1], cache) for t in range(20, 23)], dim=1)
    _, (slid,) = _groups(cache)
    assert slid.dead == [3] and cache.crop_limit() == 19
    cache.crop(-4)
    assert cache.get_seq_length() == 19
    again = _logits(model, ids[:, 19:], cache)
    torch.testing.assert_close(again, full[:, 19:], atol=1e-4, rtol=1e-4)
    before = ([list(t) for g in cache.groups for t in g.tables], [g.used for g in cache.groups])
    with pytest.raises(InvalidInput, match=r"cannot crop to 18 columns.*window 8.*smallest crop kept is 19"):
        cache.crop(-5)
    assert ([list(t) for g in cache.groups for t in g.tables], [g.used for g in cache.groups]) == before
    assert cache.get_seq_length() == 23
    cache.crop(0)  # transformers' "remove nothing"
    assert ([list(t) for g in cache.groups for t in g.tables], [g.used for g in cache.groups]) == before
    cache.crop(-23)  # remove everything: always possible
    assert cache.get_seq_length() == 0 and all(g.used == 0 for g in cache.groups) and slid.dead == [0]
    # without reclaiming any crop works
    keep = PagedKVCache(model, "turbo4", block_size=BS, reclaim_sliding=False)
    _logits(model, ids, keep)
    keep.crop(-20)
    assert keep.crop_limit() == 0 and keep.get_seq_length() == 3


def test_all_sliding_model_decodes_past_max_tokens():
    """Mistral with W = 8, every layer sliding, max_tokens=16 (4 blocks): 60 tokens decode within
    those 4 blocks and match eager; a 20-token chunk needs 5 blocks at once: CacheFull, nothing
    changed."""
    model = _model("mistral")
    ids = _ids(60, seed=4)
    ref = _logits(model, ids, DynamicCache(config=model.config))
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    cache = PagedKVCache(model, "bf16", high_precision_layers=0, block_size=BS, max_tokens=16)
    (slid,) = cache.groups
    out = torch.cat([_logits(model, ids[:, :6], cache)] +
                    [_logits(model, ids[:, t:t + 1], cache) for t in range(6, 60)], dim=1)
    assert (out - ref).abs().max() <= 2e-2 * ref.abs().max()
    assert slid.num_blocks == 4 and slid.used == _live(59, 60)
    small = PagedKVCache(model, "bf16", high_precision_layers=0, block_size=BS, max_tokens=16)
    with pytest.raises(CacheFull, match=r"sliding-window \(W=8\) layers need 5 more blocks.*allows 4"):
        _logits(model, ids[:, :20], small)
    assert small.get_seq_length() == 0 and small.groups[0].used == 0
    assert not any(layer.is_initialized for layer in small.layers)
    _logits(model, ids[:, :16], small)  # 16 tokens fit
    # a chunk that does not fit changes nothing, not even what the next chunk would release
    cache = PagedKVCache(model, "bf16", high_precision_layers=0, block_size=BS, max_tokens=16)
    (slid,) = cache.groups
    for a, b in [(0, 6)] + [(t, t + 1) for t in range(6, 31)]:
        _logits(model, ids[:, a:b], cache)
    assert slid.dead == [5] and cache.crop_limit() == 27  # last chunk at 30: positions < 20 released
    tables = [list(t) for t in slid.tables]
    # 16 tokens at 31 need 4 new blocks; 1 is free and releasing up to position 24 frees 1 more
    with pytest.raises(CacheFull, match="need 4 more blocks of 4 tokens but have 2 free"):
        _logits(model, ids[:, 31:47], cache)
    assert slid.dead == [5] and [list(t) for t in slid.tables] == tables and cache.get_seq_length() == 31
    again = _logits(model, ids[:, 31:32], cache)
    torch.testing.assert_close(again, out[:, 31:32], atol=1e-4, rtol=1e-4)


def test_attention_with_a_wider_window_than_the_cache_keeps_is_refused():
    model = _model("gemma3", ATTN_IMPLEMENTATION)
    cache = PagedKVCache(model, "bf16", high_precision_layers=0, block_size=BS)
    k, v = cache.layers[0].update(torch.randn(1, 2, 5, 32), torch.randn(1, 2, 5, 32), 0)
    with pytest.raises(InvalidInput, match="sliding_window=16 but its cache layer keeps only the last 8"):
        paged_attention_forward(None, torch.randn(1, 4, 5, 32), k, v, None, sliding_window=16)
    assert cache.layers[0].length == 0 and cache.layers[0].pending is None and cache.blocks.used == 0


def test_sliding_pools_shrink_after_a_long_prefill_chunk():
    """A 100-token prefill chunk grows the sliding pools to 32 blocks (all 25 are needed while
    the chunk is attended); the next step releases all but 2 and cuts the pools back to 16
    blocks (moving the live ones), with outputs bit-identical to the cache that keeps all."""
    model = _model("gemma3", ATTN_IMPLEMENTATION)
    ids = _ids(112, seed=8)
    caches = [PagedKVCache(model, "turbo3", block_size=BS, reclaim_sliding=r) for r in (True, False)]
    outs = [[_logits(model, ids[:, :100], c)] for c in caches]
    glob, (slid,) = _groups(caches[0])
    assert slid.num_blocks == 32 and slid.used == 25
    sliding_pool = caches[0].layers[0].paged.k_pool
    assert sliding_pool.shape[0] == 32
    before = caches[0].pool_bytes()
    for t in range(100, 112):
        for out, c in zip(outs, caches):
            out.append(_logits(model, ids[:, t:t + 1], c))
        assert slid.used == _live(t, t + 1)
    assert slid.num_blocks == 16 and all(caches[0].layers[i].paged.k_pool.shape[0] == 16 for i in slid.layers)
    assert caches[0].layers[2].paged.k_pool.shape[0] == glob.num_blocks == 32
    assert caches[0].pool_bytes() < before
    assert max(b for t in slid.tables for b in t) < 16
    check_refcounts(caches[0])
    torch.testing.assert_close(torch.cat(outs[0], 1), torch.cat(outs[1], 1), atol=0, rtol=0)


def test_assisted_generation_crops_within_the_limit():
    """Assisted (speculative) decoding crops the rejected candidates of the last forward, which
    never goes back past the start of that forward's chunk: same tokens as plain greedy eager."""
    model = _model("gemma3")
    assistant = _model("gemma3")
    torch.manual_seed(1)
    with torch.no_grad():
        for p in assistant.parameters():  # a draft model that is sometimes wrong
            p.add_(0.01 * torch.randn_like(p))
    ids = _ids(30, seed=2)
    kw = dict(max_new_tokens=30, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ref = model.generate(ids, **kw)
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        cache = PagedKVCache(model, "bf16", high_precision_layers=0, block_size=BS)
        out = model.generate(ids, cache=cache, assistant_model=assistant, **kw)
    assert out.tolist() == ref.tolist()
    _, (slid,) = _groups(cache)
    assert slid.dead[0] > 0  # blocks were released meanwhile
    check_refcounts(cache)
