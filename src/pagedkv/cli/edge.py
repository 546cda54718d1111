"""Checks and settings shared by the sub-commands, all done before anything heavy is loaded:
the compute setting (threads, workers), output files, input files."""

from __future__ import annotations

import argparse
import os
from typing import Optional

from ..errors import ConfigError


def add_compute_arguments(p: argparse.ArgumentParser, workers: bool = False) -> None:
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per process (default: the idle CPUs, i.e. CPUs minus the 1-minute "
                        "load average, at least 1" + ("; with several workers 1 each)" if workers else ")"))
    if workers:
        p.add_argument("--workers", type=int, default=None,
                       help="worker processes sharing the windows (default: the idle CPUs, at most one "
                            "per window; 1 = in this process)")


def on_gpu(device: Optional[str]) -> bool:
    """Whether a --device value names a CUDA device ("auto" where one is available): the one
    device rule (`eval.model.resolve_device`), so a bad value fails here, before anything loads."""
    if not device:
        return False
    from ..eval.model import resolve_device

    return resolve_device(device).type == "cuda"


def compute_from_args(args, parallel_work: int = 1):
    """The threads and workers of a command. On a GPU the work runs in this process: worker
    processes are forked, and a forked process cannot use the CUDA context of its parent, so
    the default is one worker there and more is refused before anything loads."""
    from ..eval.compute import Compute

    workers = getattr(args, "workers", None)
    device = getattr(args, "device", None)
    if on_gpu(device):
        if workers is not None and workers > 1:
            raise ConfigError(f"--workers {workers} with --device {device}: worker processes are forked and "
                              "cannot use the GPU; use --workers 1 (one process drives the GPU)")
        parallel_work = 1
    return Compute.resolve(args.threads, workers if parallel_work > 1 else 1, parallel_work=parallel_work)


def check_output_file(path: Optional[str], flag: str, suffix: str) -> None:
    """An output file the command writes at the end: the right suffix, an existing writable
    directory; checked first so that a finished run is never lost to a bad path."""
    if path is None:
        return
    if not path.lower().endswith(suffix):
        raise ConfigError(f"{flag} {path!r}: give a {suffix} file name")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ConfigError(f"{flag} {path!r}: the directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise ConfigError(f"{flag} {path!r}: the directory {parent} is not writable")
    if os.path.isdir(path):
        raise ConfigError(f"{flag} {path!r} is a directory; give a file name")


def read_text_arg(path: Optional[str]) -> str:
    """The --text file (or the default text), refusing a missing, unreadable or empty one."""
    from ..eval.text import read_text

    try:
        text = read_text(path)
    except OSError as exc:
        raise ConfigError(f"--text {path!r}: cannot read it ({exc.strerror or exc})") from None
    if not text.strip():
        raise ConfigError(f"--text {path!r} is empty; pass a UTF-8 text file with some text in it")
    return text


def formats_for_model(names, source, log, config=None) -> tuple:
    """The formats of the --formats `names` for the model at `source` (an `eval.model.ModelSource`),
    checked against the context it was trained to before its tokenizer and weights load: a
    list's plan for a longer context is taken at the model's (`eval.config.expand_formats`), a
    `tunedB@N` named on its own past it is a ConfigError. The model's config (`config`, else
    read from `source`) is read only when a plan for a context is listed."""
    from ..eval.config import expand_formats
    from ..spec import tuned_context

    formats = expand_formats(names)
    if all(tuned_context(f) is None for f in formats):
        return formats
    from ..integrations.model_config import trained_context
    from ..tune import check_context

    if config is None:
        from ..eval.model import load_config

        config = load_config(source)
    formats = expand_formats(names, trained_context(config), log)
    for f in formats:
        n = tuned_context(f)
        if n is not None:
            check_context(config, n, f"--formats {f}: a plan for a context of")
    return formats
