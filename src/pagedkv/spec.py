"""The KV-format spec: one grammar, one parser, one frozen result, for every front door.

`PagedKVCache(model, SPEC)`, `PagedLatentCache`, `CacheConfig(kv_format=SPEC)`, vLLM's
`{"kv_format": SPEC}` and `pagedkv eval --formats SPEC` / `generate --kv-format SPEC` all call
`parse_spec`, so a spec string means the same bytes everywhere. Grammar (case-insensitive):

    SPEC   := BASE ["+hp" [N]] ["+" WINDOW]   |   "tuned" B ["@" N ["k"]]
    BASE   := a KV format name (`pagedkv.formats`: turbo3, turbo4k3v, q8_0k_turbo3v, ...)
            | a plan file written by `pagedkv tune` (a path ending in .json: one K/V format per
              layer, and its recent window)
    WINDOW := "r" R ["s" S] [codec]   (the last R positions, and the first S, read from a tail in
              the codec, default bf16: `RecentWindow`)

`+hp` asks for the automatic high-precision first/last layers, `+hpN` for N of them (see
`pagedkv.cache.config`); it applies to one format, not to a plan. `tunedB` names the plan
`pagedkv tune --bits B` makes for the model (`tunedB@N`: with `--context N`): only `pagedkv eval`
makes it (it needs the model's tokenizer); elsewhere pass the plan file. A spec may also be a `KVFormat`, or one format per
layer (a list of names / KVFormats, each a plain format). Naming the window or the
high-precision layers twice (in the spec and as an argument) is refused unless both agree.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Optional, Sequence, Union

from .codecs.catalogue import Codec, get_codec
from .errors import ConfigError
from .formats import KVFormat, is_plan_path, parse_format, read_plan

ACCEPTED = ("a KV format name (`pagedkv formats`), NAME+hp / NAME+hpN (high-precision first/last "
            "layers), a last +rR[sS][codec] recent window (e.g. turbo3+r64s16q8_0), a plan file "
            "(.json, `pagedkv tune`), tunedB, or one plain format per layer")


# ---- the recent window ------------------------------------------------------------------------
MAX_WINDOW_TOKENS = 1 << 24  # R and S at most 16M positions: beyond any context a cache holds


def check_window_count(what: str, v, low: int) -> None:
    """An int in [low, MAX_WINDOW_TOKENS]; ConfigError naming `what` (a huge value shortened)."""
    if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= MAX_WINDOW_TOKENS:
        raise ConfigError(f"{what} must be an integer in [{low}, {MAX_WINDOW_TOKENS}] (2**24), "
                          f"got {v if isinstance(v, int) and len(str(v)) <= 30 else repr(v)[:40]}")


@dataclass(frozen=True)
class RecentWindow:
    """The high-precision recent window: `tokens` (R >= 1) last positions of each sequence, and
    its first `sinks` (S >= 0) positions (attention sinks), are read from a tail stored with
    `codec` (a catalogue row or its name; default bf16). See `pagedkv.ops.recent`."""

    tokens: int
    codec: Codec = get_codec("bf16")
    sinks: int = 0

    def __post_init__(self):
        check_window_count("recent window tokens", self.tokens, 1)
        check_window_count("recent window sinks", self.sinks, 0)
        object.__setattr__(self, "codec", get_codec(self.codec))
        if self.codec.traits.tensor_scaled:
            raise ConfigError(f"recent window codec {self.codec.name!r} needs a tensor scale; use a "
                              "self-scaled codec such as bf16, f16, q8_0 or turbo8")

    @property
    def name(self) -> str:
        """`r64` (bf16 tail), `r64q8_0`, `r64s16q8_0` (16 sinks): the `+r...` suffix of a spec."""
        return (f"r{self.tokens}" + (f"s{self.sinks}" if self.sinks else "")
                + ("" if self.codec.name == "bf16" else self.codec.name))


_WINDOW_LABEL = re.compile(r"^r?(?P<r>\d+)(?:s(?P<s>\d+))?(?P<codec>[a-z0-9_]*)$")
_WINDOW_SUFFIX = re.compile(r"^(?P<rest>.+?)\+(?P<window>r\d+(?:s\d+)?[a-z0-9_]*)$")
_HP_SUFFIX = re.compile(r"^(?P<fmt>.+?)\+hp(?P<n>\d*)$")
_TUNED = re.compile(r"^tuned(?P<bits>\d{1,3}(?:\.\d{1,6})?)(?:@(?P<n>\d{1,9})(?P<k>k?))?$")
MAX_TUNED_CONTEXT = 1 << 20
WINDOW_FORMS = "null, an int R, 'R[sS][codec]' (e.g. '64s16q8_0') or {'tokens': R, 'codec': C, 'sinks': S}"


def window_from_label(label: str) -> Optional[RecentWindow]:
    """`r64` / `64` (bf16 tail), `r64q8_0`, `r64s16q8_0` (`RecentWindow.name`'s form) ->
    RecentWindow; None when `label` is not of that form. The one parser of a window label."""
    m = _WINDOW_LABEL.match(label.strip().lower())
    if m is None:
        return None
    return RecentWindow(_count(m["r"], "recent window tokens", label), m["codec"] or "bf16",
                        sinks=_count(m["s"] or "0", "recent window sinks", label))


def _count(digits: str, what: str, spec: str) -> int:
    """int(digits), refusing a count too long to be one (int() of 4,300+ digits is a ValueError,
    and no count in a spec needs 13)."""
    if len(digits) > 12:
        raise ConfigError(f"{what} in {spec.strip()[:40]!r}...: got a {len(digits)}-digit number")
    return int(digits)


def split_window_suffix(name: str) -> tuple[str, Optional[str]]:
    """"turbo3+r64s16q8_0" -> ("turbo3", "r64s16q8_0") (lower-cased); a name without a last
    `+rR...` suffix -> (name, None)."""
    m = _WINDOW_SUFFIX.match(name.strip().lower())
    return (name, None) if m is None else (m["rest"], m["window"])


def split_hp(spec):
    """(format, high-precision layers the name asks for): "turbo3+hp" -> ("turbo3", "auto"),
    "turbo3+hp2" -> ("turbo3", 2), "turbo3" -> ("turbo3", None)."""
    if isinstance(spec, str):
        m = _HP_SUFFIX.match(spec.strip().lower())
        if m:
            return m["fmt"], _count(m["n"], "high-precision layers", spec) if m["n"] else "auto"
    return spec, None


def _tuned(spec):
    return _TUNED.match(spec.strip().lower()) if isinstance(spec, str) else None


def tuned_bits(spec: str) -> Optional[float]:
    """B for a label `tunedB` or `tunedB@N` (e.g. tuned3.5, tuned3.5@8k), else None."""
    m = _tuned(spec)
    return float(m["bits"]) if m else None


def tuned_context(spec: str) -> Optional[int]:
    """N for a label `tunedB@N` (`@8k` = 8192), None for `tunedB` and other labels; ConfigError
    for a context outside [2, 2**20]."""
    m = _tuned(spec)
    if not m or m["n"] is None:
        return None
    n = int(m["n"]) * (1024 if m["k"] else 1)
    if not 2 <= n <= MAX_TUNED_CONTEXT:
        raise ConfigError(f"{spec.strip()!r}: the context after @ must be 2..{MAX_TUNED_CONTEXT} tokens, got {n}")
    return n


def recent_window_from(value, what: str = "recent_window") -> Optional[RecentWindow]:
    """A recent-window setting as a RecentWindow: None / 0 (none), R (bf16 tail), "R[sS][codec]",
    {"tokens", "codec"[, "sinks"]} (a plan file's form) or a RecentWindow; ConfigError naming
    `what`, the value and the accepted forms otherwise."""
    if value is None or isinstance(value, RecentWindow):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return RecentWindow(value) if value else None
    if isinstance(value, str) and (recent := window_from_label(value)) is not None:
        return recent
    if isinstance(value, Mapping) and {"tokens", "codec"} <= set(value) <= {"tokens", "codec", "sinks"}:
        return RecentWindow(value["tokens"], value["codec"], sinks=value.get("sinks", 0))
    raise ConfigError(f"{what} must be {WINDOW_FORMS}, got {value!r}")


def recent_window_of(value, what: str = "recent_window") -> Optional[RecentWindow]:
    """A Python argument's window: None (none), an int R (a bf16 tail of R tokens) or a
    RecentWindow; ConfigError otherwise (a window in text belongs in the spec: `turbo3+r64`)."""
    if value is None or isinstance(value, RecentWindow):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return RecentWindow(value)
    raise ConfigError(f"{what} must be None, an int or a RecentWindow (in a spec string: a last "
                      f"+rR[sS][codec], e.g. turbo3+r64s16q8_0), got {value!r}")


def check_hp_count(value, what: str = "high_precision_layers") -> None:
    """None, an int >= 0 or "auto"; ConfigError naming `what` otherwise."""
    if value is None or value == "auto":
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{what} must be an int >= 0 or 'auto', got {value!r}")


# ---- the spec --------------------------------------------------------------------------------
@dataclass(frozen=True)
class KVSpec:
    """A parsed spec: exactly one of `format` (every layer), `layers` (one format per layer, from
    a list or a plan file; `plan` is then the plan's absolute path) or `tune_bits` (a `tunedB`
    label, made into a plan by `pagedkv eval`); the high-precision layers it names (None: not
    named), and its recent window (None: none)."""

    text: str
    format: Optional[KVFormat] = None
    layers: Optional[tuple[KVFormat, ...]] = None
    plan: Optional[str] = None
    high_precision_layers: Union[None, int, str] = None
    recent_window: Optional[RecentWindow] = None
    tune_bits: Optional[float] = None
    tune_context: Optional[int] = None  # N of a `tunedB@N` label
    plan_label: Optional[str] = None  # a plan's: its file name (+ the window a suffix names)

    @property
    def label(self) -> str:
        """The canonical spelling: `turbo3+hp+r64s16q8_0`, `plan.json` (the file's name),
        `tuned3.5`, `per-layer`."""
        if self.tune_bits is not None:
            return self.text
        if self.plan_label is not None:
            return self.plan_label
        base = "per-layer" if self.layers is not None else self.format.name
        hp = self.high_precision_layers
        base += "" if hp is None else f"+hp{'' if hp == 'auto' else hp}"
        return base if self.recent_window is None else f"{base}+{self.recent_window.name}"

    def with_arguments(self, high_precision_layers=None, recent_window=None, what: str = "kv_format") -> "KVSpec":
        """The spec with the high-precision layers and window given as separate arguments (None:
        not given) added; ConfigError when the spec already names a different one."""
        check_hp_count(high_precision_layers)
        recent = recent_window_of(recent_window)
        out = self
        if high_precision_layers is not None:
            if self.high_precision_layers not in (None, high_precision_layers):
                raise ConfigError(f"{what} {self.text!r} names its high-precision layers; do not give "
                                  f"high_precision_layers={high_precision_layers!r} as well")
            out = replace(out, high_precision_layers=high_precision_layers)
        if recent is not None:
            if self.recent_window not in (None, recent):
                raise ConfigError(f"{what} {self.text!r} names a recent window ({self.recent_window.name}); "
                                  f"do not give recent_window={recent_window!r} as well")
            out = replace(out, recent_window=recent)
        return out

    def layer_formats(self, num_layers: int, layer_dims=None) -> tuple[KVFormat, ...]:
        """One format per layer, before the high-precision policy; a plan is checked against
        `layer_dims` (per layer (kv heads, head_dim)) when given. ConfigError for a tuned label
        (not made yet) or a list of another length."""
        if self.tune_bits is not None:
            ctx = "" if self.tune_context is None else f" --context {self.tune_context}"
            raise ConfigError(f"{self.text!r} is made by `pagedkv eval` (it needs the model's tokenizer); "
                              f"elsewhere run `pagedkv tune --bits {self.tune_bits:g}{ctx} --out plan.json` and pass plan.json")
        if self.plan is not None and layer_dims is not None:
            read_plan(self.plan, layer_dims)  # ConfigError naming the file and the mismatch
        if self.layers is None:
            return (self.format,) * num_layers
        if len(self.layers) != num_layers:
            raise ConfigError(f"kv_format has {len(self.layers)} entries, num_layers is {num_layers} "
                              f"({self.label})")
        return self.layers

    def named_formats(self) -> tuple[KVFormat, ...]:
        """Every format the spec names (each once, in order)."""
        return tuple(dict.fromkeys((self.format,) if self.layers is None else self.layers))


def _bad(text, part: str, why: str, what: str) -> ConfigError:
    return ConfigError(f"{what} {text!r}: {part} {why}; accepted: {ACCEPTED}")


def _plain(item, text, what: str) -> KVFormat:
    """One per-layer item: a plain format (no suffix, no plan)."""
    if isinstance(item, str) and (is_plan_path(item) or "+" in item or tuned_bits(item) is not None):
        raise _bad(text, repr(item), "in a per-layer list must be a plain format (no +hp, window, plan or tuned)", what)
    try:
        return parse_format(item)
    except ConfigError as exc:
        raise ConfigError(f"{what}: per-layer item {item!r}: {exc}") from None


def parse_spec(value, what: str = "kv_format") -> KVSpec:
    """The KVSpec `value` stands for (see the module docstring): a spec string, a KVFormat, a
    KVSpec, or one plain format per layer. ConfigError naming the bad part and the accepted forms."""
    if isinstance(value, KVSpec):
        return value
    if isinstance(value, KVFormat):
        return KVSpec(value.name, format=value)
    if isinstance(value, (list, tuple)):
        if not value:
            raise _bad(list(value), "an empty list", "names no layer", what)
        return KVSpec("per-layer", layers=tuple(_plain(v, list(value), what) for v in value))
    if not isinstance(value, str):
        raise ConfigError(f"{what} must be a string, a KVFormat or one per layer, got {value!r}; accepted: {ACCEPTED}")
    text = value.strip()
    bits = tuned_bits(text)
    if bits is not None:
        return KVSpec(text.lower(), tune_bits=bits, tune_context=tuned_context(text))
    if is_plan_path(text):
        return _plan_spec(text, text, None, what)
    rest, window_label = split_window_suffix(text)
    recent = None
    if window_label is not None:
        try:
            recent = window_from_label(window_label)
        except ConfigError as exc:
            raise ConfigError(f"{what} {text!r}: the window {window_label!r}: {exc}") from None
        if is_plan_path(rest):
            return _plan_spec(rest, text, recent, what)
        if tuned_bits(rest) is not None:
            raise _bad(text, "a window", "after tunedB (the tuned plan chooses its own window)", what)
    base, hp = split_hp(rest)
    if hp is not None and is_plan_path(base):
        raise _bad(text, "+hp", "after a plan file (the plan fixes every layer's format)", what)
    try:
        fmt = parse_format(base)
    except ConfigError as exc:
        if "+" in base:
            raise _bad(text, repr(base), "is not a format (a window must be last, +hp before it)", what) from None
        raise ConfigError(f"{what} {text!r}: {exc}") from None
    return KVSpec(text, format=fmt, high_precision_layers=hp, recent_window=recent)


def _plan_spec(path: str, text: str, suffix: Optional[RecentWindow], what: str) -> KVSpec:
    path = os.path.abspath(path.strip())  # the engine's processes may not share a cwd
    plan = read_plan(path)  # ConfigError naming the file
    recent = recent_window_from(plan["recent_window"], f"plan file {path!r}: recent_window")
    if suffix is not None and recent not in (None, suffix):
        raise _bad(text, f"the window {suffix.name}", f"differs from the plan's own ({recent.name})", what)
    label = os.path.basename(path) + ("" if suffix is None else f"+{suffix.name}")
    return KVSpec(text, layers=plan["formats"], plan=path, recent_window=suffix or recent, plan_label=label)


def spec_and_arguments(kv_format, high_precision_layers=None, recent_window=None, what: str = "kv_format") -> KVSpec:
    """`parse_spec(kv_format)` with the separate arguments merged (`KVSpec.with_arguments`)."""
    return parse_spec(kv_format, what).with_arguments(high_precision_layers, recent_window, what)


def hp_formats(spec: KVSpec, hp_format) -> Sequence[KVFormat]:
    """The spec's named formats and, when it asks for high-precision layers, `hp_format`."""
    names = spec.named_formats()
    if spec.high_precision_layers not in (None, 0):
        names = tuple(dict.fromkeys(names + (parse_format(hp_format),)))
    return names
