"""Compile and load the C attention kernel with the machine's C compiler, once, cached on disk.

The kernel sources (`attention_kernel.c`, `store_kernel.c`) ship with the package. On first use
they are compiled into one `<cache_dir>/attention-<variant>-<hash>.so`, the hash covering the sources, the compiler, the flags and
the CPU feature flags, so a changed source or a different machine never loads a stale build. The
write is atomic (compile to a temporary name, then rename), so concurrent processes (pytest-xdist)
are safe.

Trust: a library found in the cache directory is code this process will run, so nothing is loaded
from a place another user could have written (issue 12, item 7). The directory is created private
(0700); before a library is loaded, the directory and the file must be owned by this user, be no
symbolic links, and not be writable by group or others (`private_problem`). An explicit
`cache_dir` that fails is an error (KernelUnavailable naming the problem); the default directories
(~/.cache/pagedkv/kernels, then <tmp>/pagedkv-kernels-<uid>) that fail are skipped, and the last
resort is a fresh private directory made by `tempfile.mkdtemp` (compiled anew in this process).

Variants, chosen by runtime CPU feature detection (`/proc/cpuinfo` flags, else torch's CPU
capability):
- "avx512": AVX-512 F/BW/VL/VBMI intrinsics (byte-permute decode, vpermps 16-entry tables),
  plus VNNI (vpdpbusd) and BF16 (vdpbf16ps) where the CPU has them (`EXTENSION_FLAGS`: the
  source tests `__AVX512VNNI__` / `__AVX512BF16__`);
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

from ...private import private_dir, private_problem

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("attention_kernel.c")
STORE_SOURCE = Path(__file__).with_name("store_kernel.c")
SOURCES = (SOURCE, STORE_SOURCE)
HEADERS = (Path(__file__).with_name("attention_i8.h"),  # included by SOURCE: part of the hash
           Path(__file__).with_name("prefill_kernel.h"))
ABI_VERSION = 6  # must match PKV_ABI_VERSION in the C source
STORE_ABI_VERSION = 2  # must match pkv_store_abi() in store_kernel.c

VARIANT_FLAGS = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vbmi", "-mfma", "-mf16c"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "scalar": [],
}
# Optional extensions a variant compiles in when this CPU has them: (cpu flag, compiler flag).
EXTENSION_FLAGS = {
    "avx512": [("avx512_vnni", "-mavx512vnni"), ("avx512_bf16", "-mavx512bf16")],
    "avx2": [],
    "scalar": [],
}
BASE_FLAGS = ["-O3", "-std=c11", "-shared", "-fPIC", "-fno-math-errno"]
AVX512_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512vbmi")
AVX2_CPU_FLAGS = ("avx2", "fma", "f16c")
COMPILE_TIMEOUT_S = 900  # one-time; ~20-25 s of CPU for a SIMD variant, far longer on a loaded machine


class KernelUnavailable(RuntimeError):
    """No C compiler, or the kernel failed to compile or load (the caller falls back)."""


@dataclass(frozen=True)
class KernelConfig:
    """Where and how to build the kernel.

    cache_dir: directory for the compiled libraries (None: ~/.cache/pagedkv/kernels, else a
    private temporary directory; see the module docstring's "Trust"). compiler: executable name or path (None: the
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


def _candidate_dirs(preferred: Optional[str]):
    """(directory, explicit) to build into, in order; the caller takes the first that passes."""
    if preferred:
        yield Path(preferred), True
        return
    yield default_cache_dir(), False
    uid = os.getuid() if hasattr(os, "getuid") else "u"
    yield Path(tempfile.gettempdir()) / f"pagedkv-kernels-{uid}", False


def _compile(cc: str, flags: list, out: Path, sources=SOURCES) -> tuple[bool, str]:
    """Compile `sources` (default: this package's) into the library `out`: (ok, compiler error)."""
    tmp = out.with_name(f".{out.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    cmd = [cc, *flags, *(str(src) for src in sources), "-o", str(tmp), "-lm"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
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


def _flags(variant: str, openmp: bool) -> list:
    have = cpu_flags()
    extensions = [flag for cpu_flag, flag in EXTENSION_FLAGS[variant] if cpu_flag in have]
    return BASE_FLAGS + VARIANT_FLAGS[variant] + extensions + (["-fopenmp"] if openmp else [])


def library_name(variant: str, cc: str, openmp: bool) -> str:
    """File name of the library for these settings (a hash of sources, compiler, flags, CPU)."""
    source = b"\0".join(src.read_bytes() for src in (*SOURCES, *HEADERS))
    key = hashlib.sha256(b"\0".join([source, cc.encode(), " ".join(_flags(variant, openmp)).encode(),
                                     " ".join(sorted(cpu_flags())).encode(),
                                     platform.machine().encode()])).hexdigest()[:16]
    return f"attention-{variant}-{key}.so"


def _load_from(directory: Path, variant: str, cc: str) -> tuple[Optional[LoadedKernel], str, Optional[str]]:
    """(kernel or None, last compile / load error, trust problem): builds what is missing, loads
    only a library that `private_problem` accepts."""
    last_err = ""
    for openmp in (True, False):
        out = directory / library_name(variant, cc, openmp)
        if not os.path.lexists(out):
            ok, last_err = _compile(cc, _flags(variant, openmp), out)
            if not ok:
                log.info("pagedkv: compiling the CPU kernel with %s failed: %s",
                         " ".join(_flags(variant, openmp)), last_err)
                continue
            log.info("pagedkv: compiled the CPU attention kernel (%s) into %s", variant, out)
        problem = private_problem(out, directory=False)
        if problem is not None:
            return None, last_err, f"{out} {problem}"
        try:
            lib = ctypes.CDLL(str(out))
        except OSError as exc:
            last_err = str(exc)
            continue
        if lib.pkv_abi_version() != ABI_VERSION:
            raise KernelUnavailable(f"kernel ABI {lib.pkv_abi_version()} != expected {ABI_VERSION}")
        if lib.pkv_store_abi() != STORE_ABI_VERSION:
            raise KernelUnavailable(f"store kernel ABI {lib.pkv_store_abi()} != expected {STORE_ABI_VERSION}")
        return LoadedKernel(lib, str(out), variant, bool(lib.pkv_has_openmp()), cc), last_err, None
    return None, last_err, None


def build_and_load(config: KernelConfig = KernelConfig()) -> LoadedKernel:
    """Compile (if not cached) and load the kernel; KernelUnavailable on any failure, including an
    explicit `cache_dir` (or a library in it) that another user could have written."""
    variant = config.variant or detect_variant()
    if variant not in VARIANT_FLAGS:
        raise KernelUnavailable(f"unknown kernel variant {variant!r}; valid: {', '.join(VARIANT_FLAGS)}")
    cc = find_compiler(config.compiler)
    for directory, explicit in _candidate_dirs(config.cache_dir):
        problem = private_dir(directory)
        if problem is None:
            kernel, last_err, problem = _load_from(directory, variant, cc)
            if kernel is not None:
                return kernel
            if problem is None:  # the compiler failed: another directory would not help
                raise KernelUnavailable(f"could not build the CPU attention kernel ({variant}): {last_err}")
        else:
            problem = f"{directory} {problem}"
        if explicit:
            raise KernelUnavailable(f"refusing the kernel cache directory: {problem}; use a directory owned "
                                    "by this user and not writable by others (chmod 700)")
        log.warning("pagedkv: not loading the CPU kernel from there: %s; trying a safer directory", problem)
    fresh = Path(tempfile.mkdtemp(prefix="pagedkv-kernels-"))  # unique name, mode 0700
    kernel, last_err, problem = _load_from(fresh, variant, cc)
    if kernel is None:
        raise KernelUnavailable(f"could not build the CPU attention kernel ({variant}): {problem or last_err}")
    return kernel
