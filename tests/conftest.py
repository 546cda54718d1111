"""Session-wide test setup.

Without a CUDA device the Triton kernels (`pagedkv.ops.triton`, tests in test_triton.py) run in
Triton's CPU interpreter. Triton decides interpreter-or-compiler when it decorates functions,
its own standard library included, so TRITON_INTERPRET=1 must be in the environment before
`triton` is first imported by anything; setting it here, before any test module is collected,
is that edge. With a GPU nothing is set and the same tests run the compiled kernels.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
