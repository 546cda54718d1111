"""A private redis-server on a free loopback port, for the Redis tier tests and the fault suite
(benchmarks/faults/offload_faults.py imports it too): start, kill (also when stopped by SIGSTOP),
restart on the same port."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time

from .processes import free_port


class RedisServer:
    """`exe`: the redis-server binary (None when it is not installed: check before `start`)."""

    def __init__(self, workdir):
        self.exe = shutil.which("redis-server")
        self.workdir = str(workdir)
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = None
        self.client = None

    def start(self) -> "RedisServer":
        import redis

        self.proc = subprocess.Popen(
            [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.workdir, "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)
        deadline = time.monotonic() + 10
        while True:
            try:
                self.client.ping()
                return self
            except redis.exceptions.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.kill()
                    raise RuntimeError("redis-server did not start")
                time.sleep(0.05)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(timeout=10)
