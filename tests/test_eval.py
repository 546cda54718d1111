"""Evaluation building blocks: windows, metrics, format choices, the runner on a tiny model."""

from __future__ import annotations

import math

import pytest
import torch

from pagedkv.errors import ConfigError
from pagedkv.eval.metrics import MetricSums, kl_sum, log_probs, nll_sum, top1_matches
from pagedkv.eval.runner import EvalConfig, parse_choice, pareto_front
from pagedkv.eval.text import default_text, make_windows, window_starts


def test_window_starts_spread_evenly_first_and_last_included():
    assert window_starts(1000, 1, 100) == [0]
    assert window_starts(1000, 2, 100) == [0, 900]
    s = window_starts(1000, 4, 100)
    assert s == [0, 300, 600, 900]
    assert set(window_starts(1000, 2, 100)) <= set(window_starts(1000, 4, 100))
    with pytest.raises(ConfigError, match="fewer than one window"):
        window_starts(50, 2, 100)
    with pytest.raises(ConfigError, match="--windows"):
        window_starts(1000, 0, 100)


def test_make_windows_prepends_bos():
    toks = torch.arange(10, 110)
    w = make_windows(toks, 3, 10, bos=1)
    assert [x.tolist()[:2] for x in w] == [[1, 10], [1, 56], [1, 101]]
    assert all(x.numel() == 10 for x in w)
    assert w[-1][-1] == 109  # the last window ends at the end of the text
    assert make_windows(toks, 1, 10, bos=None)[0].tolist() == list(range(10, 20))


def test_default_text_is_pydoc_topics_sorted():
    from pydoc_data.topics import topics

    text = default_text()
    first = sorted(topics)[0]
    assert text.startswith(topics[first]) and len(text) > 100_000


def test_metrics_against_direct_formulas():
    torch.manual_seed(0)
    a, b = torch.randn(7, 11) * 3, torch.randn(7, 11) * 3
    t = torch.randint(0, 11, (7,))
    la, lb = log_probs(a), log_probs(b)
    assert math.isclose(nll_sum(la, t), float(torch.nn.functional.cross_entropy(a, t, reduction="sum")), rel_tol=1e-5)
    direct = float(torch.nn.functional.kl_div(lb, la, log_target=True, reduction="sum"))
    assert math.isclose(kl_sum(la, lb), direct, rel_tol=1e-5)
    assert kl_sum(la, la) == 0.0
    assert top1_matches(la, lb) == int((a.argmax(-1) == b.argmax(-1)).sum())
    m = MetricSums()
    m.add(a, t, la)
    m.add(a, t, la)
    assert m.tokens == 14 and m.mean_kl == 0 and m.top1_rate == 1
    assert math.isclose(m.ppl, math.exp(nll_sum(la, t) / 7), rel_tol=1e-6)


def test_parse_choice():
    c = parse_choice("turbo3+hp")
    assert c.label == "turbo3+hp" and c.high_precision_layers == "auto" and c.kv_format.name == "turbo3"
    assert parse_choice("turbo4k3v+hp2").high_precision_layers == 2
    assert parse_choice("turbo4k3v").label == "turbo4k_turbo3v"
    assert parse_choice("q8_0").high_precision_layers == 0
    with pytest.raises(ConfigError, match="turbo9"):
        parse_choice("turbo9+hp")
    with pytest.raises(ConfigError, match="windows"):
        EvalConfig(windows=0)


def test_pareto_front():
    pts = [(16, 0.0), (8, 0.01), (8.5, 0.02), (4.5, 0.05), (3.5, 0.1), (6, 0.2)]
    assert pareto_front(pts) == [4, 3, 1, 0]


def test_evaluate_tiny_model_and_plot(tmp_path):
    transformers = pytest.importorskip("transformers")
    from pagedkv.eval.plot import plot_results
    from pagedkv.eval.runner import evaluate

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("k_proj.weight", "q_proj.weight")):
                p.mul_(8)
    toks = torch.randint(3, 64, (400,))
    windows = make_windows(toks, 2, 48, bos=1)
    ecfg = EvalConfig(formats=("turbo3", "bf16", "turbo2+hp1"), windows=2, window_tokens=48,
                      memory_bytes=2**20, decode_steps=2)
    rows = evaluate(model, windows, ecfg)
    by = {r["format"]: r for r in rows}
    assert [r["format"] for r in rows] == ["turbo3", "bf16", "turbo2+hp1"]
    assert by["bf16"]["kl"] == 0 and by["bf16"]["top1"] == 1
    assert by["turbo3"]["kl"] > 0 and by["turbo3"]["bits_per_element"] == 3.5
    assert by["bf16"]["bytes_per_token"] == 2 * 2 * 32 * 2  # 2 layers x K,V x 32 dims x 2 bytes
    assert by["turbo2+hp1"]["high_precision_layers"] == 1
    assert by["turbo2+hp1"]["bits_per_element"] == 8.5  # both layers are high precision (q8_0)
    assert by["turbo3"]["max_context_tokens"] == (2**20 // (56 * 16)) * 16  # 2 layers x K,V x 32 x 3.5 bits = 56 B
    assert all(r["decode_tok_s"] > 0 and r["tokens"] == 94 for r in rows)
    # bf16 cache perplexity equals the DynamicCache perplexity (fp32 K/V) closely
    nll = 0.0
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        for w in windows:
            nll += nll_sum(log_probs(model(w[None]).logits[0, :-1]), w[1:])
    assert math.isclose(by["bf16"]["ppl"], math.exp(nll / 94), rel_tol=1e-3)
    out = tmp_path / "p.png"
    plot_results(rows, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_rejects_bad_arguments_before_loading(capsys):
    from pagedkv.cli.main import main

    assert main(["eval", "--formats", "bf16,turbo9"]) == 2
    assert "turbo9" in capsys.readouterr().err
    assert main(["eval", "--plot", "x.txt", "--formats", "bf16"]) == 2
    assert main(["eval", "--memory", "lots"]) == 2
    assert main(["generate", "hi", "--kv-format", "nope"]) == 2
    assert main(["eval", "--formats", "bf16", "--device", "nonsense"]) == 2
    assert "nonsense" in capsys.readouterr().err


def _tiny_model():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    return transformers.LlamaForCausalLM(cfg).eval()


def test_worker_processes_give_the_numbers_of_one_process():
    """Windows shared out to 2 forked workers: the same sums, added in the same order, so every
    number but the decode speed is identical."""
    from pagedkv.eval.compute import Compute
    from pagedkv.eval.runner import evaluate
    from pagedkv.eval.workers import fork_available

    if not fork_available():
        pytest.skip("no fork start method here")
    model = _tiny_model()
    windows = make_windows(torch.randint(3, 64, (600,)), 3, 40, bos=1)
    base = dict(formats=("bf16", "turbo3", "q4_0"), windows=3, window_tokens=40, memory_bytes=2**20, decode_steps=1)
    one = evaluate(model, windows, EvalConfig(**base))
    seen: list = []
    two = evaluate(model, windows, EvalConfig(**base, compute=Compute(threads=1, workers=2)), progress=seen.append)
    assert len(seen) == 9 and sorted(seen) == sorted(["bf16", "turbo3", "q4_0"] * 3)
    for a, b in zip(one, two):
        assert a.pop("decode_tok_s") > 0 and b.pop("decode_tok_s") > 0
        assert a == b
    assert len(one[1]["kl_per_window"]) == 3


def test_subset_is_some_of_the_full_runs_windows():
    from pagedkv.eval.text import subset_indices

    assert subset_indices(8, 4) == [0, 2, 5, 7] and subset_indices(8, None) == list(range(8))
    assert subset_indices(8, 2) == [0, 7] and subset_indices(8, 1) == [0] and subset_indices(8, 8) == list(range(8))
    toks = torch.arange(1000)
    full, part = make_windows(toks, 8, 50, bos=None), make_windows(toks, 8, 50, bos=None, subset=4)
    assert [w.tolist() for w in part] == [full[i].tolist() for i in (0, 2, 5, 7)]
    with pytest.raises(ConfigError, match="--subset"):
        EvalConfig(windows=8, subset=9)


def test_compute_default_counts_idle_cpus(monkeypatch):
    from pagedkv.eval import compute

    monkeypatch.setattr(compute, "usable_cpus", lambda: 2)
    monkeypatch.setattr(compute.os, "getloadavg", lambda: (0.1, 0.1, 0.1))
    assert compute.Compute.resolve(parallel_work=8) == compute.Compute(1, 2, "2 idle of 2 CPUs")
    assert compute.Compute.resolve().threads == 2  # one stream: both idle CPUs as threads
    monkeypatch.setattr(compute.os, "getloadavg", lambda: (7.5, 6.0, 3.0))  # a busy shared machine
    assert (compute.Compute.resolve(parallel_work=8).workers, compute.Compute.resolve().threads) == (1, 1)
    assert compute.Compute.resolve(threads=3, parallel_work=8).threads == 3
    assert compute.Compute.resolve(threads=2, workers=2).how == "given"
    with pytest.raises(ConfigError, match="--threads"):
        compute.Compute.resolve(threads=0)


def test_a_gpu_run_stays_in_one_process(monkeypatch):
    """Forked workers cannot use their parent's CUDA context (found on an H200: "Cannot
    re-initialize CUDA in forked subprocess"), so --device cuda runs in one process by default
    and refuses more workers in one line, before anything loads; the CPU default is unchanged."""
    from argparse import Namespace

    from pagedkv.cli.edge import compute_from_args
    from pagedkv.eval import compute

    monkeypatch.setattr(compute, "usable_cpus", lambda: 16)
    monkeypatch.setattr(compute.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a machine with two GPUs
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert compute_from_args(Namespace(threads=None, workers=None, device="cuda"), parallel_work=12).workers == 1
    assert compute_from_args(Namespace(threads=None, workers=None, device="cuda:1"), parallel_work=12).workers == 1
    assert compute_from_args(Namespace(threads=None, workers=None, device="cpu"), parallel_work=12).workers == 12
    assert compute_from_args(Namespace(threads=1, workers=1, device="cuda"), parallel_work=12).workers == 1
    with pytest.raises(ConfigError, match=r"--workers 4 with --device cuda.*--workers 1"):
        compute_from_args(Namespace(threads=None, workers=4, device="cuda"), parallel_work=12)


def test_plot_reads_at_a_glance_even_with_nothing_on_the_log_axis(tmp_path):
    pytest.importorskip("matplotlib")
    from pagedkv.eval.plot import _panel_points, plot_results

    rows = [{"format": f, "bits_per_element": b, "kl": k, "ppl": p} for f, b, k, p in (
        ("bf16", 16, 0.0, 11.95), ("turbo3", 3.5, 0.0965, 13.36), ("turbo2", 2.5, 0.593, 22.65),
        ("fp8", 8, 0.0059, 12.01))]
    _, ok, shown, labels, marks, ylim = _panel_points(rows, "kl")
    assert marks == {0: "v"} and labels[0] == "bf16 (= 0)" and ylim[0] < shown[0] < min(0.0059, ylim[1])
    _, ok, shown, labels, marks, ylim = _panel_points(rows, "ppl")
    assert marks == {2: "^"} and labels[2] == "turbo2 (22.65)" and shown[2] <= ylim[1]  # turbo2 off the scale
    assert ylim[1] < 22.65 and ylim[0] < 11.95
    for name, rs in (("all", rows), ("bf16", rows[:1])):
        out = tmp_path / f"{name}.png"
        plot_results(rs, str(out), title=name)
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_table_columns_use_one_notation():
    from pagedkv.cli.output import column_formatter

    f = column_formatter([6480.0, 23040.0, 5040.0])
    assert [f(v) for v in (6480.0, 23040.0)] == ["6480", "23040"]
    f = column_formatter([0.0, 0.0002123, 0.5931])
    assert [f(v) for v in (0.0, 0.0002123, 0.5931)] == ["0", "0.000212", "0.593100"]
    f = column_formatter([11.952, 22.65, "-"])
    assert [f(v) for v in (11.952, 22.65, "-")] == ["11.95", "22.65", "-"]


def test_eval_cli_prints_the_table_before_the_plot_and_its_times(monkeypatch, tmp_path, capsys):
    """The whole eval command with the model and the passes stubbed: JSON printed, plot written
    afterwards, the closing line with wall and CPU time and the compute setting."""
    pytest.importorskip("matplotlib")
    import json
    from types import SimpleNamespace

    import pagedkv.eval.model as em
    import pagedkv.eval.runner as er
    from pagedkv.cli.main import main

    class Tok:
        bos_token_id = 1

        def __call__(self, text, **kw):
            return {"input_ids": list(range(2, 5000))}

    rows = [{"format": "bf16", "bits_per_element": 16, "bytes_per_token": 23040.0, "kl": 0.0, "ppl": 12.0,
             "top1": 1.0, "decode_tok_s": None, "max_context_tokens": 10}]
    seen = {}
    monkeypatch.setattr(em, "load_tokenizer", lambda src: Tok())
    monkeypatch.setattr(em, "load_model", lambda src, **kw: SimpleNamespace(model=None, tokenizer=kw["tokenizer"]))

    def fake_evaluate(model, windows, cfg, progress=None, tokenizer=None):
        seen["windows"], seen["compute"] = len(windows), cfg.compute
        return rows

    monkeypatch.setattr(er, "evaluate", fake_evaluate)
    out = tmp_path / "p.png"
    assert main(["eval", "--formats", "bf16", "--subset", "2", "--window-tokens", "64", "--threads", "1",
                 "--workers", "1", "--plot", str(out), "--json"]) == 0
    cap = capsys.readouterr()
    assert json.loads(cap.out) == rows and out.is_file() and seen["windows"] == 2
    last = cap.err.strip().splitlines()[-1]
    assert last.startswith("pagedkv eval: 2 passes in") and "CPU" in last and "1 thread" in last


def test_window_labels_with_sinks_and_their_stored_tail():
    from pagedkv.eval.runner import tail_tokens
    from pagedkv.ops.recent import RecentWindow

    c = parse_choice("turbo3k_turbo2v+r32s16q8_0")
    assert c.label == "turbo3k_turbo2v+r32s16q8_0" and c.recent == RecentWindow(32, "q8_0", sinks=16)
    assert parse_choice("turbo3+r64").recent == RecentWindow(64)
    assert parse_choice("turbo2g64+hp+r16s16q8_0").high_precision_layers == "auto"
    with pytest.raises(ConfigError, match="unknown codec 'x'"):
        parse_choice("turbo3+r64s16x")
    # blocks of 16 at 1024 tokens: the sink block + the 4 covering the last 64 (2 + 1 overlapping at 20)
    assert tail_tokens(RecentWindow(64, "q8_0", sinks=16), 1024, 16) == 80
    assert tail_tokens(RecentWindow(64, "q8_0", sinks=16), 20, 16) == 32
    assert tail_tokens(None, 1024, 16) == 0
