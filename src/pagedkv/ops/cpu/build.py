"""Compile and load the C attention kernel with the machine's C compiler, once, cached on disk.

The kernel sources (`attention_kernel.c`, `store_kernel.c`) ship with the package. On first use
they are compiled into one `<cache_dir>/attention-<variant>-<hash>.so`, the hash covering the sources, the compiler, the flags and
the CPU feature flags, so a changed source or a different machine never loads a stale build. The
write is atomic (compile to a temporary name, then rename), so concurrent processes (pytest-xdist)
are safe.

Variants, chosen by runtime CPU feature detection (`/proc/cpuinfo` flags, else torch's CPU
capability):
- "avx512": AVX-512 F/BW/VL/VBMI intrinsics (byte-permute decode, vpermps 16-entry tables);
- "avx2":   the portable C path compiled with -mavx2 -mfma (compiler-vectorised);
- "scalar": the portable C path, no ISA flags.
OpenMP is used when the compiler accepts -fopenmp, else the kernel runs single-threaded.

Configuration (`KernelConfig`) is passed in, never read from the environment here.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("attention_kernel.c")
STORE_SOURCE = Path(__file__).with_name("store_kernel.c")
SOURCES = (SOURCE, STORE_SOURCE)
ABI_VERSION = 3  # must match PKV_ABI_VERSION in the C source
STORE_ABI_VERSION = 1  # must match pkv_store_abi() in store_kernel.c

VARIANT_FLAGS = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vbmi", "-mfma", "-mf16c"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "scalar": [],
}
BASE_FLAGS = ["-O3", "-std=c11", "-shared", "-fPIC", "-fno-math-errno"]
AVX512_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512vbmi")
AVX2_CPU_FLAGS = ("avx2", "fma", "f16c")


class KernelUnavailable(RuntimeError):
    """No C compiler, or the kernel failed to compile or load (the caller falls back)."""


@dataclass(frozen=True)
class KernelConfig:
    """Where and how to build the kernel.

    cache_dir: directory for the compiled libraries (None: ~/.cache/pagedkv/kernels, or a
    temporary directory if that is not writable). compiler: executable name or path (None: the
    first of cc, gcc, clang found). variant: "avx512" | "avx2" | "scalar" | None (detect).
    """

    cache_dir: Optional[str] = None
    compiler: Optional[str] = None
    variant: Optional[str] = None


def cpu_flags() -> frozenset:
    """The CPU feature flags of this machine (Linux /proc/cpuinfo; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def detect_variant(flags: Optional[frozenset] = None) -> str:
    """The best kernel variant this CPU runs."""
    if platform.machine().lower() not in ("x86_64", "amd64", "i686", "x86"):
        return "scalar"
    flags = cpu_flags() if flags is None else flags
    if flags:
        if all(f in flags for f in AVX512_CPU_FLAGS):
            return "avx512"
        if all(f in flags for f in AVX2_CPU_FLAGS):
            return "avx2"
        return "scalar"
    try:  # no /proc/cpuinfo: ask torch (its AVX512 level does not promise VBMI, so take avx2)
        import torch

        cap = torch.backends.cpu.get_cpu_capability()
        return "avx2" if cap in ("AVX2", "AVX512") else "scalar"
    except Exception:
        return "scalar"


def find_compiler(name: Optional[str] = None) -> str:
    for cand in ([name] if name else ["cc", "gcc", "clang"]):
        path = shutil.which(cand)
        if path:
            return path
    raise KernelUnavailable(f"no C compiler found (tried {name or 'cc, gcc, clang'}); "
                            "install gcc or clang to enable the fast CPU attention path")


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "pagedkv" / "kernels"


def _writable_dir(preferred: Optional[str]) -> Path:
    for cand in ([Path(preferred)] if preferred else [default_cache_dir()]) + [
            Path(tempfile.gettempdir()) / f"pagedkv-kernels-{os.getuid() if hasattr(os, 'getuid') else 'u'}"]:
        try:
            cand.mkdir(parents=True, exist_ok=True)
            if os.access(cand, os.W_OK):
                return cand
        except OSError:
            continue
    raise KernelUnavailable("no writable directory for the compiled kernel")


def _compile(cc: str, flags: list, out: Path) -> tuple[bool, str]:
    tmp = out.with_name(f".{out.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    cmd = [cc, *flags, *(str(src) for src in SOURCES), "-o", str(tmp), "-lm"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, str(exc)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        return False, proc.stderr.strip()[-2000:]
    os.replace(tmp, out)
    return True, ""


@dataclass(frozen=True)
class LoadedKernel:
    """A loaded kernel library and how it was built."""

    lib: ctypes.CDLL
    path: str
    variant: str
    openmp: bool
    compiler: str


def build_and_load(config: KernelConfig = KernelConfig()) -> LoadedKernel:
    """Compile (if not cached) and load the kernel; KernelUnavailable on any failure."""
    variant = config.variant or detect_variant()
    if variant not in VARIANT_FLAGS:
        raise KernelUnavailable(f"unknown kernel variant {variant!r}; valid: {', '.join(VARIANT_FLAGS)}")
    cc = find_compiler(config.compiler)
    source = b"\0".join(src.read_bytes() for src in SOURCES)
    directory = _writable_dir(config.cache_dir)
    last_err = ""
    for openmp in (True, False):
        flags = BASE_FLAGS + VARIANT_FLAGS[variant] + (["-fopenmp"] if openmp else [])
        key = hashlib.sha256(b"\0".join([source, cc.encode(), " ".join(flags).encode(),
                                         " ".join(sorted(cpu_flags())).encode(),
                                         platform.machine().encode()])).hexdigest()[:16]
        out = directory / f"attention-{variant}-{key}.so"
        if not out.exists():
            ok, last_err = _compile(cc, flags, out)
            if not ok:
                log.info("pagedkv: compiling the CPU kernel with %s failed: %s", " ".join(flags), last_err)
                continue
            log.info("pagedkv: compiled the CPU attention kernel (%s) into %s", variant, out)
        try:
            lib = ctypes.CDLL(str(out))
        except OSError as exc:
            last_err = str(exc)
            continue
        if lib.pkv_abi_version() != ABI_VERSION:
            raise KernelUnavailable(f"kernel ABI {lib.pkv_abi_version()} != expected {ABI_VERSION}")
        if lib.pkv_store_abi() != STORE_ABI_VERSION:
            raise KernelUnavailable(f"store kernel ABI {lib.pkv_store_abi()} != expected {STORE_ABI_VERSION}")
        return LoadedKernel(lib, str(out), variant, bool(lib.pkv_has_openmp()), cc)
    raise KernelUnavailable(f"could not build the CPU attention kernel ({variant}): {last_err}")
