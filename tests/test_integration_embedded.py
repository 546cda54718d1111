"""The drop-in on the embedded SmolLM2 (real weights, offline): bf16 pagedkv cache == DynamicCache.

Loading takes ~15-20 s; both tests share one model.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gguf")
from helpers.embedded import embedded_lm  # noqa: E402

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def lm():
    return embedded_lm()


def test_greedy_generation_bf16_cache_equals_dynamic_cache(lm):
    from transformers import DynamicCache

    from pagedkv.integrations.transformers import PagedKVCache, enable

    tok, model = lm.tokenizer, lm.model
    ids = tok.apply_chat_template([{"role": "user", "content": "What is a Python decorator?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    kw = dict(max_new_tokens=24, do_sample=False, pad_token_id=tok.eos_token_id)
    model.set_attn_implementation("sdpa")
    with torch.inference_mode():
        ref = model.generate(ids, cache=DynamicCache(config=model.config), **kw)
        enable(model)
        cache = PagedKVCache(model, "bf16", high_precision_layers=0)
        out = model.generate(ids, cache=cache, **kw)
    model.set_attn_implementation("sdpa")
    assert out.tolist() == ref.tolist()
    assert cache.get_seq_length() == out.shape[1] - 1  # the last token is never fed back


def test_bf16_perplexity_equals_dynamic_cache_perplexity(lm):
    from transformers import DynamicCache

    from pagedkv.eval.metrics import log_probs, nll_sum
    from pagedkv.eval.text import bos_id, default_text, make_windows, tokenize
    from pagedkv.integrations.transformers import PagedKVCache, enable

    tok, model = lm.tokenizer, lm.model
    text = default_text()[:20000]
    (window,) = make_windows(tokenize(tok, text), 1, 256, bos_id(tok))
    model.set_attn_implementation("sdpa")
    with torch.inference_mode():
        ref = model(window[None], cache=DynamicCache(config=model.config), use_cache=True).logits[0, :-1]
        enable(model)
        out = model(window[None], cache=PagedKVCache(model, "bf16", high_precision_layers=0),
                    use_cache=True).logits[0, :-1]
    model.set_attn_implementation("sdpa")
    ppl_ref = math.exp(nll_sum(log_probs(ref), window[1:]) / 255)
    ppl = math.exp(nll_sum(log_probs(out), window[1:]) / 255)
    assert abs(ppl - ppl_ref) / ppl_ref < 1e-3, (ppl, ppl_ref)
