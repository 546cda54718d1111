"""What `pagedkv eval --task passkey|multikey` runs: `RetrievalConfig`, its presets and the
parsing of --lengths / --depths; torch-free, so that the CLI checks everything before anything
heavy is imported."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from ..approx import Approximation
from ..defaults import BLOCK_SIZE
from ..errors import ConfigError
from .compute import Compute
from .config import REFERENCE_FORMAT
from .retrieval_tasks import KEYS, TASKS, check_cue


@dataclass(frozen=True)
class Preset:
    lengths: tuple[int, ...]
    trials: int
    formats: tuple[str, ...]


# `pagedkv eval --task T` with no sizes: <= 20 min on 2 idle cores for the embedded SmolLM2 (the
# estimate is printed before the run: passkey ~16 min, multikey ~6 min; a passkey trial computes
# its haystack from the needle on, a multikey context serves 4 trials); --quick: about a minute,
# what the tests run on a tiny model. The recorded study's sizes cost hours (docs/long-context.md).
DEFAULT_PRESET = Preset((2048, 4096), 16, ("bf16", "turbo3", "turbo4g32k_turbo2g64v+r32s16q8_0",
                                             "turbo4g32+r32s16q8_0"))
QUICK_PRESET = Preset((1024,), 6, ("bf16", "turbo3", "turbo3+r64s16q8_0"))

MAX_TRIALS = 100_000  # each a prompt per format
MAX_LENGTH = 1 << 24
_LENGTH = re.compile(r"^(?P<n>\d+(?:\.\d+)?)(?P<k>[kK]?)$")


def parse_lengths(text: str) -> tuple[int, ...]:
    """`2k,4k,8k` / `2048,4096` -> (2048, 4096, 8192) (k = 1024); ConfigError naming the bad item."""
    out = []
    for item in text.split(","):
        m = _LENGTH.match(item.strip())
        if not m:
            raise ConfigError(f"--lengths: {item.strip()!r} is not a length; use tokens or Nk, e.g. 2k,4k,8k")
        n = float(m["n"][:16]) * (1024 if m["k"] else 1) if len(m["n"]) <= 16 else float("inf")
        if not 64 <= n <= MAX_LENGTH or n != int(n):
            raise ConfigError(f"--lengths: {item.strip()!r} must be a whole number of tokens in [64, {MAX_LENGTH}]")
        out.append(int(n))
    if len(set(out)) != len(out):
        raise ConfigError(f"--lengths lists a length more than once: {text!r}")
    return tuple(out)


def parse_depths(text: str) -> tuple[float, ...]:
    """`0,0.5,1` -> needle depths (fractions of the haystack); ConfigError outside [0, 1]."""
    out = []
    for item in text.split(","):
        try:
            d = float(item)
        except ValueError:
            raise ConfigError(f"--depths: {item.strip()!r} is not a number; use fractions in 0..1, "
                              "e.g. 0,0.25,0.5,0.75,1") from None
        if not 0.0 <= d <= 1.0:
            raise ConfigError(f"--depths: {item.strip()} is outside 0..1 (0 = the start of the haystack, "
                              "1 = its end)")
        out.append(d)
    return tuple(out)


def parse_tasks(text: str) -> tuple[str, ...]:
    tasks = tuple(t.strip().lower() for t in text.split(",") if t.strip())
    bad = [t for t in tasks if t not in TASKS]
    if bad or not tasks:
        raise ConfigError(f"--task {text!r}: accepted are kl (the default), {', '.join(TASKS)} or a comma list "
                          "of the retrieval tasks")
    return tuple(dict.fromkeys(tasks))


@dataclass(frozen=True)
class RetrievalConfig:
    """A retrieval run. formats: the reference bf16 first (added when not listed); lengths:
    tokens the model sees per trial, its answer included; depths: None = spread evenly."""

    tasks: tuple[str, ...] = ("passkey",)
    formats: tuple[str, ...] = DEFAULT_PRESET.formats
    lengths: tuple[int, ...] = DEFAULT_PRESET.lengths
    trials: int = DEFAULT_PRESET.trials
    depths: Optional[tuple[float, ...]] = None
    keys: int = 4
    cue: str = "question"
    seed: int = 0
    block_size: int = BLOCK_SIZE
    model: Optional[str] = None
    compute: Compute = Compute()
    approx: Approximation = Approximation()

    def __post_init__(self):
        if not self.formats:
            raise ConfigError("--formats needs at least one format")
        if not self.lengths:
            raise ConfigError("--lengths needs at least one length")
        if not self.tasks or any(t not in TASKS for t in self.tasks):
            raise ConfigError(f"tasks must be among {', '.join(TASKS)}, got {self.tasks!r}")
        for name, v, least, most in (("--trials", self.trials, 1, MAX_TRIALS), ("--keys", self.keys, 1, len(KEYS)),
                                     ("--block-size", self.block_size, 1, 1 << 16), ("--seed", self.seed, 0, 1 << 63)):
            if isinstance(v, bool) or not isinstance(v, int) or not least <= v <= most:
                raise ConfigError(f"{name} must be an integer in [{least}, {most}], got {v!r}")
        check_cue(self.cue)
        if self.depths is not None and (not self.depths or any(not 0 <= d <= 1 for d in self.depths)):
            raise ConfigError(f"--depths must be fractions in 0..1, got {self.depths!r}")
        if not self.approx.exact:
            raise ConfigError("--approx is not supported with a retrieval --task yet; use exact")

    @property
    def all_formats(self) -> tuple[str, ...]:
        """The reference first, then the listed formats."""
        return (REFERENCE_FORMAT,) + tuple(f for f in self.formats if f.strip().lower() != REFERENCE_FORMAT)

    def check_context(self, context: Optional[int], what: str) -> None:
        """ConfigError when a length is past the model's context (`context` tokens; None: unknown)."""
        if context is not None and max(self.lengths) > context:
            raise ConfigError(f"--lengths {max(self.lengths)}: past the context of {what} ({context} tokens, "
                              "the answer included); use lengths up to it")
