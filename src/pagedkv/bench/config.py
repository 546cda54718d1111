"""Settings of each benchmark target as frozen dataclasses; torch-free so that `pagedkv bench
TARGET --help` shows their defaults without importing torch (the harnesses import torch)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

from ..defaults import BLOCK_SIZE
from ..errors import ConfigError

# The embedded model's attention shape (SmolLM2-135M): the CPU benchmarks' default.
EMBEDDED_SHAPE = {"layers": 30, "num_q_heads": 9, "num_kv_heads": 3, "head_dim": 64}


@dataclass(frozen=True)
class BenchShape:
    """`bench attention` (CPU): the model shape and the timing settings of a run."""

    layers: int = EMBEDDED_SHAPE["layers"]
    num_q_heads: int = EMBEDDED_SHAPE["num_q_heads"]
    num_kv_heads: int = EMBEDDED_SHAPE["num_kv_heads"]
    head_dim: int = EMBEDDED_SHAPE["head_dim"]
    block_size: int = BLOCK_SIZE
    repeats: int = 5
    threads: int = 1
    memory_budget: int = 1 << 30  # bytes one contender may allocate (timed layers shrink to fit)
    huge_pages: bool = True  # both sides' caches on 2 MiB pages where the OS allows (ops.hugepages)
    clock: str = "auto"  # "cpu": the calling thread's CPU time; "wall"; "auto": cpu when threads == 1

    def timer(self) -> Callable[[], float]:
        """The clock timings use. With one thread both sides compute in the calling thread (torch
        intra-op and the kernel's OpenMP region of one), so its CPU time excludes the time the OS
        gives to other processes on a shared machine; with more threads only wall time is right."""
        if self.clock == "cpu" or (self.clock == "auto" and self.threads == 1):
            return time.thread_time
        return time.perf_counter

    def check(self) -> None:
        for name in ("layers", "num_q_heads", "num_kv_heads", "head_dim", "block_size", "repeats", "threads"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name} must be a positive integer, got {v!r}")
        if self.num_q_heads % self.num_kv_heads:
            raise ConfigError(f"num_q_heads ({self.num_q_heads}) must be a multiple of num_kv_heads "
                              f"({self.num_kv_heads})")
        if self.clock not in ("auto", "cpu", "wall"):
            raise ConfigError(f"clock must be auto, cpu or wall, got {self.clock!r}")


@dataclass(frozen=True)
class AttentionBench:
    """`bench attention` (CPU): what to run besides the shape."""

    formats: tuple = ("bf16", "fp8", "turbo4", "turbo3", "turbo2", "fp8k_turbo3v")
    contexts: tuple = (1024, 4096, 16384, 32768)
    batches: tuple = (1, 8)
    prefill: bool = True
    prefill_shapes: tuple = ((4096, 512),)  # (context, queries at its end) per chunked-prefill row
    memory: bool = True


def check_prefill_shapes(shapes) -> None:
    """ConfigError unless every shape is (context, queries) with 1 <= queries <= context."""
    for ps in shapes:
        if (not isinstance(ps, tuple) or len(ps) != 2 or any(isinstance(x, bool) or not isinstance(x, int) for x in ps)
                or not 1 <= ps[1] <= ps[0]):
            raise ConfigError(f"a prefill shape is (context, queries) with 1 <= queries <= context, got {ps!r}")


@dataclass(frozen=True)
class BenchConfig:
    """`bench attention --device cuda`: what to run. formats: KV format names (`turbo3`,
    `fp8k_turbo3v`, ...). precisions: matmul operand precision of our kernels ("fp32" accurate,
    "tf32", "bf16"; fp32 accumulation always)."""

    batch: int = 32
    context: int = 32768
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = BLOCK_SIZE
    formats: tuple = ("bf16", "fp8", "turbo8", "q8_0", "turbo4", "turbo3", "turbo2", "fp8k_turbo3v")
    precisions: tuple = ("fp32", "bf16")
    prefill_batch: int = 4
    prefill_chunk: int = 2048
    decode_block_n: Optional[int] = None  # None: the launcher's choice per precision
    prefill_block_m: Optional[int] = None  # None: the launcher's choice
    prefill_block_n: int = 32
    seed: int = 0
    dry_run: bool = False

    @staticmethod
    def tiny() -> "BenchConfig":
        """The dry-run shapes: seconds on a CPU under the interpreter."""
        return BenchConfig(batch=2, context=48, num_q_heads=4, num_kv_heads=2, head_dim=64,
                           formats=("bf16", "turbo3"), precisions=("fp32",), prefill_batch=1,
                           prefill_chunk=16, dry_run=True)

    def check(self) -> None:
        from ..formats import parse_format

        for name in ("batch", "context", "num_q_heads", "num_kv_heads", "head_dim", "block_size",
                     "prefill_batch", "prefill_chunk"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_q_heads % self.num_kv_heads:
            raise ConfigError(f"num_q_heads {self.num_q_heads} must be a multiple of num_kv_heads {self.num_kv_heads}")
        if self.context % self.block_size:
            raise ConfigError(f"context {self.context} must be a multiple of block_size {self.block_size}")
        if self.prefill_batch > self.batch or self.prefill_chunk > self.context:
            raise ConfigError("prefill_batch <= batch and prefill_chunk <= context are required")
        for f in self.formats:
            parse_format(f)


@dataclass(frozen=True)
class OffloadBench:
    """`bench offload`: the prefix, the cache shape, the tiers."""

    formats: tuple = ("bf16", "q8_0", "turbo4", "turbo3")
    tokens: int = 512
    layers: int = EMBEDDED_SHAPE["layers"]
    kv_heads: int = EMBEDDED_SHAPE["num_kv_heads"]
    head_dim: int = EMBEDDED_SHAPE["head_dim"]
    block_size: int = BLOCK_SIZE
    repeats: int = 3
    redis_url: Optional[str] = None
    disk_dir: Optional[str] = None
    model: Optional[str] = None

    def __repr__(self) -> str:  # a password in redis_url shown as ***
        from ..offload.config import redacted_repr  # here: the CLI parses these settings without torch

        return redacted_repr(self)


@dataclass(frozen=True)
class MemoryBench:
    """`bench memory`: one generation per format, each in its own process."""

    formats: tuple = ("bf16", "turbo3")
    context: int = 16384
    chunk: int = 256
    new_tokens: int = 16
    threads: Optional[int] = 1
    malloc: str = "fixed"
    warmup: bool = True
