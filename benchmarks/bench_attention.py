"""Decode/prefill attention on the compressed paged cache vs torch over bf16 (side by side).

Thin wrapper over `pagedkv bench attention` (same flags), e.g.

    .venv/bin/python benchmarks/bench_attention.py --contexts 16k,32k --batch 1 --json
"""

import sys

from pagedkv.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "attention", *sys.argv[1:]]))
