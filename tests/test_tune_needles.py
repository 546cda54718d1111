"""The needle rows of `pagedkv tune` (`pagedkv.tune.needles`): facts hidden in the calibration
window, asked at its end, and the end-to-end (gradient) sensitivity of their answers.

Oracles: the window's own tokens (every answer row predicts the digits its fact holds, the text
keeps its order), finite differences of the answers' loss (the gradient the sensitivity squares),
the definition of the combination (invariant to each measure's unit), and the budget.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from pagedkv.codecs.catalogue import get_codec  # noqa: E402
from pagedkv.errors import ConfigError  # noqa: E402
from pagedkv.tune import needles as nd  # noqa: E402
from pagedkv.tune import tune  # noqa: E402

from helpers.tiny_llama import peaked_llama  # noqa: E402

VOCAB = 96


def encode(text: str) -> list[int]:
    return [3 + ord(c) % (VOCAB - 3) for c in text]


DIGIT_IDS = {encode(d)[0]: d for d in "0123456789"}


def test_the_window_hides_each_fact_and_asks_it_at_the_end():
    ids = [1] + [50 + i % 40 for i in range(1999)]
    window, rows = nd.needle_window(encode, ids, needles=4)
    assert len(window) == len(ids) and window[0] == 1
    assert (window, rows) == nd.needle_window(encode, ids, needles=4)  # deterministic
    runs = [[rows[0]]]
    for r in rows[1:]:
        (runs[-1].append(r) if r == runs[-1][-1] + 1 else runs.append([r]))
    assert len(runs) == 4 and all(len(a) == nd.DIGITS + 1 for a in runs)  # " NNNNN": a space, the digits
    assert runs[-1][-1] + 3 >= len(window) - 1  # the last answer ends the window
    for a in runs:  # the digits each answer row predicts are its fact's value, told before the questions
        value = [window[r + 1] for r in a[1:]]
        assert all(t in DIGIT_IDS for t in value)
        at = [i for i in range(len(window)) if window[i:i + nd.DIGITS] == value]
        assert len(at) == 2 and at[1] == a[1] + 1 and at[0] < runs[0][0] - 20
    assert ids[:60] == window[:60]  # the text before the first fact (at depth 0.05) is the window's own


@pytest.mark.parametrize("needles, tokens, word", [(0, 2000, "needles"), (len(nd.WORDS) + 1, 2000, "needles"),
                                                  (8, 300, "too short")])
def test_bad_needle_counts_and_short_windows_are_refused(needles, tokens, word):
    with pytest.raises(ConfigError, match=word):
        nd.needle_window(encode, [1] * tokens, needles=needles)


def _loss_with_key_offset(model, window, rows, layer, offset):
    """The answers' NLL with `offset` added to layer `layer`'s keys (a patched attention)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def shifted(module, query, key, value, attention_mask, **kw):
        if int(module.layer_idx) == layer:
            key = key + offset[None].to(key.dtype)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register("test_shift", shifted)
    AttentionMaskInterface.register("test_shift", sdpa_mask)
    model.set_attn_implementation("test_shift")
    try:
        ids = torch.tensor([window])
        at = torch.tensor(rows)
        with torch.no_grad():
            logits = model(ids, use_cache=False).logits[0, at].double()
        return float(-torch.log_softmax(logits, -1).gather(-1, ids[0, at + 1, None]).sum())
    finally:
        model.set_attn_implementation("sdpa")


def test_the_sensitivity_squares_the_gradient_of_the_answers_loss():
    """Finite differences of the answers' loss along a direction d of one layer's keys give
    sum(g * d); the sensitivity of a codec is sum(g^2 e^2) with e its round-trip error, so a
    codec whose error is d scaled by s on one element gives g^2 s^2 there (checked through the
    ladder's ordering and against the recovered gradient)."""
    model = peaked_llama(pagedkv_attention=False, num_hidden_layers=2, max_position_embeddings=1024).double()
    model.set_attn_implementation("sdpa")
    window, rows = nd.needle_window(encode, [1] + [50 + i % 40 for i in range(799)], needles=2)
    ladder = [get_codec(c) for c in ("turbo2", "turbo4", "q8_0")]
    grads = nd.needle_gradients(model, window, rows)
    errors = nd.needle_errors(model, window, rows, ladder)
    assert len(errors) == 2
    with torch.inference_mode():  # as the eval's tunedB@N may call it
        assert nd.needle_errors(model, window, rows, ladder) == errors
    for layer in range(2):
        _, k, _, gk, _ = grads[layer]
        torch.manual_seed(layer)
        d = torch.randn_like(k)
        eps = 1e-3  # the model computes RoPE in float32: a smaller step meets its rounding
        plus = _loss_with_key_offset(model, window, rows, layer, eps * d)
        minus = _loss_with_key_offset(model, window, rows, layer, -eps * d)
        fd = (plus - minus) / (2 * eps)
        assert fd == pytest.approx(float((gk.double() * d).sum()), rel=5e-3, abs=1e-5)
        row = errors[layer]
        assert row["k"]["turbo2"] > row["k"]["turbo4"] > row["k"]["q8_0"] >= 0
        assert row["v"]["turbo2"] > row["v"]["turbo4"] > row["v"]["q8_0"] >= 0


def test_the_combination_weighs_both_measures_the_same_whatever_their_units():
    text = [{"k": {"a": 4.0, "b": 1.0}, "v": {"a": 2.0, "b": 0.5}}, {"k": {"a": 2.0, "b": 1.0}, "v": {"a": 2.0, "b": 1.0}}]
    needle = [{"k": {"a": 30.0, "b": 3.0}, "v": {"a": 1.0, "b": 0.1}}, {"k": {"a": 8.0, "b": 2.0}, "v": {"a": 1.0, "b": 0.5}}]
    got = nd.combine(text, needle)
    # totals at the cheapest rung ("a", the largest error): text 10, needle 40
    assert got[0]["k"]["a"] == pytest.approx(4 / 10 + 30 / 40)
    assert got[1]["v"]["b"] == pytest.approx(1 / 10 + 0.5 / 40)
    scaled = nd.combine([{s: {c: 1e6 * e for c, e in r[s].items()} for s in r} for r in text],
                        [{s: {c: 1e-9 * e for c, e in r[s].items()} for s in r} for r in needle])
    assert json.dumps(scaled, sort_keys=True) == json.dumps(got, sort_keys=True) or all(
        scaled[i][s][c] == pytest.approx(got[i][s][c]) for i in range(2) for s in "kv" for c in "ab")


class CharTokenizer:
    bos_token_id = 1

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": encode(text)}


def test_a_plan_with_needles_records_them_and_keeps_its_budget():
    model = peaked_llama(pagedkv_attention=False, num_hidden_layers=2, max_position_embeddings=1024)
    model.set_attn_implementation("sdpa")
    tok = CharTokenizer()
    ladder = ("turbo2", "turbo3", "turbo4", "q8_0")
    plain = tune(model, tok, bits=3.5, tokens=800, context=800, ladder=ladder)
    doc = tune(model, tok, bits=3.5, tokens=800, context=800, ladder=ladder, needles=2)
    again = tune(model, tok, bits=3.5, tokens=800, context=800, ladder=ladder, needles=2)
    assert json.dumps(doc, sort_keys=True) == json.dumps(again, sort_keys=True)
    assert doc["needles"] == 2 and doc["needle_tokens"] == 800 and len(doc["needle_sensitivity"]) == 2
    assert "needles" not in plain
    assert doc["bits_per_element"] <= 3.5 + 1e-9
    assert model.config._attn_implementation == "sdpa"  # restored


def test_the_capture_and_the_needle_gradient_compute_only_what_they_read():
    """The LM head of a long window is the forward's largest tensor (Gemma-3 at 16k: 17 GB): the
    capture reads no logits and the needle gradient those of its answer rows only, and no
    weight's gradient."""
    from pagedkv.tune.sensitivity import capture

    model = peaked_llama(pagedkv_attention=False, num_hidden_layers=2, max_position_embeddings=1024)
    model.set_attn_implementation("sdpa")
    window, rows = nd.needle_window(encode, [1] + [50 + i % 40 for i in range(799)], needles=2)
    seen = []
    mark = torch.ones_like(model.lm_head.weight)
    model.lm_head.weight.grad = mark.clone()  # a user's gradient: neither added to nor cleared
    hook = model.lm_head.register_forward_hook(lambda m, i, o: seen.append(tuple(i[0].shape)))
    try:
        layers = capture(model, torch.tensor([window]))
        nd.needle_gradients(model, window, rows)
    finally:
        hook.remove()
    assert len(layers) == 2 and layers[0][1].shape[1] == len(window)
    assert seen == [(1, 1, model.config.hidden_size), (1, len(rows), model.config.hidden_size)]
    # nor a weight gradient: the weights are left as they were (trainable, no .grad)
    assert all(p.requires_grad for p in model.parameters())
    assert torch.equal(model.lm_head.weight.grad, mark)
    assert all(p.grad is None for n, p in model.named_parameters() if n != "lm_head.weight")
