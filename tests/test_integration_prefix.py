"""Prefix caching across `generate` calls in the transformers drop-in, on the embedded SmolLM2.

Two chat prompts share SmolLM2's system prompt. After the first `generate`, `cache.begin(ids2)`
finds the shared whole blocks; the second `generate` then runs the model on the other tokens only
(counted by a forward hook) and produces the same tokens as without the hits: exactly the bf16
DynamicCache tokens for bf16 K/V, and for turbo3 the same tokens as the same cache (same
first-chunk statistics) computing the whole prompt (`begin(..., reuse=False)`).
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gguf")
from pagedkv.eval.model import embedded_model_source, load_model  # noqa: E402

pytestmark = pytest.mark.model
KW = dict(max_new_tokens=12, do_sample=False)


@pytest.fixture(scope="module")
def lm():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        source = embedded_model_source()
    except Exception as exc:  # pragma: no cover - depends on the install
        pytest.skip(f"embedded model not installed: {exc}")
    out = load_model(source, attn_implementation="sdpa")
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


@pytest.mark.parametrize("fmt", ["bf16", "turbo3"])
def test_second_generate_reuses_the_shared_system_prompt(lm, fmt):
    from transformers import DynamicCache

    from pagedkv.integrations.transformers import PagedKVCache

    tok, model = lm.tokenizer, lm.model
    ids1, ids2 = _chat(tok, "What is a Python decorator?"), _chat(tok, "Why is the sky blue?")
    shared = _shared(ids1, ids2)
    assert shared >= 32
    kw = dict(KW, pad_token_id=tok.eos_token_id)
    with torch.inference_mode():
        cache = PagedKVCache(model, fmt)
        first = model.generate(ids1, cache=cache, **kw)
        hits = cache.begin(ids2)
        assert hits == shared // 16 * 16 and cache.get_seq_length() == hits
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
            again = PagedKVCache(model, fmt)
            assert model.generate(ids1, cache=again, **kw).tolist() == first.tolist()
            assert again.begin(ids2, reuse=False) == 0
            ref = model.generate(ids2, cache=again, **kw)
    assert out.tolist() == ref.tolist()
