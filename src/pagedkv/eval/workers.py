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


def _window_work(model, share, conn, windows, choices, cfg, window_parts) -> None:
    """A worker's windows: every format's parts of each (`window_parts`, the runner's: passed in,
    so that this module never imports the runner back), sent as ("result", wi, parts)."""
    for wi in share:
        parts = window_parts(model, wi, windows[wi], choices, cfg, lambda label: conn.send(("progress", label)))
        conn.send(("result", wi, parts))


def parallel_windows(model, windows: Sequence, choices, cfg, on_pass: Optional[Callable[[str], None]],
                     window_parts: Callable) -> Iterator[tuple[int, list]]:
    """Yield (window index, per-format parts) in window order, computed by cfg.compute.workers
    forked processes (see the module docstring) each calling `window_parts`."""
    n = min(cfg.compute.workers, len(windows))
    shares = [list(range(k, len(windows), n)) for k in range(n)]
    pending: dict = {}
    nxt = 0
    for wi, parts in fork_map(model, shares, _window_work, (windows, choices, cfg, window_parts), cfg.compute.threads,
                              on_pass, "eval"):
        pending[wi] = parts
        while nxt in pending:
            yield nxt, pending.pop(nxt)
            nxt += 1


def _worker(model, share, work, args, threads: int, conn) -> None:
    import torch

    try:
        torch.set_num_threads(threads)
        work(model, share, conn, *args)
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


def fork_map(model, shares: Sequence[Sequence[int]], work: Callable, args: tuple, threads: int,
             on_progress: Optional[Callable[[str], None]] = None, what: str = "eval") -> Iterator[tuple[int, object]]:
    """One forked process per share (a list of item indices), `threads` torch threads each, the
    model shared copy-on-write. In the child `work(model, share, conn, *args)` sends
    ("progress", label) and ("result", index, payload) for each item; this yields
    (index, payload) as results arrive, calls on_progress(label), and raises PagedKVError on
    one line when a worker fails or exits before every item of its share is done."""
    if not fork_available():
        raise ConfigError("--workers above 1 needs the fork start method (Linux, macOS); use --workers 1")
    ctx = mp.get_context("fork")
    procs, conns = [], []
    for share in shares:
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_worker, args=(model, share, work, args, threads, send), daemon=True)
        p.start()
        send.close()
        procs.append(p)
        conns.append(recv)
    done = 0
    try:
        alive = list(conns)
        while alive:
            for c in wait(alive):
                try:
                    msg = c.recv()
                except EOFError:
                    alive.remove(c)
                    continue
                if msg[0] == "progress":
                    if on_progress:
                        on_progress(msg[1])
                elif msg[0] == "result":
                    done += 1
                    yield msg[1], msg[2]
                else:
                    _, known, text = msg
                    raise (PagedKVError(text) if known else PagedKVError(f"an {what} worker failed: {text}"))
        if done != sum(len(s) for s in shares):
            codes = [p.exitcode for p in procs]
            raise PagedKVError(f"an {what} worker exited before its work was done (exit codes {codes}); "
                               "try --workers 1")
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join()
        for c in conns:
            c.close()
