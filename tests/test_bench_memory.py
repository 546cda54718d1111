"""`pagedkv bench memory`: the comparison arithmetic and its input checks (the child runs, each a
16k-token generation of the embedded model, are minutes long and run by hand, see docs/performance.md)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pagedkv.errors import ConfigError, PagedKVError
from pagedkv.bench import memory


def _fake_runs(monkeypatch, results: dict, calls: list):
    def fake_run(cmd, capture_output, text):
        fmt = cmd[cmd.index("--format") + 1]
        calls.append(cmd)
        row = {"format": fmt, "peak_minus_load_bytes": results[fmt][0], "kv_pool_bytes": results[fmt][1],
               "rss_file_bytes": 0}
        return subprocess.CompletedProcess(cmd, 0, stdout="noise\n" + json.dumps(row) + "\n", stderr="")

    monkeypatch.setattr(memory.subprocess, "run", fake_run)


def test_compare_rows_saving_against_the_first_format(monkeypatch):
    calls: list = []
    _fake_runs(monkeypatch, {"bf16": (500, 400), "turbo3": (150, 90), "fp8": (350, 200)}, calls)
    rows = memory.compare(["bf16", "turbo3", "fp8"], context=1024, chunk=128, new_tokens=4, threads=1,
                          malloc="default")
    assert [r["format"] for r in rows] == ["bf16", "turbo3", "fp8"]
    assert rows[0]["saved_bytes"] == 0 and rows[0]["saved_vs_kv"] is None
    assert rows[1]["saved_bytes"] == 350 and rows[1]["kv_difference_bytes"] == 310
    assert rows[1]["saved_vs_kv"] == round(350 / 310, 3)
    assert rows[2]["saved_bytes"] == 150 and rows[2]["kv_difference_bytes"] == 200
    assert all(r["malloc"] == "default" for r in rows)
    cmd = calls[1]
    assert cmd[:3] == [sys.executable, "-m", "pagedkv.bench.memory"]
    assert cmd[cmd.index("--context") + 1] == "1024" and cmd[cmd.index("--malloc") + 1] == "default"
    assert "--no-warmup" not in cmd
    memory.compare(["bf16"], warmup=False)
    assert "--no-warmup" in calls[-1]


def test_compare_rejects_bad_input_before_any_run(monkeypatch):
    calls: list = []
    _fake_runs(monkeypatch, {}, calls)
    with pytest.raises(ConfigError, match="nope"):
        memory.compare(["bf16", "nope"])
    with pytest.raises(ConfigError, match="malloc"):
        memory.compare(["bf16"], malloc="jemalloc")
    with pytest.raises(ConfigError, match="at least one"):
        memory.compare([])
    assert calls == []


def test_compare_reports_a_failed_child(monkeypatch):
    def failing(cmd, capture_output, text):
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="Traceback...\nMemoryError: boom\n")

    monkeypatch.setattr(memory.subprocess, "run", failing)
    with pytest.raises(PagedKVError, match="turbo3.*MemoryError: boom"):
        memory.compare(["turbo3"])
