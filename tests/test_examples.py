"""The README's quickstarts run as written on the embedded model: its Python example is
examples/quickstart.py (a fresh interpreter, FutureWarning and DeprecationWarning turned into
errors), and its command-line block runs line by line in bash."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from helpers.markdown import readme_block_run_by, shell_commands

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_readme_example_is_the_example_file():
    # the block the README marks as run by test_quickstart_runs_as_written is the file it runs
    with open(os.path.join(ROOT, "examples", "quickstart.py"), encoding="utf-8") as fh:
        example = fh.read()
    block = readme_block_run_by("tests/test_examples.py::test_quickstart_runs_as_written")
    assert block.lang == "python" and block.text == example, "README's Python example differs from examples/quickstart.py"


def test_quickstart_runs_as_written():
    pytest.importorskip("transformers")
    from pagedkv.eval.model import embedded_model_source

    embedded_model_source()  # skip-free: the embedded model is part of the test set-up
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "HF_HUB_OFFLINE": "1",
           # one thread: transformers' GGUF loader takes ~60 s of CPU here, and two spinning
           # threads on a loaded 2-core machine doubled that (149 s of CPU, 900 s wall at load 15)
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-W", "error::FutureWarning", "-W", "error::DeprecationWarning",
                           os.path.join(ROOT, "examples", "quickstart.py")],
                          capture_output=True, text=True, env=env, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) >= 2 and lines[0].strip(), proc.stdout
    m = re.fullmatch(r"(\d+) tokens in the cache, (\d+) bytes per token", lines[-1])
    assert m, lines[-1]
    # plain turbo3 in every layer: 30 layers x 3 kv heads x (K + V) x 64 dims x 3.5 bits / 8
    assert int(m[2]) == 30 * 3 * 2 * 64 * 7 // 16
    assert int(m[1]) > 40


def test_readme_cli_commands_run_as_written():
    """Each command of the README's command-line block, as written, with `.venv/bin/` meaning this
    interpreter's bin directory (the venv `make test` made): exit 0 and the output it promises."""
    pytest.importorskip("transformers")
    block = readme_block_run_by("tests/test_examples.py::test_readme_cli_commands_run_as_written")
    commands = shell_commands(block)
    assert [c.split()[:2] for c in commands] == [[".venv/bin/pagedkv", "plan"], [".venv/bin/pagedkv", "generate"],
                                                 [".venv/bin/pagedkv", "eval"]], commands
    bindir = os.path.dirname(sys.executable)
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    out = []
    for cmd in commands:
        proc = subprocess.run(["bash", "-c", cmd.replace(".venv/bin/", bindir + "/", 1)], cwd=ROOT,
                              capture_output=True, text=True, env=env, timeout=1800)
        assert proc.returncode == 0, (cmd, proc.stderr[-3000:])
        out.append(proc.stdout + proc.stderr)
    assert re.search(r"turbo3\s.*\b5040\b.*\b1704352\b", out[0]), out[0]  # bytes per token, tokens in 8 GiB
    assert re.search(r"\[turbo3\] 24 tokens in", out[1]), out[1][-2000:]
    assert re.search(r"turbo3\s.*3\.5\s", out[2]) and "2 passes" in out[2], out[2][-2000:]
