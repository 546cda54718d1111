"""The pieces the serving benchmarks and the vLLM server test share (one copy each): the
`value | ratio` cells of both serving tables and stopping a server process."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers.processes import free_port, stop_server

PERF = Path(__file__).resolve().parents[1] / "benchmarks" / "perf"


def _load(name: str):
    sys.path.insert(0, str(PERF))
    try:
        spec = importlib.util.spec_from_file_location(name, PERF / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(PERF))


def test_both_serving_tables_build_their_value_ratio_cells_alike():
    serving, serve = _load("vllm_serving"), _load("vllm_bench_serve")
    assert serving.value_ratio(1234, 2.0, "{:,}") == "1,234 | 2.00x"
    assert serving.value_ratio(None, None) == " | " and serving.value_ratio(3.14159, None) == "3.1 | "
    assert serve.value_ratio.__module__ == "vllm_serving"  # one copy, imported

    base = {"budget_bytes": 1 << 26, "capacity_tokens": 1000, "concurrency": 2, "output_tok_s": 10.0,
            "mean_ttft_s": 2.0, "total_s": 30.0, "cpu_s": 40.0, "output_tok_per_cpu_s": 0.25, "load_1min": 2.5}
    rows = serving.with_ratios([dict(base, config="vllm-bf16"),
                                dict(base, config="pagedkv-turbo3", capacity_tokens=4730, concurrency=0,
                                     output_tok_s=13.3, mean_ttft_s=None)])
    args = SimpleNamespace(prompts=8, prompt_tokens=512, max_tokens=64, dtype="bfloat16")
    line = serving.table(rows, args).splitlines()[-1]
    assert line == ("| 64 MiB | pagedkv-turbo3 | 4,730 | 4.73x | 0 | 0.00x | 13.3 | 1.33x |  |  | 30.0 | 1.00x | "
                    "40.0 | 1.00x | 0.25 | 1.00x | 2.5 |")

    b = {"mix": "chat", "budget_bytes": 1 << 26, "kv_tokens": 1000, "output_throughput": 10.0,
         "median_ttft_ms": 200.0, "p99_ttft_ms": 400.0, "median_tpot_ms": 50.0, "p99_tpot_ms": 80.0,
         "output_tok_per_cpu_s": 0.5, "peak_running": 4, "peak_kv_use": 0.5, "load_1min": 2.0}
    rows = serve.with_ratios([dict(b, config="vllm-bf16"), dict(b, config="pagedkv-turbo3", kv_tokens=4730,
                                                                 p99_tpot_ms=None)])
    args = SimpleNamespace(dtype="bfloat16", threads=1, max_num_seqs=256, max_num_batched_tokens=2048,
                           request_rate="inf")
    line = serve.table(rows, {"chat": {"prompts": 6, "input": 64, "output": 24}}, args).splitlines()[-1]
    assert line == ("| chat | 64 MiB | pagedkv-turbo3 | 4,730 | 4.73x | 10.0 | 1.00x | 200 | 1.00x | 400 | 1.00x | "
                    "50.0 | 1.00x |  |  | 0.50 | 1.00x | 4 | 50% | 2.0 |")


def test_bench_serve_resizes_a_mix_and_refuses_a_bad_size(capsys):
    serve = _load("vllm_bench_serve")
    assert serve.parse_size("chat=64x512x512") == {"prompts": 64, "input": 512, "output": 512}
    for bad in ("chat=64x512", "chat=0x512x512", "shared=4x64x8", "chat=axbxc", "nope=1x2x3"):
        with pytest.raises(ValueError):
            serve.parse_size(bad)
    with pytest.raises(SystemExit):  # argparse's one-line error, before any server starts
        serve.main(["--size", "chat=64x512", "--mixes", "chat", "--configs", "vllm-bf16"])
    assert "--size 'chat=64x512'" in capsys.readouterr().err


def _started(code: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    return proc


def test_stop_server_terminates_then_kills_and_reaps():
    polite = _started("import time; print('ready', flush=True); time.sleep(60)")
    stop_server(polite)
    assert polite.returncode == -15  # SIGTERM was enough
    stubborn = _started("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                        "print('ready', flush=True); time.sleep(60)")
    stop_server(stubborn, grace_s=0.5)
    assert stubborn.returncode == -9  # ignored SIGTERM: killed after the grace period, and reaped
    stop_server(stubborn)  # already gone: nothing to do
    polite.stdout.close(), stubborn.stdout.close()
    assert 0 < free_port() < 65536
