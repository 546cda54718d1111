"""The eval's windows shared out to forked worker processes, results back in window order.

Why processes: one eval pass (a 1024-token forward of a 135M model) is matmuls of a few hundred
columns, the prefill kernel and Python glue; intra-op threads scale them poorly and, on a
machine other processes keep busy, wait on each other at every barrier. Windows are
independent, so worker k takes windows k, k+N, k+2N, ... with one torch thread each. The model
is loaded once, before the fork, and shared copy-on-write (no second load, no second copy of
the weights). Each worker sends, per window, every format's `WindowSums` (and window 0's
decode times); the caller adds them in window order, so the sums are the ones a single process
computes. Linux/macOS (fork); elsewhere the caller runs the windows in-process.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from multiprocessing.connection import wait
from typing import Callable, Iterator, Optional, Sequence

from ..errors import ConfigError, PagedKVError


def fork_available() -> bool:
    return "fork" in mp.get_all_start_methods()


def _worker(model, windows, k: int, n: int, choices, cfg, conn) -> None:
    import torch

    from .runner import window_parts

    try:
        torch.set_num_threads(cfg.compute.threads)
        for wi in range(k, len(windows), n):
            parts = window_parts(model, wi, windows[wi], choices, cfg, lambda label: conn.send(("pass", label)))
            conn.send(("window", wi, parts))
    except KeyboardInterrupt:
        pass  # the parent was interrupted too and reports it
    except BaseException as exc:  # noqa: BLE001 - reported by the parent, one line
        try:
            conn.send(("error", isinstance(exc, PagedKVError), f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass
    finally:
        try:
            conn.close()
        finally:
            os._exit(0)  # never run the parent's atexit handlers or finalisers in the child


def parallel_windows(model, windows: Sequence, choices, cfg,
                     on_pass: Optional[Callable[[str], None]] = None) -> Iterator[tuple[int, list]]:
    """Yield (window index, per-format parts) in window order, computed by cfg.compute.workers
    forked processes (see the module docstring)."""
    if not fork_available():
        raise ConfigError("--workers above 1 needs the fork start method (Linux, macOS); use --workers 1")
    ctx = mp.get_context("fork")
    n = min(cfg.compute.workers, len(windows))
    procs, conns = [], []
    for k in range(n):
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_worker, args=(model, windows, k, n, choices, cfg, send), daemon=True)
        p.start()
        send.close()
        procs.append(p)
        conns.append(recv)
    pending: dict = {}
    nxt = 0
    try:
        alive = list(conns)
        while alive:
            for c in wait(alive):
                try:
                    msg = c.recv()
                except EOFError:
                    alive.remove(c)
                    continue
                if msg[0] == "pass":
                    if on_pass:
                        on_pass(msg[1])
                elif msg[0] == "window":
                    pending[msg[1]] = msg[2]
                else:
                    _, known, text = msg
                    raise (PagedKVError(text) if known else PagedKVError(f"an eval worker failed: {text}"))
            while nxt in pending:
                yield nxt, pending.pop(nxt)
                nxt += 1
        if nxt != len(windows):
            codes = [p.exitcode for p in procs]
            raise PagedKVError(f"an eval worker exited before its windows were done (exit codes {codes}); "
                               "try --workers 1")
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join()
        for c in conns:
            c.close()
