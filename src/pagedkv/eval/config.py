"""What `pagedkv eval` evaluates: the default formats and `EvalConfig`, torch-free so that the
CLI shows and checks them before anything heavy is imported."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from ..approx import Approximation
from ..defaults import BLOCK_SIZE
from ..errors import ConfigError
from .compute import Compute

# The plain ladder, then the best measured formats with a high-precision window (the last R and
# the first 16 positions in a q8_0 tail), the plan `pagedkv tune` makes at each issue budget, and
# the plans it makes for an 8k context (`tunedB@8k`: measured on an 8k calibration window, bits
# counted at 8k; SmolLM2's trained context; issue 33). On a model trained to fewer positions
# those two are taken at its context (`expand_formats`).
DEFAULT_FORMATS = ("bf16", "fp8", "q8_0", "q4_0", "turbo8", "turbo4", "turbo3", "turbo2",
                   "fp8k_turbo3v", "turbo3+hp",
                   "turbo3+r64s16q8_0", "turbo3k_turbo2v+r32s16q8_0", "turbo2g64+r16s16q8_0",
                   "tuned4.5", "tuned3.5", "tuned2.5", "tuned4.5@8k", "tuned3.5@8k")
# `make demo` (`--formats demo`): the window rows run the recent window's reference attention
# (~3.5x a plain pass) and a tuned plan needs the tune's measurement first, so the demo keeps the
# plain ladder and the three window rows of the budgets, near the old 12-format time.
DEMO_FORMATS = ("bf16", "turbo4", "turbo3", "turbo2",
                "turbo3+r64s16q8_0", "turbo3k_turbo2v+r32s16q8_0", "turbo2g64+r16s16q8_0")
# `--formats retrieval`: the rows of the recorded retrieval study (docs/long-context.md): bf16,
# fp8 and turbo3, and the best rows found at the budgets as stored at 2k-8k: <= 4.5 bits
# (turbo4g32+r32s16q8_0), <= 3.5 bits (4-bit keys / 2-bit values with the window: passkey and
# multikey at 2k; the 128-token window over turbo3g32: passkey at 8k, 3.62 bits at 2k), <= 2.5.
RETRIEVAL_FORMATS = ("bf16", "fp8", "turbo3", "turbo4g32+r32s16q8_0", "turbo4g32k_turbo2g64v+r32s16q8_0",
                     "turbo3g32+r128s16q8_0", "turbo2g64+r16s16q8_0")
FORMAT_LISTS = {"default": DEFAULT_FORMATS, "demo": DEMO_FORMATS, "retrieval": RETRIEVAL_FORMATS}
REFERENCE_FORMAT = "bf16"


def expand_formats(names, context: Optional[int] = None,
                   log: Optional[Callable[[str], None]] = None) -> tuple[str, ...]:
    """Format names with the list names of FORMAT_LISTS (`default`, `demo`) replaced by their
    formats, in order, each format once. context: the model's trained positions (None: not
    known); a list's plan for a longer context (`tunedB@N`, N > context) is taken at the
    model's context instead (`tunedB@<context>`, said in a line to `log`), so that a list runs
    on any model. A format named on its own is kept as given (`pagedkv.tune.check_context`
    refuses it)."""
    out: list[str] = []
    for n in names:
        listed = FORMAT_LISTS.get(n.strip().lower())
        for f in listed or (n,):
            if listed and context is not None:
                f = _within_context(f, n.strip().lower(), context, log)
            if f not in out:
                out.append(f)
    return tuple(out)


def _within_context(label: str, listed: str, context: int, log) -> str:
    from ..spec import tuned_bits, tuned_context

    n = tuned_context(label)
    if n is None or n <= context:
        return label
    fitted = f"tuned{tuned_bits(label):g}@{context}"
    if log is not None:
        log(f"{label} of the {listed} list: the model was trained to {context} positions; {fitted} instead")
    return fitted


MAX_WINDOWS = 100_000  # windows spread over a text: each is a forward pass per format


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
    approx: Approximation = Approximation()  # the listed formats' attention; the bf16 reference stays exact
    # > 0: score only the last N tokens of each window, each predicted by a one-token decode step
    # (the decode paths `approx` may change), the first L - N tokens a prefill (see `runner`)
    decode_tail: int = 0

    def __post_init__(self):
        if not self.formats:
            raise ConfigError("--formats needs at least one format")
        for name, v, least, most in (("--windows", self.windows, 1, MAX_WINDOWS),
                                     ("--window-tokens", self.window_tokens, 2, 1 << 24),
                                     ("--memory", self.memory_bytes, 1, 1 << 60),
                                     ("--decode-steps", self.decode_steps, 0, 1 << 24),
                                     ("--block-size", self.block_size, 1, 1 << 16)):
            if isinstance(v, bool) or not isinstance(v, int) or not least <= v <= most:
                raise ConfigError(f"{name} must be an integer in [{least}, {most}], got {v!r}")
        if self.subset is not None and not (isinstance(self.subset, int) and 1 <= self.subset <= self.windows):
            raise ConfigError(f"--subset must be between 1 and --windows ({self.windows}), got {self.subset!r}")
        t = self.decode_tail
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.window_tokens:
            raise ConfigError(f"--decode-tail must be an integer >= 0 and < --window-tokens ({self.window_tokens}), "
                              f"got {t!r}")

    @property
    def evaluated_windows(self) -> int:
        return self.subset or self.windows

    @property
    def scored_positions(self) -> Optional[str]:
        """With a decode tail, which predictions of a window the metrics cover, in words (the
        JSON's `scored_positions`); None without one (every position, as before: no field)."""
        return f"last {self.decode_tail}, decoded one token at a time" if self.decode_tail else None
