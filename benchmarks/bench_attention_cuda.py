"""GPU benchmark of pagedkv's Triton ops vs torch SDPA / flash-attn over a contiguous bf16 cache.

Thin wrapper over `pagedkv bench attention --device cuda` (same flags), e.g.

    python benchmarks/bench_attention_cuda.py                    # headline: batch 32, 32k context (GPU)
    python benchmarks/bench_attention_cuda.py --formats turbo3,bf16 --json
    python benchmarks/bench_attention_cuda.py --dry-run          # tiny shapes on the CPU (interpreter)

The harness is `pagedkv.bench.attention_cuda`.
"""

import sys

from pagedkv.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "attention", "--device", "cuda", *sys.argv[1:]]))
