"""CI version of the storage-tier fault suite (benchmarks/faults/offload_faults.py, one round): Redis
killed, hung, full, flushed and fed damaged or forged values; disk entries flipped, truncated,
forged, replaced by FIFOs, symlinks, directories and sparse giants; disk full and removed; swap
full; two processes racing on one disk store and one Redis; another user's planted store secret
and vLLM statistics (refused); an empty value on disk and on Redis (repaired); the vLLM connector's
page hand-overs under the same faults. No run may use wrong K/V."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "faults" / "offload_faults.py"


def _suite():
    spec = importlib.util.spec_from_file_location("offload_faults", _PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["offload_faults"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_fault_suite_loses_no_data_and_stays_bit_identical():
    pytest.importorskip("redis")
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server binary not found (`make test` installs it)")
    suite = _suite()
    c = suite.run_suite(rounds=1, seed=0)
    print(suite.format_counts(c))
    assert c["redis"] == "ran"
    assert c["data_lost"] == 0 and c["errors"] == 0 and c["repairs_missed"] == 0
    assert c["refused"] >= 3  # the planted secret (and as root its other owner), statistics x2
    assert c["bit_identical"] == c["runs"] > c["faults_injected"] >= 28
    assert c["warnings"] > 0 and c["prefix_tokens_loaded"] > 0
    assert sum(n for f, n in c["by_fault"].items() if f.startswith("connector-")) >= 26  # the vLLM connector's
