"""`pagedkv tune`: sensitivities on calibration text, the greedy plan, plan files as KV formats.

Oracles: a brute-force search over every plan of a small synthetic problem (the greedy must stay
within the budget and reach the optimum there), the budget itself, determinism (two runs, same
file), and the text the tokenizer was given (the standard-library docstrings, never the eval
text, which is made to fail if read).
"""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pagedkv.codecs import CODECS  # noqa: E402
from pagedkv.errors import ConfigError  # noqa: E402
from pagedkv.eval.runner import parse_choice  # noqa: E402
from pagedkv.formats import read_plan  # noqa: E402
from pagedkv.integrations.transformers import ATTN_IMPLEMENTATION, PagedKVCache  # noqa: E402
from pagedkv.integrations.vllm.fit import calibration_text  # noqa: E402
from pagedkv.ops.recent import RecentWindow  # noqa: E402
from pagedkv.tune import WINDOW_CANDIDATES, tune  # noqa: E402
from pagedkv.tune.choose import choose, write_plan  # noqa: E402

from helpers.tiny_llama import peaked_llama  # noqa: E402

VOCAB = 96


class CharTokenizer:
    """Characters -> ids; remembers the texts it was given."""

    bos_token_id = 1

    def __init__(self):
        self.seen = []

    def __call__(self, text, add_special_tokens=False):
        self.seen.append(text)
        return {"input_ids": [3 + ord(c) % (VOCAB - 3) for c in text]}


def _model():
    return peaked_llama(pagedkv_attention=False, vocab_size=VOCAB, hidden_size=128, num_hidden_layers=3,
                        num_attention_heads=4, head_dim=32)


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    import pagedkv.eval.text as eval_text

    saved = eval_text.default_text
    eval_text.default_text = lambda: (_ for _ in ()).throw(AssertionError("tune read the eval text"))
    try:
        model, tok = _model(), CharTokenizer()
        docs = [tune(model, tok, bits=4.0, tokens=96, ladder=("turbo2", "turbo3", "turbo4", "q8_0"))
                for _ in range(2)]
        low = tune(model, tok, bits=3.5, tokens=96, ladder=("turbo2", "turbo3", "turbo4", "q8_0"),
                   recent=RecentWindow(16, "q8_0"), context=256)
    finally:
        eval_text.default_text = saved
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    write_plan(str(path), docs[0])
    return model, tok, docs, low, str(path)


def test_deterministic_within_budget_and_never_the_eval_text(plans):
    model, tok, docs, low, _ = plans
    assert json.dumps(docs[0], sort_keys=True) == json.dumps(docs[1], sort_keys=True)
    assert set(tok.seen) == {calibration_text()} and docs[0]["calibration_text"] == "stdlib-docstrings"
    assert docs[0]["bits_per_element"] <= 4.0 + 1e-9
    tail = 16 * 8.5 / 256  # the recent window's q8_0 tail blocks at 256 tokens
    assert low["bits_per_element"] + tail <= 3.5 + 1e-9 and low["recent_window"] == {"tokens": 16, "codec": "q8_0"}
    spent = {c: 0 for c in ("turbo2", "turbo3", "turbo4", "q8_0")}
    for e in docs[0]["layers"]:
        spent[e["k"]] += 1
        spent[e["v"]] += 1
    assert spent["turbo2"] < 6  # the budget above the cheapest plan was spent


def test_greedy_reaches_the_brute_force_optimum_on_a_small_problem():
    ladder = [CODECS[c] for c in ("turbo2", "turbo3", "turbo4")]
    errors = [{"k": {"turbo2": 0.5, "turbo3": 0.1, "turbo4": 0.03}, "v": {"turbo2": 0.08, "turbo3": 0.03, "turbo4": 0.01}},
              {"k": {"turbo2": 0.05, "turbo3": 0.02, "turbo4": 0.006}, "v": {"turbo2": 0.2, "turbo3": 0.05, "turbo4": 0.015}}]
    dims = [(2, 64), (2, 64)]
    for bits in (2.5, 3.0, 3.5, 4.0):
        got = choose(errors, ladder, dims, bits)
        cost = lambda f: (f.k.bits_per_element + f.v.bits_per_element) / 2  # noqa: E731
        err = lambda fs: sum(errors[i]["k"][f.k.name] + errors[i]["v"][f.v.name] for i, f in enumerate(fs))  # noqa: E731
        assert sum(map(cost, got)) / 2 <= bits + 1e-9
        best = min(err([type(got[0])(a, b), type(got[0])(c, d)])
                   for a, b, c, d in itertools.product(ladder, repeat=4)
                   if (a.bits_per_element + b.bits_per_element + c.bits_per_element + d.bits_per_element) / 4 <= bits)
        assert err(got) == pytest.approx(best), bits
    with pytest.raises(ConfigError, match="cheapest plan"):
        choose(errors, ladder, dims, 2.0)


def test_a_plan_file_is_a_kv_format_in_every_python_front_door(plans, tmp_path):
    model, _, docs, low, path = plans
    want = [(e["k"], e["v"]) for e in docs[0]["layers"]]
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    cache = PagedKVCache(model, path)
    assert [(s.format.k.name, s.format.v.name) for s in cache.config.layers] == want
    with torch.no_grad():
        out = model(torch.randint(3, VOCAB, (1, 20)), cache=cache, use_cache=True).logits
    assert torch.isfinite(out).all()
    choice = parse_choice(path)
    assert choice.label == "plan.json" and choice.recent is None
    lowpath = tmp_path / "low.json"
    write_plan(str(lowpath), low)
    assert PagedKVCache(model, str(lowpath)).recent_window == RecentWindow(16, "q8_0")
    assert parse_choice(str(lowpath)).recent == RecentWindow(16, "q8_0")


def test_plan_files_are_validated_against_the_layout(plans, tmp_path):
    model, _, docs, _, path = plans
    with pytest.raises(ConfigError, match="3 layers"):
        read_plan(path, [(2, 32)] * 4)
    with pytest.raises(ConfigError, match="3 layers"):
        read_plan(path, [(4, 32)] * 3)
    bad = tmp_path / "bad.json"
    bad.write_text('{"layers": []}')
    with pytest.raises(ConfigError, match="not a pagedkv plan"):
        PagedKVCache(model, str(bad))
    bad.write_text("{")
    with pytest.raises(ConfigError, match="cannot be read"):
        parse_choice(str(bad))


@pytest.mark.parametrize("argv, word", [
    (["tune", "--bits", "3.5", "--out", "plan.txt"], "--out"),
    (["tune", "--bits", "0", "--out", "p.json"], "--bits"),
    (["tune", "--bits", "3.5", "--recent", "x64", "--out", "p.json"], "--recent"),
    (["tune", "--bits", "3.5", "--needles", "99", "--out", "p.json"], "--needles"),
    (["tune", "--bits", "3.5", "--needles", "-1", "--out", "p.json"], "--needles"),
])
def test_cli_bad_input_is_one_line_exit_2(argv, word, capsys):
    from pagedkv.cli.main import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and word in err


def test_window_masked_attention_matches_a_per_query_oracle():
    """The sensitivity's window attention: per query, keys/values under the window come from the
    high-precision copy, the others from the quantized one, one causal softmax (a loop oracle)."""
    from pagedkv.tune.sensitivity import _attention, window_mask

    gen = torch.Generator().manual_seed(3)
    t, d = 23, 16
    q, k, v, kh, vh = (torch.randn(s, t, d, generator=gen) for s in (4, 2, 2, 2, 2))
    mask = window_mask(t, 5, 3)
    assert mask[10].tolist() == [j < 3 or j > 5 for j in range(t)]
    got = _attention(q, k, v, (mask, kh, vh))
    want = torch.empty_like(got)
    for h in range(4):
        for p in range(t):
            use = mask[p, :p + 1, None]
            kk = torch.where(use, kh[h // 2, :p + 1], k[h // 2, :p + 1])
            vv = torch.where(use, vh[h // 2, :p + 1], v[h // 2, :p + 1])
            want[h, p] = torch.softmax(kk @ q[h, p] / d ** 0.5, 0) @ vv
    assert torch.allclose(got, want, atol=1e-5)
    nothing = torch.zeros(t, t, dtype=torch.bool)
    assert torch.allclose(_attention(q, k, v, (nothing, kh, vh)), _attention(q, k, v), atol=1e-5)


def test_window_search_is_deterministic_in_budget_and_picks_the_least_predicted_error(plans, monkeypatch):
    import pagedkv.eval.text as eval_text
    from pagedkv.eval.runner import tail_tokens

    model, tok, *_ = plans
    monkeypatch.setattr(eval_text, "default_text", lambda: (_ for _ in ()).throw(AssertionError("eval text")))
    ladder = ("turbo2g64", "turbo2", "turbo3", "turbo4", "q8_0")
    docs = [tune(model, tok, bits=3.5, tokens=96, ladder=ladder, recent="auto", context=512) for _ in range(2)]
    assert json.dumps(docs[0], sort_keys=True) == json.dumps(docs[1], sort_keys=True)
    doc = docs[0]
    search = doc["window_search"]
    assert len(search) == len(WINDOW_CANDIDATES)
    fits = [s for s in search if s["fits"]]
    assert doc["recent_window"] == min(fits, key=lambda s: s["predicted_error"])["recent_window"]
    w = doc["recent_window"]
    if w is not None:
        recent = parse_choice(f"turbo3+r{w['tokens']}s{w.get('sinks', 0)}{w['codec']}").recent
        tail = tail_tokens(recent, 512, 16) / 512 * CODECS[w["codec"]].bits_per_element
        assert doc["tail_bits"] == pytest.approx(tail) and tail > 0
    assert doc["bits_per_element"] + doc["tail_bits"] <= 3.5 + 1e-9
    with_window = [s for s in fits if s["recent_window"] is not None]
    assert with_window and all(s["tail_bits"] > 0 for s in with_window)


def test_eval_tuned_label_is_the_plan_tune_makes(plans, tmp_path):
    """`tuned3.5` in `pagedkv eval`: the plan `tune(..., bits=3.5, recent="auto")` makes for the
    model (counted at the eval's window length), evaluated as that plan file."""
    from pagedkv.eval.config import EvalConfig
    from pagedkv.eval.runner import evaluate
    from pagedkv.eval.text import make_windows

    model, tok, *_ = plans
    windows = make_windows(torch.randint(3, VOCAB, (300,)), 2, 64, bos=1)
    cfg = EvalConfig(formats=("bf16", "tuned3.5", "turbo3"), windows=2, window_tokens=64, memory_bytes=2**20,
                     decode_steps=0)
    assert parse_choice("tuned3.5").tune_bits == 3.5
    with pytest.raises(ConfigError, match="tokenizer"):
        evaluate(model, windows, cfg)
    rows = {r["format"]: r for r in evaluate(model, windows, cfg, tokenizer=tok)}
    doc = tune(model, tok, bits=3.5, recent="auto", context=64)
    tuned = rows["tuned3.5"]
    assert tuned["bits_per_element"] == pytest.approx(doc["bits_per_element"] + doc["tail_bits"])
    assert tuned["bits_per_element"] <= 3.5 + 1e-9 and tuned["kl"] > 0
    plan = tmp_path / "p.json"
    write_plan(str(plan), doc)
    again = {r["format"]: r for r in evaluate(model, windows, dataclasses.replace(cfg, formats=("bf16", str(plan))))}
    assert again["p.json"]["kl"] == tuned["kl"] and again["p.json"]["bits_per_element"] == tuned["bits_per_element"]


def test_window_errors_equal_the_masked_attention_per_window():
    """The shared-logits window_errors against `_attention` with each window's mask and round trips."""
    from pagedkv.ops.recent import RecentWindow
    from pagedkv.tune.sensitivity import _attention, _fit_roundtrip, _tail_roundtrip, window_errors, window_mask

    gen = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(4, 40, 32, generator=gen), torch.randn(2, 40, 32, generator=gen), torch.randn(2, 40, 32, generator=gen)
    ladder = [CODECS["turbo2"], CODECS["turbo3"]]
    windows = [None, RecentWindow(8, "q8_0"), RecentWindow(8, "q8_0", sinks=4), RecentWindow(16, "bf16", sinks=16)]
    got = window_errors([(q, k, v)], ladder, windows)
    exact = _attention(q, k, v)
    norm = float(exact.square().mean())
    for w, rows in zip(windows, got):
        for c in ladder:
            kq, vq, kc, vc = _fit_roundtrip(c, k, v, q)
            hk = hv = None
            if w is not None:
                m = window_mask(40, w.tokens, w.sinks)
                hk, hv = (m, _tail_roundtrip(w.codec, k, kc), v), (m, k, _tail_roundtrip(w.codec, v, vc))
            want_k = float((_attention(q, kq, v, hk) - exact).square().mean()) / norm
            want_v = float((_attention(q, k, vq, hv) - exact).square().mean()) / norm
            assert rows[0]["k"][c.name] == pytest.approx(want_k, rel=1e-4)
            assert rows[0]["v"][c.name] == pytest.approx(want_v, rel=1e-4)
    assert got[2][0]["k"]["turbo2"] < got[1][0]["k"]["turbo2"] < got[0][0]["k"]["turbo2"]


def test_a_plan_with_sinks_round_trips_through_the_python_front_doors(plans, tmp_path):
    model, _, docs, _, _ = plans
    doc = dict(docs[0], recent_window={"tokens": 16, "codec": "q8_0", "sinks": 4})
    path = tmp_path / "sinks.json"
    write_plan(str(path), doc)
    want = RecentWindow(16, "q8_0", sinks=4)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    cache = PagedKVCache(model, str(path))
    assert cache.recent_window == want and parse_choice(str(path)).recent == want
    with torch.no_grad():
        assert torch.isfinite(model(torch.randint(3, VOCAB, (1, 40)), cache=cache, use_cache=True).logits).all()
    bad = tmp_path / "bad.json"
    write_plan(str(bad), dict(docs[0], recent_window={"tokens": 16, "codec": "q8_0", "sink": 4}))
    with pytest.raises(ConfigError, match="recent_window must be"):
        read_plan(str(bad))
