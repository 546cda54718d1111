"""Padded batches on the embedded SmolLM2 (real weights, offline): left-padded `generate` and
right-padded plain forwards with the paged cache.

Oracles: each prompt run alone with the same cache (pads must change nothing: only valid tokens
are stored, each row attends to its own pages), and transformers' DynamicCache + sdpa on the same
padded batch. For compressed formats the batch shares one set of first-chunk statistics (key
centre, fp8 scales: fitted from all rows' valid tokens), so the rows-alone oracle is given the
batch's statistics (`_replayed_calibration`); then the stored codes are byte-identical.
Loading takes ~15-20 s; every test shares one model.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gguf")
from helpers.cache_checks import check_refcounts  # noqa: E402
from pagedkv.eval.model import load_model, resolve_model_source  # noqa: E402

pytestmark = pytest.mark.model

# 5, 17 and 23 tokens. Greedy top-1 minus top-2 logit margins over the 12 new tokens are >= 0.2
# for each (bf16 cache), far above the ~0.02 that bf16 K/V rounding or batch-shape matmul
# rounding moves a logit, so exact token equality is a sound oracle (bf16: " Paris.\n\nThe answer
# is: 201", " Berlin.\nB: The capital of Germany is Berlin.", " 9, 10, 11, ...").
PROMPTS = ["The capital of France is", "Q: What is the capital of Germany?\nA: The capital of Germany is",
           "1, 2, 3, 4, 5, 6, 7, 8,"]
NEW = 12


def _same_generation(batch_new: list[int], alone_new: list[int], pad: int) -> bool:
    """A row of the batch continues with pads after its EOS where the row alone stops."""
    return batch_new[:len(alone_new)] == alone_new and all(t == pad for t in batch_new[len(alone_new):])


@pytest.fixture(scope="module")
def lm():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        source = resolve_model_source(None)
    except Exception as exc:  # pragma: no cover - depends on the install
        pytest.skip(f"embedded model not installed: {exc}")
    loaded = load_model(source, attn_implementation="pagedkv")
    loaded.tokenizer.padding_side = "left"
    return loaded


def _kw(tok, **extra):
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    return dict(max_new_tokens=NEW, do_sample=False, pad_token_id=pad, **extra)


def _generate(model, enc, cache, **kw):
    with torch.inference_mode():
        return model.generate(enc["input_ids"], attention_mask=enc["attention_mask"], cache=cache, **kw)


class _replayed_calibration:
    """Record the first-chunk statistics a run fits (one `calibrate` call per layer, in layer
    order), then hand the same ones to later runs."""

    def __init__(self, monkeypatch):
        import pagedkv.cache.calibration as integ  # where the engine looks `calibrate` up

        self.integ, self.monkeypatch, self.fitted = integ, monkeypatch, []
        self.original = integ.calibrate

    def record(self):
        def fit(*args, **kwargs):
            self.fitted.append(self.original(*args, **kwargs))
            return self.fitted[-1]
        self.monkeypatch.setattr(self.integ, "calibrate", fit)

    def replay(self):
        queue = list(self.fitted)
        self.monkeypatch.setattr(self.integ, "calibrate", lambda *a, **k: queue.pop(0))


def _row_bytes(cache, row: int) -> list[bytes]:
    """Per layer: the bytes of row `row`'s blocks (K then V), in table order."""
    ids = torch.tensor(cache.blocks.tables[row])
    return [bytes(layer.paged.k_pool[ids].flatten().tolist()) +
            bytes(layer.paged.v_pool[ids].flatten().tolist()) for layer in cache.layers]


def _sdpa_reference(model, enc, **kw):
    """The same generation with transformers' DynamicCache and SDPA attention (the oracle)."""
    from transformers import DynamicCache

    model.set_attn_implementation("sdpa")
    try:
        return _generate(model, enc, DynamicCache(config=model.config), **kw)
    finally:
        model.set_attn_implementation("pagedkv")


def test_left_padded_greedy_bf16_equals_rows_alone_and_sdpa(lm):
    from pagedkv.integrations.transformers import PagedKVCache

    tok, model = lm.tokenizer, lm.model
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    lengths = enc["attention_mask"].sum(1).tolist()
    width = enc["input_ids"].shape[1]
    assert len(set(lengths)) == 3  # three different lengths: rows 0 and 1 are left padded
    kw = _kw(tok)
    cache = PagedKVCache(model, "bf16", high_precision_layers=0)
    out = _generate(model, enc, cache, **kw)
    assert cache.get_seq_length() == width + NEW - 1  # columns, pads included (what generate uses)
    assert cache.row_lengths(width + NEW - 1) == [n + NEW - 1 for n in lengths]  # pads are not stored
    for r, prompt in enumerate(PROMPTS):
        alone = _generate(model, tok([prompt], return_tensors="pt"),
                          PagedKVCache(model, "bf16", high_precision_layers=0), **kw)
        new_alone = alone[0, lengths[r]:].tolist()
        assert _same_generation(out[r, width:].tolist(), new_alone, kw["pad_token_id"]), r
    ref = _sdpa_reference(model, enc, **kw)
    assert out.tolist() == ref.tolist()


def test_left_padded_turbo3_stores_the_same_codes_as_rows_alone(lm, monkeypatch):
    """With the batch's statistics, each row alone stores byte-identical prompt pages and
    generates the same tokens.

    Decode steps' pages are not compared byte for byte: torch's fp32 matmul rounds a row
    differently for 3 rows than for 1 (k_proj on identical inputs differs by ~1e-6), which can
    flip an 8-bit code of the q8_0 first/last layers; the CPU kernel's split count also depends on
    the batch when it runs on more than one thread (~1e-7). Neither comes from the padding."""
    from pagedkv.integrations.transformers import PagedKVCache

    tok, model = lm.tokenizer, lm.model
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    lengths = enc["attention_mask"].sum(1).tolist()
    width = enc["input_ids"].shape[1]
    kw = _kw(tok)
    stats = _replayed_calibration(monkeypatch)
    stats.record()
    prompt_cache = PagedKVCache(model, "turbo3")
    _generate(model, enc, prompt_cache, **dict(kw, max_new_tokens=1))  # stores the prompts only
    fitted = list(stats.fitted)
    assert len(fitted) == len(prompt_cache.layers)
    out = _generate(model, enc, PagedKVCache(model, "turbo3"), **kw)  # same statistics again
    for r, prompt in enumerate(PROMPTS):
        stats.fitted = list(fitted)
        stats.replay()
        alone_cache = PagedKVCache(model, "turbo3")
        _generate(model, tok([prompt], return_tensors="pt"), alone_cache, **dict(kw, max_new_tokens=1))
        assert _row_bytes(prompt_cache, r) == _row_bytes(alone_cache, 0), r
        stats.fitted = list(fitted)
        stats.replay()
        alone = _generate(model, tok([prompt], return_tensors="pt"), PagedKVCache(model, "turbo3"), **kw)
        new_alone = alone[0, lengths[r]:].tolist()
        assert _same_generation(out[r, width:].tolist(), new_alone, kw["pad_token_id"]), r


def test_right_padded_forward_logits_equal_rows_alone(lm, monkeypatch):
    from pagedkv.integrations.transformers import PagedKVCache

    tok, model = lm.tokenizer, lm.model
    tok.padding_side = "right"
    try:
        enc = tok(PROMPTS, return_tensors="pt", padding=True)
    finally:
        tok.padding_side = "left"
    lengths = enc["attention_mask"].sum(1).tolist()
    stats = _replayed_calibration(monkeypatch)
    with torch.inference_mode():
        for fmt, kwargs in [("bf16", dict(high_precision_layers=0)), ("turbo3", {})]:
            if fmt == "turbo3":
                stats.record()
            batch = model(**enc, cache=PagedKVCache(model, fmt, **kwargs), use_cache=True).logits.float()
            assert torch.isfinite(batch).all()
            for r, n in enumerate(lengths):
                if fmt == "turbo3":
                    stats.replay()
                alone = model(enc["input_ids"][r:r + 1, :n], cache=PagedKVCache(model, fmt, **kwargs),
                              use_cache=True).logits.float()[0]
                # Same computation, but torch's fp32 matmul rounds a row differently for 5 rows
                # than for 45 (~1e-6 on k_proj with identical inputs), which can flip the rounding
                # of a few stored K/V elements (one bf16 ulp, 2^-8 relative): measured up to
                # 5e-4 x max|logit|. Attending to pads or to another row's tokens gives ~0.2.
                err = float((batch[r, :n] - alone).abs().max())
                assert err <= 2e-3 * float(alone.abs().max()), (fmt, r, err)


def test_left_padded_beam_search_bf16_equals_sdpa(lm):
    from pagedkv.integrations.transformers import PagedKVCache

    tok, model = lm.tokenizer, lm.model
    enc = tok(PROMPTS[:2], return_tensors="pt", padding=True)
    kw = _kw(tok, num_beams=2)
    kw["max_new_tokens"] = 8
    cache = PagedKVCache(model, "bf16", high_precision_layers=0)
    out = _generate(model, enc, cache, **kw)
    ref = _sdpa_reference(model, enc, **kw)
    assert out.tolist() == ref.tolist()
    check_refcounts(cache)
