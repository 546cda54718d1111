"""The cache options: one frozen declaration for every front door, and the statistics defaults
derived from codec traits, once.

`CacheOptions` is what a user chooses beside the spec (`pagedkv.spec`): `PagedKVCache`,
`PagedLatentCache` and `CacheConfig` take it (`options=`, or its fields as keywords), the vLLM
settings build one from their keys, and `pagedkv generate` has a flag per field
(`add_option_arguments`). Each field's help is its metadata, so the flags and this declaration
cannot drift apart.

Statistics defaults (the same for the transformers drop-in and the vLLM fit; a raw 16-bit codec,
bf16 or f16, loses nothing to centre or scale):
- key centring: on when some layer's K codec is not raw (`default_key_centring`);
- value centring: on for a non-raw V codec, by default off in layers that attend with sinks
  (their weight takes no value, so a centre is not exact) (`centres_values`);
- key multipliers: only when asked, and only for a non-raw K codec (`scales_keys`).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Optional, Sequence, Union

from .approx import Approximation
from .defaults import BLOCK_SIZE
from .errors import ConfigError

if TYPE_CHECKING:  # torch-free at import: the CLI builds its flags from the fields
    from .formats import KVFormat
    from .spec import RecentWindow


def _help(text: str) -> dict:
    return {"help": text}


@dataclass(frozen=True)
class CacheOptions:
    """A cache's options (see the module docstring); validated and normalised at construction."""

    block_size: int = field(default=BLOCK_SIZE, metadata=_help(f"tokens per cache block (default {BLOCK_SIZE})"))
    hp_format: Union[str, KVFormat] = field(default="q8_0", metadata=_help(
        "format of the high-precision first/last layers (+hp) (default q8_0)"))
    key_centring: Optional[bool] = field(default=None, metadata=_help(
        "store keys minus a fitted centre (default: on for a non-raw K codec)"))
    value_centring: Optional[bool] = field(default=None, metadata=_help(
        "store values minus a fitted centre (default: on for a non-raw V codec, off with sinks)"))
    key_scaling: bool = field(default=False, metadata=_help("fit per-channel key multipliers (default off)"))
    reclaim_sliding: bool = field(default=True, metadata=_help(
        "release the blocks a sliding-window layer no longer reads (default on)"))
    keep_window_prefixes: bool = field(default=False, metadata=_help(
        "sliding-window and recent-window (tail) pools keep the blocks their window released while "
        "they stay cached, so a later prompt hits as long a prefix as without the window; their "
        "memory is then not returned (default off)"))
    recent_window: Union[None, int, RecentWindow] = field(default=None, metadata=_help(
        "high-precision recent window: R tokens in bf16 (or name it in the spec: turbo3+r64s16q8_0)"))
    approx: Union[None, str, Approximation] = field(default=None, metadata=_help(
        "approximate attention paths: exact (default) or a comma list of int8_scores, bf16_dots, "
        "sparse_v_threshold=T"))
    backend: Optional[str] = field(default=None, metadata=_help("ops backend name (default: automatic)"))
    checks: bool = field(default=True, metadata=_help("the ops' value checks (NaN/Inf, slot ranges) (default on)"))

    def __post_init__(self) -> None:
        from .formats import parse_format
        from .spec import recent_window_of

        _set = object.__setattr__
        b = self.block_size
        if isinstance(b, bool) or not isinstance(b, int) or b <= 0:
            raise ConfigError(f"block_size must be a positive integer, got {b!r}")
        _set(self, "hp_format", parse_format(self.hp_format))
        for name in ("key_centring", "value_centring"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, bool):
                raise ConfigError(f"{name} must be True, False or None, got {v!r}")
        for name in ("key_scaling", "reclaim_sliding", "keep_window_prefixes", "checks"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")
        _set(self, "recent_window", recent_window_of(self.recent_window))
        _set(self, "approx", Approximation.parse(self.approx))
        if self.backend is not None and not isinstance(self.backend, str):
            raise ConfigError(f"backend must be a backend name or None, got {self.backend!r}")

    @staticmethod
    def of(options: Optional["CacheOptions"] = None, **given) -> "CacheOptions":
        """`options` (default: the defaults) with the fields named in `given` replaced; a name
        that is not a field is refused, naming the accepted ones."""
        names = option_names()
        unknown = sorted(set(given) - set(names))
        if unknown:
            raise ConfigError(f"unknown cache option(s) {', '.join(unknown)}; accepted: {', '.join(names)}")
        if options is not None and not isinstance(options, CacheOptions):
            raise ConfigError(f"options must be a CacheOptions, got {options!r}")
        base = {f.name: getattr(options, f.name) for f in fields(CacheOptions)} if options else {}
        return CacheOptions(**{**base, **given})

    def changed(self) -> tuple[str, ...]:
        """The fields not at their default (for a front door where some do not apply)."""
        default = CacheOptions()
        return tuple(f.name for f in fields(self) if getattr(self, f.name) != getattr(default, f.name))


def option_names() -> tuple[str, ...]:
    return tuple(f.name for f in fields(CacheOptions))


# ---- command-line flags, generated from the fields ----------------------------------------------
def add_option_arguments(p: argparse.ArgumentParser, names: Sequence[str]) -> None:
    """A flag per named field (`--block-size`, `--key-centring` / `--no-key-centring`, ...), its
    help from the field's metadata; unset flags leave the field at its default."""
    by_name = {f.name: f for f in fields(CacheOptions)}
    for name in names:
        f = by_name[name]
        flag = "--" + name.replace("_", "-")
        help_text = f.metadata["help"]
        if f.type in ("bool", "Optional[bool]"):
            p.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif f.type == "int":
            p.add_argument(flag, dest=name, type=int, default=None, metavar="N", help=help_text)
        else:
            p.add_argument(flag, dest=name, default=None, metavar="SPEC" if name == "approx" else "NAME",
                           help=help_text)


def options_from_args(args: argparse.Namespace, names: Sequence[str]) -> CacheOptions:
    """The CacheOptions of the flags `add_option_arguments` added (those given; the rest default)."""
    return CacheOptions.of(**{n: getattr(args, n) for n in names if getattr(args, n) is not None})


# ---- statistics defaults, from codec traits ----------------------------------------------------
def default_key_centring(formats: Sequence[KVFormat], key_centring: Optional[bool] = None) -> bool:
    """`key_centring`, or (None) on when some layer's K codec is not raw."""
    return any(not f.k.traits.raw for f in formats) if key_centring is None else bool(key_centring)


def centres_values(fmt: KVFormat, value_centring: Optional[bool], has_sinks: bool = False) -> bool:
    """Whether a layer of `fmt` stores v - v_centre: asked (True / False) or by default off with
    sinks; never for a raw V codec."""
    wanted = (not has_sinks) if value_centring is None else bool(value_centring)
    return wanted and not fmt.v.traits.raw


def scales_keys(fmt: KVFormat, key_scaling: bool) -> bool:
    """Whether a layer of `fmt` fits key multipliers: asked, and the K codec is not raw."""
    return bool(key_scaling) and not fmt.k.traits.raw


def needs_tensor_scales(fmt: KVFormat) -> bool:
    """Whether a layer of `fmt` has fp8 tensor scales to fit (a tensor-scaled K or V codec)."""
    return fmt.k.traits.tensor_scaled or fmt.v.traits.tensor_scaled
