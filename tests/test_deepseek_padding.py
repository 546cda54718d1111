"""Padded batches in the latent (MLA) drop-in `PagedLatentCache` (a tiny random DeepSeek-V3).

Oracles: each prompt run alone (greedy tokens; for a codec without fitted scales, the same
stored bytes, so the logits agree to fp32 summation order), transformers' own eager attention
on the padded batch over bf16-rounded latents (what a bf16 cache stores), the same batch
prefilled in one forward (for a chunked prefill), and the same batch with other pad tokens
(pads are never stored nor fitted: the same scales and outputs at the real positions).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers.mla import RoundingCache, enabled_model  # noqa: E402
from pagedkv.errors import InvalidInput  # noqa: E402
from pagedkv.integrations.deepseek import PagedLatentCache, disable, enable  # noqa: E402

PAD, WIDTH = 0, 11


model = pytest.fixture(scope="module", name="model")(enabled_model)


def _prompts():
    g = torch.Generator().manual_seed(4)
    return torch.randint(1, 256, (5,), generator=g), torch.randint(1, 256, (WIDTH,), generator=g)


def _batch(prompts, side="left", pad=PAD):
    """ids, attention mask [B, WIDTH] of the prompts padded on `side` with token `pad`."""
    ids = torch.full((len(prompts), WIDTH), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(prompts):
        cols = slice(WIDTH - len(p), WIDTH) if side == "left" else slice(0, len(p))
        ids[r, cols], mask[r, cols] = p, 1
    return ids, mask


def _positions(mask):
    return (mask.cumsum(1) - 1).clamp(min=0)


def _eager(model, ids, mask, **kw):
    disable(model)
    try:
        return model(ids, attention_mask=mask, cache=RoundingCache(config=model.config), **kw).logits
    finally:
        enable(model)


# no EOS stop, so every row runs all steps (the same logits processor in every run)
GEN = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=PAD)


@pytest.mark.parametrize("fmt", ["bf16", "turbo4"])
@torch.no_grad()
def test_left_padded_generate_gives_each_prompt_its_own_tokens(model, fmt):
    prompts = _prompts()
    ids, mask = _batch(prompts)
    cache = PagedLatentCache(model, fmt, block_size=4)
    out = model.generate(ids, attention_mask=mask, cache=cache, **GEN)
    for r, p in enumerate(prompts):
        alone = model.generate(p[None], attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               cache=PagedLatentCache(model, fmt, block_size=4), **GEN)
        assert out[r, WIDTH - len(p):].tolist() == alone[0].tolist()
    # pads were never stored: each row holds its own tokens only
    assert cache.row_lengths(cache.get_seq_length()) == [len(p) + 7 for p in prompts]
    cache.core.check_invariants()
    if fmt == "bf16":  # transformers' own cache and eager attention on the padded batch
        disable(model)
        try:
            ref = model.generate(ids, attention_mask=mask, **GEN)
        finally:
            enable(model)
        assert torch.equal(out, ref)


@pytest.mark.parametrize("side", ["left", "right"])
@torch.no_grad()
def test_padded_logits_match_eager_attention_and_each_row_alone(model, side):
    prompts = _prompts()
    ids, mask = _batch(prompts, side)
    pos = _positions(mask)
    real = mask.bool()
    eager = _eager(model, ids, mask, position_ids=pos)
    scale = float(eager[real].abs().max())
    ours = model(ids, attention_mask=mask, position_ids=pos, cache=PagedLatentCache(model, "bf16")).logits
    # same stored values: only the fp32 summation order differs (absorbed vs expanded heads)
    torch.testing.assert_close(ours[real], eager[real], atol=2e-3 * scale, rtol=0)
    # turbo4 (no fitted scales): a row stores the bytes it stores alone
    cache = PagedLatentCache(model, "turbo4", block_size=4)
    batch = model(ids, attention_mask=mask, position_ids=pos, cache=cache).logits
    for r, p in enumerate(prompts):
        alone = model(p[None], cache=PagedLatentCache(model, "turbo4", block_size=4)).logits[0]
        torch.testing.assert_close(batch[r][real[r]], alone, atol=1e-4 * scale, rtol=0)
    assert cache.row_lengths(WIDTH) == [len(p) for p in prompts]


@torch.no_grad()
def test_chunked_padded_prefill_and_decode_equal_one_forward(model):
    """4 + 7 columns (the short row is all pads in the first chunk), then two decode steps."""
    prompts = _prompts()
    ids, mask = _batch(prompts)
    nxt = torch.tensor([[17, 40], [99, 3]])
    full_ids = torch.cat([ids, nxt], 1)
    full_mask = torch.cat([mask, torch.ones_like(nxt)], 1)
    pos = _positions(full_mask)
    one = model(full_ids, attention_mask=full_mask, position_ids=pos,
                cache=PagedLatentCache(model, "turbo4", block_size=4)).logits
    cache = PagedLatentCache(model, "turbo4", block_size=4)
    parts = [model(full_ids[:, a:b], attention_mask=full_mask[:, :b], position_ids=pos[:, a:b],
                   cache=cache).logits for a, b in ((0, 4), (4, WIDTH), (WIDTH, WIDTH + 1),
                                                     (WIDTH + 1, WIDTH + 2))]
    real = full_mask.bool()
    torch.testing.assert_close(torch.cat(parts, 1)[real], one[real],
                               atol=1e-4 * float(one.abs().max()), rtol=0)


def _layer0_latent_amax(model) -> torch.Tensor:
    """Per token id, the largest |latent| layer 0 stores for it (layer 0's latent depends on
    the token only)."""
    seen = []
    norm = model.model.layers[0].self_attn.kv_a_layernorm
    handle = norm.register_forward_hook(lambda mod, args, out: seen.append(out))
    try:
        disable(model)
        model(torch.arange(256)[None])
    finally:
        enable(model)
        handle.remove()
    return seen[0][0].abs().amax(-1)


@torch.no_grad()
def test_pads_are_neither_stored_nor_fitted_fp8(model):
    """fp8 scales come from the real tokens only: pads of a token with a larger latent than
    any real token's change no scale and no output against pads of a small one."""
    amax = _layer0_latent_amax(model)
    prompts = _prompts()
    used = torch.cat(prompts)
    others = amax.clone()
    others[used] = float("nan")
    big, small = int(others.nan_to_num(-1).argmax()), int(others.nan_to_num(1e9).argmin())
    assert amax[big] > amax[used].max()  # pads of `big` would raise layer 0's scale if fitted
    runs = []
    for pad in (small, big):
        ids, mask = _batch(prompts, pad=pad)
        cache = PagedLatentCache(model, "fp8", block_size=4)
        runs.append((model(ids, attention_mask=mask, position_ids=_positions(mask), cache=cache).logits,
                     [float(layer.paged.latent_scale) for layer in cache.layers]))
    real = _batch(prompts)[1].bool()
    assert runs[0][1] == runs[1][1]
    # the same stored bytes; only the MoE's per-expert matmul shapes differ (fp32 rounding)
    torch.testing.assert_close(runs[0][0][real], runs[1][0][real],
                               atol=1e-4 * float(runs[0][0][real].abs().max()), rtol=0)


@torch.no_grad()
def test_masks_that_do_not_fit_are_refused_before_any_change(model):
    prompts = _prompts()
    ids, mask = _batch(prompts)
    cache = PagedLatentCache(model, "turbo4", block_size=4)
    model(ids, attention_mask=mask, cache=cache)
    state = lambda: (cache.get_seq_length(), cache.row_lengths(WIDTH), cache.core.groups[0].pool.num_used,
                     [layer.paged.pool.clone() for layer in cache.layers])
    before = state()
    step = torch.tensor([[5], [6]])
    wrong_past = torch.cat([torch.ones_like(mask), torch.ones_like(step)], 1)  # marks pads as tokens
    with pytest.raises(InvalidInput, match="valid past tokens"):
        model(step, attention_mask=wrong_past, cache=cache)
    with pytest.raises(InvalidInput, match="batch size"):
        model(step[:1], attention_mask=wrong_past[:1], cache=cache)
    after = state()
    assert after[:3] == before[:3] and all(torch.equal(a, b) for a, b in zip(after[3], before[3]))
    # a prepared 4D mask that is not causal + padding (here: bidirectional) is refused too
    fresh = PagedLatentCache(model, "turbo4", block_size=4)
    with pytest.raises(InvalidInput, match="causal"):
        model(ids, attention_mask=torch.zeros(2, 1, WIDTH, WIDTH), cache=fresh)
    assert fresh.get_seq_length() == 0 and fresh.pool_bytes() == 0
    # the right mask still runs on the cache the refusals left alone
    ok = torch.cat([mask, torch.ones_like(step)], 1)
    model(step, attention_mask=ok, cache=cache)
    assert cache.row_lengths(WIDTH + 1) == [len(p) + 1 for p in prompts]


@torch.no_grad()
def test_every_mask_form_gives_the_same_outputs(model):
    """The model's attention implementation only changes the mask the attention module gets
    (eager: float 4D, sdpa: bool 4D, "pagedkv": a 2D PaddingMask): the same outputs."""
    from pagedkv.integrations.transformers import register

    register()
    ids, mask = _batch(_prompts())
    outs = {}
    try:
        for impl in ("eager", "sdpa", "pagedkv"):
            model.set_attn_implementation(impl)
            outs[impl] = model.generate(ids, attention_mask=mask, cache=PagedLatentCache(model, "bf16"),
                                        output_logits=True, return_dict_in_generate=True, **GEN)
    finally:
        model.set_attn_implementation("eager")
    for impl in ("sdpa", "pagedkv"):
        assert torch.equal(outs[impl].sequences, outs["eager"].sequences)
        assert all(torch.equal(a, b) for a, b in zip(outs[impl].logits, outs["eager"].logits))


@torch.no_grad()
def test_a_refused_first_chunk_fixes_no_fp8_scale(model):
    """NaN rows are refused; the layer forgets the scales that chunk fixed, so the next chunk
    fits its own: the outputs equal a fresh cache's."""
    ids, mask = _batch(_prompts())
    pos = _positions(mask)
    cache = PagedLatentCache(model, "fp8", block_size=4)
    with pytest.raises(InvalidInput, match="finite|NaN"):
        cache.mla_store(0, torch.full((2, WIDTH, 64), float("nan")), torch.zeros(2, WIDTH, 32), mask)
    assert not cache.layers[0].is_initialized and cache.layers[0].paged is None
    got = model(ids, attention_mask=mask, position_ids=pos, cache=cache).logits
    want = model(ids, attention_mask=mask, position_ids=pos,
                 cache=PagedLatentCache(model, "fp8", block_size=4)).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-5 * float(want[real].abs().max()), rtol=0)
