"""How much of the machine a command uses: torch threads per process and eval worker processes.

Resolved once at the CLI edge (`Compute.resolve`) and passed down; nothing below reads the
environment or picks a thread count. Torch's own default is one thread per physical core,
which oversubscribes a machine that other processes already keep busy: on the shared 2-core
development machine (load 6-12) a 1024-token eval pass took 14.7 s with torch's default against
4.7 s with one thread, and `generate` ran at 3.9 tok/s against 18.5 (issue 16).

The default therefore counts the idle cores: the CPUs this process may run on minus the
1-minute load average (processes already running or waiting), at least 1. `eval` spends them
on worker processes of one thread each (a pass's matmuls are too small for intra-op threads to
scale well, separate processes do not share a thread pool or wait on each other's barriers);
`generate` and the other single-stream commands on torch threads. Torch-free on purpose.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from ..errors import ConfigError


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask; os.cpu_count() where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def idle_cpus() -> int:
    """Usable CPUs minus the 1-minute load average, rounded, at least 1."""
    try:
        busy = os.getloadavg()[0]
    except (AttributeError, OSError):
        busy = 0.0
    return max(1, min(usable_cpus(), round(usable_cpus() - busy)))


def _positive(name: str, value: Optional[int]) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigError(f"{name} must be a positive integer (1 or more), got {value!r}")


@dataclass(frozen=True)
class Compute:
    """threads: torch intra-op threads per process; workers: eval processes (each `threads`);
    how: where the numbers came from, for the report line."""

    threads: int = 1
    workers: int = 1
    how: str = "given"

    def __post_init__(self):
        _positive("--threads", self.threads)
        _positive("--workers", self.workers)

    @classmethod
    def resolve(cls, threads: Optional[int] = None, workers: Optional[int] = None, *,
                parallel_work: int = 1) -> "Compute":
        """The setting for a command. threads / workers: what the user gave (None: the default).
        parallel_work: independent pieces the command can hand to workers (eval: its windows;
        1 for a single stream)."""
        _positive("--threads", threads)
        _positive("--workers", workers)
        if threads is not None and workers is not None:
            return cls(threads, workers, "given")
        idle = idle_cpus()
        how = f"{idle} idle of {usable_cpus()} CPUs"
        if workers is None:
            workers = max(1, min(parallel_work, idle // (threads or 1))) if parallel_work > 1 else 1
        if threads is None:
            threads = max(1, idle // workers)
        return cls(threads, workers, how)

    def apply(self) -> None:
        """Set torch's intra-op threads of this process (imports torch)."""
        import torch

        torch.set_num_threads(self.threads)

    def describe(self) -> str:
        w = f"{self.workers} worker processes x " if self.workers > 1 else ""
        return f"{w}{self.threads} thread{'s' if self.threads > 1 else ''} ({self.how})"
