"""Server processes that tests and benchmarks start (vLLM's OpenAI server, redis-server): a free
loopback port to give one, and stopping one so that it never outlives its caller."""

from __future__ import annotations

import socket
import subprocess


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listened on a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_server(proc: subprocess.Popen, grace_s: float = 60) -> None:
    """Stop `proc` if it still runs: SIGTERM (a server's clean shutdown), SIGKILL when it has not
    exited `grace_s` seconds later; it is waited for either way (no zombie left behind)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
