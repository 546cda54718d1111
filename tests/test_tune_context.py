"""`pagedkv tune --context N` / `tunedB@N` (issue 33): a plan for the context it serves, measured on a
calibration window of N tokens (sampled query rows, sliding windows), bits counted at N."""

from __future__ import annotations

import json
from types import SimpleNamespace
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pagedkv.codecs import CODECS  # noqa: E402
from pagedkv.errors import ConfigError  # noqa: E402
from pagedkv.ops.recent import RecentWindow, stored_tail_tokens  # noqa: E402

from helpers.tiny_llama import peaked_llama  # noqa: E402

N = 1600  # longer than the module docstrings in words (1518): the long calibration text is read


class WordTokenizer:
    """Words -> ids (a few hundred tokens per thousand words); remembers the texts it was given."""

    bos_token_id = 1

    def __init__(self):
        self.seen = []

    def __call__(self, text, add_special_tokens=False):
        self.seen.append(text)
        return {"input_ids": [3 + sum(map(ord, w)) % 93 for w in text.split()]}


@pytest.fixture(scope="module")
def long_plan():
    import pagedkv.eval.text as eval_text
    from pagedkv.tune import for_context, sensitivity, tune_budgets

    model = peaked_llama(pagedkv_attention=False, num_hidden_layers=2, max_position_embeddings=2048)
    tok = WordTokenizer()
    saved = eval_text.default_text, sensitivity.MAX_QUERY_ROWS
    eval_text.default_text = lambda: (_ for _ in ()).throw(AssertionError("tune read the eval text"))
    sensitivity.MAX_QUERY_ROWS = 64  # test time (the sampling has its own test below)
    try:
        docs = tune_budgets(model, tok, budgets=[3.5, 4.5], recent="auto", **for_context(N))
    finally:
        eval_text.default_text, sensitivity.MAX_QUERY_ROWS = saved
    return model, tok, docs


def test_a_plan_for_n_tokens_is_measured_on_n_and_counts_its_bits_at_n(long_plan):
    from pagedkv.integrations.vllm.fit import calibration_text
    from pagedkv.tune.calibration import long_calibration_text

    _, tok, docs = long_plan
    assert tok.seen == [calibration_text(), long_calibration_text()]
    assert long_calibration_text().startswith(calibration_text() + "\n\n")
    for bits, doc in zip((3.5, 4.5), docs):
        assert doc["calibration_tokens"] == N and doc["context"] == N
        assert doc["calibration_text"] == "stdlib-docstrings+members"
        w = doc["recent_window"]
        if w is not None:  # the tail's blocks as held at N tokens, q8_0 on both sides
            slots = stored_tail_tokens(N, w["tokens"], 16, w.get("sinks", 0))
            assert math.isclose(doc["tail_bits"], slots / N * CODECS[w["codec"]].bits_per_element, rel_tol=1e-12)
        assert doc["bits_per_element"] + doc["tail_bits"] <= bits + 1e-9
    # at N the window is cheap: the 3.5-bit plan spends the bits a 1k count would give the tail
    search = {str(s["recent_window"]): s for s in docs[0]["window_search"]}
    r64 = search[str({"tokens": 64, "codec": "q8_0", "sinks": 16})]
    assert r64["tail_bits"] == pytest.approx(80 / N * 8.5)


def test_the_eval_label_is_the_plan_tune_makes(long_plan, tmp_path, monkeypatch):
    from pagedkv.eval.runner import parse_choice
    from pagedkv.eval.tuned import resolve_tuned
    from pagedkv.formats import read_plan
    from pagedkv.tune import sensitivity

    monkeypatch.setattr(sensitivity, "MAX_QUERY_ROWS", 64)  # as in the fixture

    model, tok, docs = long_plan
    choices = [parse_choice(s) for s in ("turbo3", f"tuned3.5@{N}", "tuned4.5@1600")]
    assert (choices[1].tune_bits, choices[1].tune_context) == (3.5, N)
    assert parse_choice("tuned3.5@8k").tune_context == 8192 and parse_choice("tuned3.5").tune_context is None
    got = resolve_tuned(model, tok, choices, context=64, directory=str(tmp_path))
    assert [c.label for c in got] == ["turbo3", f"tuned3.5@{N}", "tuned4.5@1600"]
    for c, doc in zip(got[1:], docs):
        with open(c.kv_format, encoding="utf-8") as f:
            plan = json.load(f)
        assert read_plan(c.kv_format) and plan["layers"] == doc["layers"] and plan["context"] == N and plan["recent_window"] == doc["recent_window"]
    with pytest.raises(ConfigError, match="after @"):
        parse_choice("tuned3.5@0")


def test_a_plan_for_a_context_past_the_models_is_refused():
    from pagedkv.eval.runner import parse_choice
    from pagedkv.eval.tuned import resolve_tuned
    from pagedkv.tune import check_context

    model = peaked_llama(pagedkv_attention=False, num_hidden_layers=1)  # 256 positions
    with pytest.raises(ConfigError, match="256 positions"):
        resolve_tuned(model, WordTokenizer(), [parse_choice("tuned3.5@300")], context=64)
    with pytest.raises(ConfigError, match="--context 257: the model was trained to 256"):
        check_context(model.config, 257)
    check_context(model.config, 256)


@pytest.mark.parametrize("argv, word", [
    (["tune", "--bits", "3.5", "--context", "0", "--out", "p.json"], "--context"),
    (["tune", "--bits", "3.5", "--context", "8q", "--out", "p.json"], "--context"),
    (["tune", "--bits", "3.5", "--context", "8k", "--tokens", "1", "--out", "p.json"], "--tokens"),
])
def test_cli_bad_context_is_one_line_before_the_model_loads(argv, word, capsys, monkeypatch):
    import pagedkv.eval.model as model_mod
    from pagedkv.cli.main import main

    for name in ("load_model", "load_tokenizer", "resolve_model_source"):
        monkeypatch.setattr(model_mod, name, lambda *a, **k: (_ for _ in ()).throw(AssertionError("loaded")))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and word in err


def test_sampled_rows_and_sliding_windows_are_the_masked_attention(monkeypatch):
    """A window longer than MAX_QUERY_ROWS scores evenly spread query rows, each over every key it
    sees; a sliding-window layer (Gemma's) sees its last W keys: against full masked attention
    (per-query oracle rows), every window candidate, both sides."""
    from pagedkv.tune import sensitivity as sens

    monkeypatch.setattr(sens, "MAX_QUERY_ROWS", 13)
    gen = torch.Generator().manual_seed(7)
    t, d, slide = 90, 32, 20
    q, k, v = torch.randn(4, t, d, generator=gen), torch.randn(2, t, d, generator=gen), torch.randn(2, t, d, generator=gen)
    rows = sens.query_rows(t)
    assert rows.numel() == 13 and int(rows[-1]) == t - 1 and rows.unique().numel() == 13
    ladder = [CODECS["turbo2"], CODECS["turbo3"]]
    windows = [None, RecentWindow(8, "q8_0"), RecentWindow(8, "q8_0", sinks=4), RecentWindow(30, "bf16", sinks=16)]
    scale = 0.3
    got = sens.window_errors([(q, k, v, slide, scale)], ladder, windows)
    pos = torch.arange(t)
    seen = (pos[None] <= pos[:, None]) & (pos[None] > pos[:, None] - slide)

    def attend(kk, vv, hp=None):  # all rows: [4, T, D]
        kk, vv = kk.repeat_interleave(2, 0), vv.repeat_interleave(2, 0)
        s = q @ kk.mT * scale
        if hp is not None:
            m, kh, vh = hp
            s = torch.where(m, q @ kh.repeat_interleave(2, 0).mT * scale, s)
        p = torch.softmax(s.masked_fill(~seen, float("-inf")), -1)
        if hp is None:
            return p @ vv
        return (p * ~m) @ vv + (p * m) @ vh.repeat_interleave(2, 0)

    exact = attend(k, v)[:, rows]
    norm = float(exact.square().mean())
    for w, out in zip(windows, got):
        for c in ladder:
            kq, vq, kc, vc = sens._fit_roundtrip(c, k, v, q)
            hk = hv = None
            if w is not None:
                m = sens.window_mask(t, w.tokens, w.sinks)
                hk, hv = (m, sens._tail_roundtrip(w.codec, k, kc), v), (m, k, sens._tail_roundtrip(w.codec, v, vc))
            want_k = float((attend(kq, v, hk)[:, rows] - exact).square().mean()) / norm
            want_v = float((attend(k, vq, hv)[:, rows] - exact).square().mean()) / norm
            assert out[0]["k"][c.name] == pytest.approx(want_k, rel=1e-4)
            assert out[0]["v"][c.name] == pytest.approx(want_v, rel=1e-4)


def _config_folder(tmp_path, positions: int) -> str:
    """A model folder with only a config.json (Llama, trained to `positions`): enough for every
    check made before the weights load; loading them fails."""
    transformers.LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             hidden_size=64, max_position_embeddings=positions).save_pretrained(tmp_path)
    return str(tmp_path)


def test_every_reader_of_the_trained_context_reads_the_same_number(tmp_path, capsys):
    """One `trained_context(config)`: the decoder's max_position_embeddings (a composite config's
    text config), None where the config gives none or 0. tune's check, `pagedkv plan`'s default
    length and the retrieval CLI's length check all read it."""
    from pagedkv.cli.main import main
    from pagedkv.eval.plan import plan
    from pagedkv.integrations.model_config import trained_context
    from pagedkv.tune import check_context

    llama = transformers.LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                     head_dim=16, hidden_size=64, max_position_embeddings=300)
    gemma = transformers.Gemma3Config(text_config=dict(max_position_embeddings=700, num_hidden_layers=2))
    assert trained_context(llama) == 300 and trained_context(gemma) == 700
    with pytest.raises(ConfigError, match="--context 701: the model was trained to 700 positions"):
        check_context(gemma, 701)
    check_context(gemma, 700)
    assert plan(llama, 2**20, ["bf16"])[0]["seq_len"] == 300
    unknown = transformers.LlamaConfig(**{**llama.to_dict(), "max_position_embeddings": 0})
    assert trained_context(unknown) is None and trained_context(object()) is None
    check_context(unknown, 10**6)  # unknown: nothing to refuse
    assert plan(unknown, 2**20, ["bf16"])[0]["seq_len"] == 4096  # plan's stated default
    folder = _config_folder(tmp_path, 1024)
    assert main(["eval", "--task", "passkey", "--lengths", "1025", "--model", folder]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--lengths 1025: past the context" in err and "(1024 tokens" in err
    out = str(tmp_path / "p.json")
    assert main(["tune", "--bits", "3.5", "--context", "2k", "--model", folder, "--out", out]) == 2  # no weights read
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--context 2048: the model was trained to 1024 positions" in err


def test_the_default_list_runs_on_a_model_trained_to_fewer_positions(tmp_path, capsys, monkeypatch):
    """`pagedkv eval` with the default list on a model trained to 1024 positions: its `tunedB@8k`
    plans are taken at 1024, a line says so, the rest of the list is unchanged; on a model trained
    to 8k the list is the default list as it stands. `--formats tuned3.5@8k` named on its own is
    refused in one line before the tokenizer or the weights load."""
    import pagedkv.eval.model as em
    import pagedkv.eval.runner as er
    from pagedkv.cli.main import main
    from pagedkv.eval.config import DEFAULT_FORMATS

    class Tok:
        bos_token_id = 1

        def __call__(self, text, **kw):
            return {"input_ids": list(range(2, 5000))}

    seen = []
    monkeypatch.setattr(em, "load_tokenizer", lambda src: Tok())
    monkeypatch.setattr(em, "load_model", lambda src, **kw: SimpleNamespace(model=None, tokenizer=kw["tokenizer"]))
    monkeypatch.setattr(er, "evaluate", lambda model, windows, cfg, **kw: seen.append(cfg.formats) or [])
    argv = ["eval", "--windows", "1", "--window-tokens", "64", "--threads", "1", "--workers", "1", "--json"]
    short = _config_folder(tmp_path / "short", 1024)
    assert main(argv + ["--model", short]) == 0
    want = tuple({"tuned4.5@8k": "tuned4.5@1024", "tuned3.5@8k": "tuned3.5@1024"}.get(f, f) for f in DEFAULT_FORMATS)
    assert seen.pop() == want and want != DEFAULT_FORMATS
    err = capsys.readouterr().err
    assert "tuned3.5@8k of the default list: the model was trained to 1024 positions; tuned3.5@1024 instead" in err
    assert main(argv + ["--model", _config_folder(tmp_path / "long", 8192), "--formats", "default"]) == 0
    assert seen.pop() == DEFAULT_FORMATS and "instead" not in capsys.readouterr().err

    for name in ("load_model", "load_tokenizer"):
        monkeypatch.setattr(em, name, lambda *a, **k: (_ for _ in ()).throw(AssertionError("loaded")))
    for task in (["--task", "kl"], ["--task", "passkey", "--lengths", "1k"]):
        assert main(argv + ["--model", short, "--formats", "bf16,tuned3.5@8k", *task]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "tuned3.5@8k" in err and "trained to 1024 positions" in err, err
