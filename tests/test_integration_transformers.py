"""The transformers drop-in on tiny random models of each supported family (offline, seconds).

Oracles: transformers' own DynamicCache with eager attention (for bf16 K/V, within the bf16
rounding of K/V), and a dense "quantize-dequantize" cache (K/V round-tripped through the codec's
reference encode/decode, same key centre) for compressed formats, which the paged cache must
match to fp32 rounding because attention on the pages is exact on the decoded values.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import DynamicCache  # noqa: E402

from helpers.cache_checks import check_refcounts  # noqa: E402
from pagedkv.codecs import reference as codec_ref  # noqa: E402
from pagedkv.errors import ConfigError, InvalidInput  # noqa: E402
from pagedkv.integrations.transformers import ATTN_IMPLEMENTATION, PagedKVCache, register  # noqa: E402

VOCAB = 96


def _tiny(family: str):
    common = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=192, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256)
    if family == "llama":
        return transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    if family == "qwen2":
        return transformers.Qwen2Config(**common), transformers.Qwen2ForCausalLM
    if family == "qwen3":
        return transformers.Qwen3Config(**common), transformers.Qwen3ForCausalLM
    if family == "mistral":
        return transformers.MistralConfig(**common, sliding_window=None), transformers.MistralForCausalLM
    if family == "gemma2":
        cfg = transformers.Gemma2Config(**common, sliding_window=8, attn_logit_softcapping=20.0,
                                        final_logit_softcapping=30.0, query_pre_attn_scalar=32)
        return cfg, transformers.Gemma2ForCausalLM
    if family == "gemma3":
        cfg = transformers.Gemma3TextConfig(**common, sliding_window=8, query_pre_attn_scalar=32,
                                            layer_types=["sliding_attention", "sliding_attention",
                                                         "full_attention"])
        return cfg, transformers.Gemma3ForCausalLM
    raise AssertionError(family)


def _model(family: str, impl: str = "eager"):
    register()
    torch.manual_seed(0)
    cfg, cls = _tiny(family)
    model = cls(cfg).eval()
    # random init is tiny; scale up projections so attention is far from uniform
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(4.0)
    model.set_attn_implementation(impl)
    return model


def _ids(n: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (1, n), generator=g)


FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3"]


def _logits(model, ids, cache):
    with torch.no_grad():
        return model(ids, cache=cache, use_cache=True).logits.float()


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_cache_matches_dynamic_cache_prefill_and_decode(family):
    model = _model(family)
    ids = _ids(24)  # longer than the sliding window (8) of the Gemma families
    ref = _logits(model, ids, DynamicCache(config=model.config))
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    cache = PagedKVCache(model, "bf16", high_precision_layers=0, block_size=4)
    # prompt in one pass, then token by token (decode path)
    out = torch.cat([_logits(model, ids[:, :10], cache)] +
                    [_logits(model, ids[:, t:t + 1], cache) for t in range(10, 24)], dim=1)
    assert cache.get_seq_length() == 24
    scale = ref.abs().max()
    # bf16 rounding of K/V only (relative 2^-8): a small fraction of the logit range
    assert (out - ref).abs().max() <= 2e-2 * scale, (out - ref).abs().max()


def _qdq(x: torch.Tensor, codec) -> torch.Tensor:
    data, scales = codec_ref.encode(codec, x)
    return codec_ref.decode(codec, data, scales, x.shape[-1])


class _QDQLayer(transformers.cache_utils.DynamicLayer):
    """Dense oracle: keys and values round-tripped through the codecs, with the paged layer's own
    key centre c and channel multipliers m: k -> (decode(encode(k*m - c*m)) + c*m) / m."""

    def __init__(self, fmt, paged_layer):
        super().__init__()
        self.fmt, self.paged_layer = fmt, paged_layer

    def update(self, k, v, *args, **kwargs):
        pl = self.paged_layer
        m = pl.k_mult if pl.k_mult is not None else torch.ones(k.shape[1], k.shape[-1], device=k.device)
        cm = pl.paged.k_centre if pl.paged.k_centre is not None else torch.zeros_like(m)
        m4, cm4 = m[None, :, None, :], cm[None, :, None, :]
        kq = (_qdq((k.float() * m4 - cm4).transpose(1, 2), self.fmt.k).transpose(1, 2) + cm4) / m4
        vc = pl.v_centre[None, :, None, :] if pl.v_centre is not None else 0.0
        vq = _qdq((v.float() - vc).transpose(1, 2), self.fmt.v).transpose(1, 2) + vc
        return super().update(kq.to(k.dtype), vq.to(v.dtype))


@pytest.mark.parametrize("family,fmt,centring,scaling", [
    ("llama", "turbo3", True, True), ("llama", "q4_0", False, False), ("qwen3", "turbo4", True, False),
    ("gemma2", "turbo2", True, True), ("gemma3", "bf16k_turbo3v", False, False),
    ("mistral", "q8_0", True, True),
])
def test_compressed_cache_equals_dense_attention_on_decoded_kv(family, fmt, centring, scaling):
    from pagedkv.formats import parse_format

    kvf = parse_format(fmt)
    model = _model(family)
    ids = _ids(20, seed=2)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    cache = PagedKVCache(model, fmt, high_precision_layers=0, key_centring=centring,
                         value_centring=centring, key_scaling=scaling, block_size=8)
    # prefill 12 tokens, then decode 8 one by one
    out = torch.cat([_logits(model, ids[:, :12], cache)] +
                    [_logits(model, ids[:, t:t + 1], cache) for t in range(12, 20)], dim=1)
    assert all((layer.k_mult is not None) == (scaling and kvf.k.name != "bf16") for layer in cache.layers)
    assert all((layer.v_centre is not None) == centring for layer in cache.layers)
    # the oracle stores decoded K/V densely, with the statistics the paged cache fixed
    model.set_attn_implementation("eager")
    oracle_cache = DynamicCache()
    oracle_cache.layers = [_QDQLayer(kvf, layer) for layer in cache.layers]
    oracle_cache.layer_class_to_replicate = None
    ref = torch.cat([_logits(model, ids[:, :12], oracle_cache)] +
                    [_logits(model, ids[:, t:t + 1], oracle_cache) for t in range(12, 20)], dim=1)
    assert (out - ref).abs().max() <= 1e-3 * ref.abs().max(), (out - ref).abs().max()
    # the cache really holds fewer bytes than bf16 would
    bf16_bytes = sum(2 * 2 * s.num_kv_heads * s.head_dim for s in cache.config.layers) * 20
    if kvf.k.name != "bf16" or kvf.v.name != "bf16":
        assert cache.bytes_per_token() * 20 < bf16_bytes


def test_channel_multipliers_minimise_the_logit_error_bound():
    from pagedkv.cache.calibration import MULT_RANGE, channel_multipliers

    torch.manual_seed(0)
    k = torch.randn(1, 2, 50, 16) * torch.linspace(0.1, 3, 16)
    q = torch.randn(1, 4, 50, 16) * torch.linspace(2, 0.5, 16)
    m = channel_multipliers(k, q)
    assert m.shape == (2, 16) and torch.allclose(m[:, :8], m[:, 8:])  # RoPE pairs share one
    assert torch.allclose(m.log().mean(-1), torch.zeros(2), atol=1e-5)
    assert float(m.max()) <= MULT_RANGE and float(m.min()) >= 1 / MULT_RANGE
    K, Q = k.pow(2).mean((0, 2)), q.reshape(1, 2, 2, 50, 16).pow(2).mean((0, 2, 3))

    def bound(mm):
        return ((mm ** 2 * K).sum(-1) * (Q / mm ** 2).sum(-1))

    assert bool((bound(m) < bound(torch.ones_like(m))).all())


def test_generate_greedy_and_beam_match_dynamic_cache():
    model = _model("llama")
    ids = _ids(6, seed=3)
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ref = model.generate(ids, **kw)
        ref_beam = model.generate(ids, num_beams=3, **kw)
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        out = model.generate(ids, cache=PagedKVCache(model, "bf16", high_precision_layers=0), **kw)
        cache = PagedKVCache(model, "bf16", high_precision_layers=0, block_size=4)
        out_beam = model.generate(ids, cache=cache, num_beams=3, **kw)
    assert out.tolist() == ref.tolist()
    assert out_beam.tolist() == ref_beam.tolist()
    batch = torch.cat([ids, _ids(6, seed=7)])  # two rows of equal length, one sequence each
    with torch.no_grad():
        model.set_attn_implementation("eager")
        ref_batch = model.generate(batch, attention_mask=torch.ones_like(batch), **kw)
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        out_batch = model.generate(batch, attention_mask=torch.ones_like(batch),
                                   cache=PagedKVCache(model, "bf16", high_precision_layers=0), **kw)
    assert out_batch.tolist() == ref_batch.tolist()
    # beam rows share blocks: each row's table is consistent with the pool's reference counts
    check_refcounts(cache)


def test_crop_then_refeed_reproduces_the_logits():
    model = _model("qwen2")
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    ids = _ids(14, seed=4)
    cache = PagedKVCache(model, "turbo4", high_precision_layers=0, block_size=4)
    full = _logits(model, ids, cache)
    cache.crop(-5)
    assert cache.get_seq_length() == 9
    again = _logits(model, ids[:, 9:], cache)
    assert torch.allclose(again, full[:, 9:], atol=1e-4, rtol=1e-4)


def test_pools_grow_and_capacity_limit():
    from pagedkv.errors import CacheFull

    model = _model("llama", ATTN_IMPLEMENTATION)
    cache = PagedKVCache(model, "turbo3", block_size=4)
    _logits(model, _ids(100), cache)  # 25 blocks > the 16 allocated at first
    assert cache.blocks.num_blocks >= 25 and cache.blocks.used == 25
    small = PagedKVCache(model, "turbo3", block_size=4, max_tokens=16)
    with pytest.raises(CacheFull):
        _logits(model, _ids(20), small)


def test_errors():
    model = _model("llama")  # eager, not pagedkv
    with pytest.raises(ConfigError, match="pagedkv"):
        PagedKVCache(model, "turbo3")
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    with pytest.raises(ConfigError, match="turbo9"):
        PagedKVCache(model, "turbo9")
    with pytest.raises(ConfigError, match="max_tokens"):
        PagedKVCache(model, "turbo3", max_tokens=0)
    ids = torch.cat([_ids(6), _ids(6, seed=9)])
    cache = PagedKVCache(model, "bf16", high_precision_layers=0, block_size=4)
    # a mask wider than the columns (fresh cache: 6 new tokens), or with the wrong batch size
    with pytest.raises(InvalidInput, match=r"attention_mask has shape \[2, 8\]; expected \[2, 6\]"):
        model(ids, attention_mask=torch.ones(2, 8, dtype=torch.long), cache=cache, use_cache=True)
    with pytest.raises(InvalidInput, match=r"expected \[2, 6\]"):
        model(ids, attention_mask=torch.ones(3, 6, dtype=torch.long), cache=cache, use_cache=True)
    assert cache.get_seq_length() == 0 and cache.blocks.used == 0 and not cache.layers[0].is_initialized
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    model(ids, attention_mask=mask, cache=cache, use_cache=True)
    assert cache.row_lengths(6) == [6, 4] and cache.blocks.used == 2 + 1
    # a mask that forgets the stored padding, or covers only the new token: refused, nothing changes
    before = (cache.get_seq_length(), [list(t) for t in cache.blocks.tables], cache.blocks.used)
    with pytest.raises(InvalidInput, match=r"marks \[6, 6\] valid past tokens per row but the "
                                           r"cache stored \[6, 4\]"):
        model(ids[:, :1], attention_mask=torch.ones(2, 7, dtype=torch.long), cache=cache, use_cache=True)
    with pytest.raises(InvalidInput, match=r"cache holds 6 columns"):
        model(ids[:, :1], attention_mask=torch.ones(2, 1, dtype=torch.long), cache=cache, use_cache=True)
    four_d = torch.zeros(2, 1, 1, 7)
    with pytest.raises(InvalidInput, match="2D attention_mask"):
        model(ids[:, :1], attention_mask=four_d, cache=cache, use_cache=True)
    assert (cache.get_seq_length(), [list(t) for t in cache.blocks.tables], cache.blocks.used) == before
    assert all(layer.pending is None and layer.length == 6 for layer in cache.layers)
    # value centring is not exact with attention sinks: refused from the first chunk on
    from pagedkv.integrations.transformers import paged_attention_forward

    vc = PagedKVCache(model, "turbo3", high_precision_layers=0, value_centring=True)
    k, v = vc.layers[0].update(torch.randn(1, 2, 5, 32), torch.randn(1, 2, 5, 32), 0)
    with pytest.raises(ConfigError, match="value centring"):
        paged_attention_forward(None, torch.randn(1, 4, 5, 32), k, v, None, s_aux=torch.zeros(4))
    assert vc.get_seq_length() == 0 and not vc.layers[0].is_initialized and vc.blocks.used == 0


def test_plain_forward_without_cache_is_exact_attention():
    model = _model("gemma2")
    ids = _ids(20, seed=5)
    ref = _logits(model, ids, None)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    out = _logits(model, ids, None)
    assert torch.allclose(out, ref, atol=1e-4, rtol=1e-4)


def test_key_centre_estimator_per_codec():
    """fp8 K: per-channel mean without the 1 + 3% tokens farthest from the median (the sink);
    other codecs: per-channel median over tokens averaged over rows (oracle: written out)."""
    from pagedkv.cache.calibration import key_centre

    g = torch.Generator().manual_seed(3)
    k = torch.randn(2, 3, 9, 8, generator=g)
    k[:, :, 0] += 50.0  # an outlier sink token: the one token dropped (1 + floor(0.27))
    want_fp8 = k[:, :, 1:].sum(dim=(0, 2)) / (2 * 8)
    torch.testing.assert_close(key_centre(k, "fp8"), want_fp8)
    assert key_centre(k, "fp8").abs().max() < 5  # the sink does not pull the centre
    want_med = torch.stack([k[0].sort(dim=1).values[:, 4], k[1].sort(dim=1).values[:, 4]]).mean(0)
    torch.testing.assert_close(key_centre(k, "turbo3"), want_med)
    one = k[:, :, :1]
    torch.testing.assert_close(key_centre(one, "fp8"), one[:, :, 0].mean(dim=0))


# ---------------------------------------------------------------------------------------------
# padded batches (left padding for generation, right padding for plain forwards)


def _left_padded(lengths, seed=11):
    """ids [B, max], mask [B, max] (left padding, pad id 0), positions from the mask as generate
    makes them."""
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, n in enumerate(lengths):
        ids[r, width - n:] = _ids(n, seed=seed + r)[0]
        mask[r, width - n:] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, pos


def _padded_run(model, cache, ids, mask, pos, steps):
    """Prefill the padded batch, then `steps` decode tokens per row (greedy from the logits);
    returns the logits [B, T + steps, V] (pad positions included)."""
    outs = []
    with torch.no_grad():
        out = model(ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True)
        outs.append(out.logits.float())
        for _ in range(steps):
            nxt = outs[-1][:, -1:].argmax(-1)
            mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
            pos = pos[:, -1:] + 1
            out = model(nxt, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True)
            outs.append(out.logits.float())
    return torch.cat(outs, dim=1), mask


@pytest.mark.parametrize("family", FAMILIES)
def test_left_padded_batch_matches_dynamic_cache(family):
    """Rows of 13, 9 and 4 tokens (longer and shorter than the Gemma window of 8), left padded,
    then 5 decode steps: every valid position's logits match eager attention on DynamicCache."""
    model = _model(family)
    ids, mask, pos = _left_padded([13, 9, 4])
    ref, full_mask = _padded_run(model, DynamicCache(config=model.config), ids, mask, pos, 5)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    cache = PagedKVCache(model, "bf16", high_precision_layers=0, block_size=4)
    out, _ = _padded_run(model, cache, ids, mask, pos, 5)
    valid = full_mask.bool()
    assert cache.get_seq_length() == 13 + 5  # columns, as transformers counts them
    assert cache.row_lengths(cache.get_seq_length()) == [18, 14, 9]
    assert [len(t) for t in cache.blocks.tables] == [5, 4, 3]  # pads take no blocks
    scale = ref[valid].abs().max()
    assert (out[valid] - ref[valid]).abs().max() <= 2e-2 * scale, (out[valid] - ref[valid]).abs().max()
    assert torch.isfinite(out).all()
    # "pagedkv" with transformers' own cache: exact dense attention, pads masked (the Gemma
    # sliding layers hand it a window of keys: the mask's kv_offset)
    dense, _ = _padded_run(model, DynamicCache(config=model.config), ids, mask, pos, 5)
    torch.testing.assert_close(dense[valid], ref[valid], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_left_padded_generate_with_chunked_prefill(family):
    """generate(prefill_chunk_size=4) on a left-padded batch: chunks made only of pads for some
    rows, then decode; same tokens as eager attention on DynamicCache."""
    model = _model(family)
    ids, mask, _ = _left_padded([13, 9, 4], seed=60)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, **kw)
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        cache = PagedKVCache(model, "bf16", high_precision_layers=0, block_size=4)
        out = model.generate(ids, attention_mask=mask, cache=cache, prefill_chunk_size=4, **kw)
    assert out.tolist() == ref.tolist()
    assert cache.row_lengths(cache.get_seq_length()) == [13 + 5, 9 + 5, 4 + 5]


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_right_padded_forward_matches_each_row_alone(family):
    """A plain forward over a right-padded batch (perplexity style): valid positions equal each
    row run alone, with the cache (bf16) and without one (exact dense attention)."""
    model = _model(family, ATTN_IMPLEMENTATION)
    lengths = [12, 7, 3]
    ids = torch.zeros(3, 12, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, n in enumerate(lengths):
        ids[r, :n], mask[r, :n] = _ids(n, seed=20 + r)[0], 1
    with torch.no_grad():
        cached = model(ids, attention_mask=mask, cache=PagedKVCache(model, "bf16", high_precision_layers=0,
                                                                    block_size=4), use_cache=True).logits
        dense = model(ids, attention_mask=mask, use_cache=False).logits
        for r, n in enumerate(lengths):
            alone = model(ids[r:r + 1, :n], cache=PagedKVCache(model, "bf16", high_precision_layers=0,
                                                               block_size=4), use_cache=True).logits[0]
            alone_dense = model(ids[r:r + 1, :n], use_cache=False).logits[0]
            torch.testing.assert_close(cached[r, :n], alone, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(dense[r, :n], alone_dense, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family,fmt,centring,scaling", [
    ("llama", "turbo3", True, True), ("gemma2", "q4_0", True, False), ("qwen3", "turbo4", True, False),
])
def test_padded_compressed_cache_equals_dense_attention_on_decoded_kv(family, fmt, centring, scaling):
    """Left-padded prefill + decode on compressed pages == dense attention on the decoded K/V
    (same statistics, fitted from the valid tokens only) at every valid position."""
    from pagedkv.formats import parse_format

    kvf = parse_format(fmt)
    model = _model(family)
    ids, mask, pos = _left_padded([11, 6, 2], seed=30)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    cache = PagedKVCache(model, fmt, high_precision_layers=0, key_centring=centring,
                         value_centring=centring, key_scaling=scaling, block_size=4)
    out, full_mask = _padded_run(model, cache, ids, mask, pos, 4)
    model.set_attn_implementation("eager")
    oracle_cache = DynamicCache()
    oracle_cache.layers = [_QDQLayer(kvf, layer) for layer in cache.layers]
    oracle_cache.layer_class_to_replicate = None
    ref, _ = _padded_run(model, oracle_cache, ids, mask, pos, 4)
    valid = full_mask.bool()
    assert (out[valid] - ref[valid]).abs().max() <= 1e-3 * ref[valid].abs().max()


def test_padded_statistics_use_valid_tokens_only():
    """The first chunk's statistics ignore pads: a batch whose pads hold huge keys gets the same
    key centre as its valid tokens alone."""
    model = _model("llama", ATTN_IMPLEMENTATION)
    ids, mask, pos = _left_padded([8, 8], seed=40)
    padded_ids = torch.cat([torch.full((2, 3), 5), ids], dim=1)
    padded_mask = torch.cat([torch.zeros(2, 3, dtype=torch.long), mask], dim=1)
    padded_pos = torch.cat([torch.zeros(2, 3, dtype=torch.long), pos], dim=1)
    a = PagedKVCache(model, "turbo3", high_precision_layers=0, key_scaling=True)
    b = PagedKVCache(model, "turbo3", high_precision_layers=0, key_scaling=True)
    with torch.no_grad():
        la = model(ids, attention_mask=mask, position_ids=pos, cache=a, use_cache=True).logits
        lb = model(padded_ids, attention_mask=padded_mask, position_ids=padded_pos, cache=b,
                   use_cache=True).logits[:, 3:]
    for x, y in zip(a.layers, b.layers):
        torch.testing.assert_close(x.paged.k_centre, y.paged.k_centre)
        torch.testing.assert_close(x.k_mult, y.k_mult)
    torch.testing.assert_close(la, lb, atol=1e-4, rtol=1e-4)
    assert b.row_lengths(11) == [8, 8] and b.get_seq_length() == 11


def test_padded_crop_reorder_and_beam():
    """crop counts columns and keeps each row's valid tokens; beam search on a padded batch
    matches eager DynamicCache beam search."""
    model = _model("qwen2")
    ids, mask, pos = _left_padded([10, 5], seed=50)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ref_beam = model.generate(ids, attention_mask=mask, num_beams=2, **kw)
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        cache = PagedKVCache(model, "bf16", high_precision_layers=0, block_size=4)
        out_beam = model.generate(ids, attention_mask=mask, cache=cache, num_beams=2, **kw)
    assert out_beam.tolist() == ref_beam.tolist()
    check_refcounts(cache)
    # crop: prefill + 4 decode steps, remove 3 columns, re-feed them: same logits
    cache = PagedKVCache(model, "turbo4", high_precision_layers=0, block_size=4)
    full, full_mask = _padded_run(model, cache, ids, mask, pos, 4)
    assert cache.row_lengths(14) == [14, 9]
    cache.crop(-3)
    assert cache.get_seq_length() == 11 and cache.row_lengths(11) == [11, 6]
    assert [len(t) for t in cache.blocks.tables] == [3, 2]
    tokens = full[:, 10:13].argmax(-1)  # the tokens fed at columns 11..13
    fpos = (full_mask.cumsum(-1) - 1)[:, 11:14]
    with torch.no_grad():
        again = model(tokens, attention_mask=full_mask, position_ids=fpos, cache=cache, use_cache=True).logits
    torch.testing.assert_close(again.float(), full[:, 11:14], atol=1e-4, rtol=1e-4)
    # reorder rows (as beam search does): each row keeps its own length
    cache.reorder_cache(torch.tensor([1, 1]))
    assert cache.row_lengths(14) == [9, 9]


def test_left_padded_generate_continues_on_the_same_cache():
    """A second generate on the same cache (the first output + new tokens, the mask extended
    with ones) slices the inputs by get_seq_length (columns) and matches DynamicCache."""
    model = _model("llama")
    ids, mask, _ = _left_padded([9, 4, 6], seed=70)
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    more = torch.randint(3, VOCAB, (3, 3), generator=torch.Generator().manual_seed(5))

    def two_rounds(cache):
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, cache=cache, **kw)
            seq = torch.cat([out, more], dim=1)
            m2 = torch.cat([mask, torch.ones(3, seq.shape[1] - mask.shape[1], dtype=mask.dtype)], dim=1)
            return model.generate(seq, attention_mask=m2, cache=cache, **kw)

    ref = two_rounds(DynamicCache(config=model.config))
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    cache = PagedKVCache(model, "bf16", high_precision_layers=0, block_size=4)
    assert two_rounds(cache).tolist() == ref.tolist()
    assert cache.get_seq_length() == 9 + 5 + 3 + 4
    assert cache.row_lengths(21) == [21, 16, 18]


def test_padded_repeat_interleave_and_select_keep_row_lengths():
    """batch_repeat_interleave / batch_select_indices on a padded cache carry each row's length:
    the next token's logits equal those of the cache they were copied from."""
    model = _model("mistral", ATTN_IMPLEMENTATION)
    ids, mask, pos = _left_padded([10, 5], seed=80)
    nxt = torch.tensor([[7], [9]])

    def step(cache, rows):
        m = torch.cat([mask[rows], torch.ones(len(rows), 1, dtype=mask.dtype)], dim=1)
        with torch.no_grad():
            return model(nxt[rows], attention_mask=m, position_ids=pos[rows, -1:] + 1, cache=cache,
                         use_cache=True).logits.float()

    def prefilled():
        cache = PagedKVCache(model, "q8_0", high_precision_layers=0, block_size=4)
        with torch.no_grad():
            model(ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True)
        return cache

    want = step(prefilled(), [0, 1])
    rep = prefilled()
    rep.batch_repeat_interleave(2)
    assert rep.row_lengths(10) == [10, 10, 5, 5]
    torch.testing.assert_close(step(rep, [0, 0, 1, 1]), want[[0, 0, 1, 1]], atol=1e-5, rtol=1e-5)
    sel = prefilled()
    sel.batch_select_indices(torch.tensor([1]))
    assert sel.row_lengths(10) == [5]
    torch.testing.assert_close(step(sel, [1]), want[[1]], atol=1e-5, rtol=1e-5)


def test_heap_scratch_released_once_per_layer_after_its_statistics(monkeypatch):
    """The first-chunk statistics' temporaries are returned once per layer, when it fixes its
    statistics (not on later chunks)."""
    import pagedkv.heap

    calls = []
    monkeypatch.setattr(pagedkv.heap, "_TRIM", lambda pad: calls.append(pad))
    model = _model("llama", ATTN_IMPLEMENTATION)
    cache = PagedKVCache(model, "turbo3", high_precision_layers=0)
    ids = torch.randint(3, 100, (1, 12))
    with torch.no_grad():
        model(ids[:, :8], cache=cache, use_cache=True)
        assert calls == [0] * len(cache.layers)
        model(ids[:, 8:], cache=cache, use_cache=True)
    assert calls == [0] * len(cache.layers)
