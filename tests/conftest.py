"""Session-wide test setup.

Without a CUDA device the Triton kernels (`pagedkv.ops.triton`, tests in test_triton.py) run in
Triton's CPU interpreter. Triton decides interpreter-or-compiler when it decorates functions,
its own standard library included, so TRITON_INTERPRET=1 must be in the environment before
`triton` is first imported by anything; setting it here, before any test module is collected,
is that edge. With a GPU nothing is set and the same tests run the compiled kernels.

Tests run torch on one intra-op thread: on a shared 2-core machine torch's thread pool turns
tiny ops into millisecond waits (4.8 ms vs 19 us measured for a [30,2,16]@[16,16] matmul), and
no test here times anything. Tests of multi-threaded kernels pass their thread count explicitly.
"""

import os

import pytest

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(1)


def pytest_addoption(parser):
    parser.addoption("--kernel-variant", default=None, choices=("avx512", "avx2", "scalar"),
                     help="run the tests against this build of the C CPU kernel instead of the best one "
                          "this CPU runs (e.g. avx2 on an AVX-512 machine, so that the AVX2-only fast "
                          "paths stay tested there)")


def pytest_configure(config):
    variant = config.getoption("--kernel-variant")
    if variant is None:
        return
    from pagedkv.ops import cpu
    from pagedkv.ops.cpu import build

    best = build.detect_variant()
    order = ("scalar", "avx2", "avx512")
    if order.index(variant) > order.index(best):
        raise pytest.UsageError(f"--kernel-variant {variant}: this CPU runs at most the {best} build")
    cpu.load(build.KernelConfig(variant=variant))
