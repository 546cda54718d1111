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

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(1)
