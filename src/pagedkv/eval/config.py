"""What `pagedkv eval` evaluates: the default formats and `EvalConfig`, torch-free so that the
CLI shows and checks them before anything heavy is imported."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..defaults import BLOCK_SIZE
from ..errors import ConfigError
from .compute import Compute

DEFAULT_FORMATS = ("bf16", "fp8", "q8_0", "q4_0", "turbo8", "turbo4", "turbo3", "turbo2",
                   "fp8k_turbo3v", "bf16k_turbo2v", "fp8k_turbo2v", "turbo3+hp")
REFERENCE_FORMAT = "bf16"


@dataclass(frozen=True)
class EvalConfig:
    """What to evaluate. model/text: paths or None for the embedded ones; compute: threads per
    process and worker processes (resolved at the CLI edge, see `pagedkv.eval.compute`)."""

    model: Optional[str] = None
    text: Optional[str] = None
    formats: tuple[str, ...] = DEFAULT_FORMATS
    windows: int = 8
    subset: Optional[int] = None  # evaluate only this many of the windows (first and last included)
    window_tokens: int = 1024
    memory_bytes: int = 8 * 2**30
    decode_steps: int = 6
    block_size: int = BLOCK_SIZE
    compute: Compute = Compute()

    def __post_init__(self):
        if not self.formats:
            raise ConfigError("--formats needs at least one format")
        for name, v, least in (("--windows", self.windows, 1), ("--window-tokens", self.window_tokens, 2),
                               ("--memory", self.memory_bytes, 1), ("--decode-steps", self.decode_steps, 0),
                               ("--block-size", self.block_size, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise ConfigError(f"{name} must be an integer >= {least}, got {v!r}")
        if self.subset is not None and not (isinstance(self.subset, int) and 1 <= self.subset <= self.windows):
            raise ConfigError(f"--subset must be between 1 and --windows ({self.windows}), got {self.subset!r}")

    @property
    def evaluated_windows(self) -> int:
        return self.subset or self.windows
