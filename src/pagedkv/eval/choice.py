"""The rows of `pagedkv eval`: a spec string (`pagedkv.spec`) as a FormatChoice, the label the
tables print and the arguments `cache_for` passes to the cache."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from ..errors import ConfigError
from ..formats import KVFormat
from ..spec import RecentWindow, parse_spec, window_from_label


def parse_window(spec: str, what: str = "recent window") -> RecentWindow:
    """`r64` / `64` (bf16 tail), `r64q8_0`, `r64s16q8_0` (the first 16 positions, attention sinks,
    also read from the tail) -> RecentWindow; ConfigError naming `what` and the bad value."""
    recent = window_from_label(spec)
    if recent is None:
        raise ConfigError(f"{what} must be R[sS][codec] (e.g. 64s16q8_0, 64q8_0, 64), got {spec!r}")
    return recent


@dataclass(frozen=True)
class FormatChoice:
    """One row of the evaluation: a KV format and its high-precision layers.

    `turbo3` = turbo3 everywhere; `turbo3+hp` = turbo3 with the automatic first/last
    high-precision layers (see `pagedkv.cache.config`); `turbo3+hp2` = two at each end;
    a last `+r64` / `+r64q8_0` adds a high-precision recent window of 64 tokens in bf16 / q8_0
    (`pagedkv.ops.recent`).
    """

    label: str
    kv_format: Union[KVFormat, str]  # a str: a plan file (`pagedkv tune`), one format per layer
    high_precision_layers: Union[int, str]
    recent: Optional[RecentWindow] = None
    tune_bits: Optional[float] = None  # a `tunedB` label before its plan is made (`eval.tuned`)
    tune_context: Optional[int] = None  # N of a `tunedB@N` label (`eval.tuned`)

    @property
    def format_name(self) -> str:
        return self.kv_format if isinstance(self.kv_format, str) else self.kv_format.name


def parse_choice(spec: str) -> FormatChoice:
    """The FormatChoice of a spec string (`pagedkv.spec`: `name`, `name+hp`, `name+hpN`, each
    optionally followed by `+r<R>[sS][codec]`; a plan file; `tunedB[@N]`); ConfigError naming the bad part."""
    k = parse_spec(spec, "format")
    if k.tune_bits is not None:
        return FormatChoice(k.label, k.label, 0, None, k.tune_bits, k.tune_context)
    if k.plan is not None:
        return FormatChoice(k.label, k.plan, 0, k.recent_window)
    return FormatChoice(k.label, k.format, k.high_precision_layers or 0, k.recent_window)
