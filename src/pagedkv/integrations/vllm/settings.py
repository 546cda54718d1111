"""What a vLLM user asks of pagedkv: one typed settings object, parsed once at the edge.

The settings come from vLLM's `additional_config` (`--additional-config '{"pagedkv": {...}}'`)
or, when that has no "pagedkv" entry, from the environment variable `PAGEDKV_VLLM` (read once
by the plugin when vLLM loads it). Either holds a JSON object, or just a format name:

    {"kv_format": "turbo3"}                       every layer turbo3 (as on the command line)
    {"kv_format": "turbo3+hp"}                    turbo3 + the automatic high-precision layers
    {"kv_format": ["q8_0", "turbo3", ...]}        one format per attention layer
    {"kv_format": "turbo3", "high_precision_layers": 2, "value_centring": false}

Keys (anything else is refused, naming the key):
- kv_format: a pagedkv format name (`pagedkv formats`; `NAME+hp` / `NAME+hpN` add the
  high-precision first/last layers, as everywhere in pagedkv), one per attention layer, or a plan
  file written by `pagedkv tune` (a path ending in .json: one K and one V codec per layer,
  checked against the model's layers at engine start). Required.
- recent_window: the high-precision recent window (`pagedkv.ops.recent`): null / 0 (none), R
  (a bf16 tail of the last R tokens), "R[sS][codec]" (e.g. "64s16q8_0": 64 recent tokens and
  the first 16 in q8_0), or {"tokens": R, "codec": "q8_0", "sinks": S}. A format name may carry
  it as its last suffix (`turbo3+r64s16q8_0`, as in `pagedkv eval`), a plan file as its
  `recent_window`; naming it twice is refused. Served from a second KV-cache group per layer
  (`tail.py`: vLLM's sliding-window group of window R, so only the blocks covering the last R
  positions stay allocated, and prefix hits need them cached).
- high_precision_layers: None (default: what the name says, none for a plain name), N >= 0 or
  "auto" (see `pagedkv.cache.config`). A name means the same bytes as in Python and on the
  command line.
- hp_format, key_centring, value_centring, key_scaling, approx, backend ("cpu", "triton",
  "reference" or null), checks: the cache options (`pagedkv.options.CacheOptions`, one
  declaration: each field's help and default there, as `PagedKVCache` and `pagedkv generate`
  take them), except checks, off by default here (vLLM's inputs are trusted).
- calibration: None = fit the statistics once at engine start on pagedkv's fixed calibration
  text (`capture.calibration_text`, never the evaluation text) with the served model's own weights;
  or a path to a file written by `python -m pagedkv.integrations.vllm.calibrate`.
- calibration_tokens: tokens of the calibration text (default 512).
- cache_dir: where fitted statistics are kept between engine starts (default
  $XDG_CACHE_HOME/pagedkv/vllm or ~/.cache/pagedkv/vllm); None in a dict to disable.

Nothing here imports vLLM, so the main test suite checks the parsing without it.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Union

from ...errors import ConfigError
from ...safe_io import loads_json
from ...formats import KVFormat, is_plan_path
from ...offload.config import default_cache_dir
from ...options import CacheOptions
from ...spec import KVSpec, check_hp_count, hp_formats, parse_spec, recent_window_from

ENV_VAR = "PAGEDKV_VLLM"
CONFIG_KEY = "pagedkv"
DEFAULT_CALIBRATION_TOKENS = 512

# the cache options' keys (`pagedkv.options.CacheOptions`, declared there once), then the settings' own
_OPTION_KEYS = ("hp_format", "key_centring", "value_centring", "key_scaling", "backend", "checks",
                "recent_window", "approx")
_KEYS = ("kv_format", "high_precision_layers", "calibration", "calibration_tokens", "cache_dir") + _OPTION_KEYS


@dataclass(frozen=True)
class VllmSettings:
    """pagedkv's settings for one vLLM engine (see the module docstring for every key): the
    format spec, the cache `options` (`CacheOptions`; checks off unless asked: vLLM's inputs are
    trusted; its fields read as the settings' own, `settings.hp_format`) and where the
    statistics come from."""

    kv_format: Union[str, tuple[str, ...]]
    high_precision_layers: Union[None, int, str] = None
    options: CacheOptions = CacheOptions(checks=False)
    calibration: Optional[str] = None
    calibration_tokens: int = DEFAULT_CALIBRATION_TOKENS
    cache_dir: Optional[str] = field(default=None)
    spec: KVSpec = field(init=False, repr=False, compare=False)  # kv_format and the hp layers, parsed

    def __post_init__(self) -> None:
        if not isinstance(self.options, CacheOptions):
            raise ConfigError(f"pagedkv settings: options must be a CacheOptions, got {self.options!r}")
        check_hp_count(self.high_precision_layers, "pagedkv high_precision_layers")
        # the one spec parser (`pagedkv.spec`), as in Python and on the command line
        spec = parse_spec(self.kv_format, "pagedkv kv_format").with_arguments(
            self.high_precision_layers, self.options.recent_window, "pagedkv kv_format")
        if spec.tune_bits is not None:
            spec.layer_formats(1)  # ConfigError: a tuned label is made by `pagedkv eval`
        kv_format = (spec.plan if spec.plan is not None  # the engine's processes may not share a cwd
                     else spec.format.name if spec.layers is None else tuple(f.name for f in spec.layers))
        object.__setattr__(self, "kv_format", kv_format)
        object.__setattr__(self, "spec", spec)
        object.__setattr__(self, "high_precision_layers", spec.high_precision_layers)
        object.__setattr__(self, "options", dataclasses.replace(self.options, recent_window=spec.recent_window))
        n = self.calibration_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n < 16:
            raise ConfigError(f"pagedkv calibration_tokens must be an int >= 16, got {n!r}")
        if self.calibration is not None and not os.path.isfile(str(self.calibration)):
            raise ConfigError(f"pagedkv calibration {self.calibration!r} is not a file; pass a file "
                              "written by `python -m pagedkv.integrations.vllm.calibrate`, or null "
                              "to fit at engine start")
        if self.cache_dir is not None and (not isinstance(self.cache_dir, str) or not self.cache_dir.strip()):
            raise ConfigError(f"pagedkv cache_dir must be a directory path (a non-empty string) or "
                              f"null (no statistics cache), got {self.cache_dir!r}")
        if self.backend is not None and self.backend not in ("cpu", "triton", "reference"):
            raise ConfigError(f"pagedkv backend must be cpu, triton, reference or null, got {self.backend!r}")

    def __getattr__(self, name: str):
        if name in _OPTION_KEYS:  # an option's value (`options` holds them)
            return getattr(self.options, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def named_formats(self) -> tuple[KVFormat, ...]:
        """Every format the settings name (a plan's layers, the list, the name; the
        high-precision format when some layer uses it), each once, in order."""
        return tuple(hp_formats(self.spec, self.hp_format))

    @property
    def label(self) -> str:
        """A short name for logs: the format (or 'per-layer') and the hp setting."""
        fmt = self.kv_format if isinstance(self.kv_format, str) else "per-layer"
        if is_plan_path(fmt):
            fmt = f"plan {os.path.basename(fmt)}"
        hp = self.high_precision_layers
        fmt = fmt if hp is None else f"{fmt} (high_precision_layers={hp})"
        fmt = fmt if self.recent_window is None else f"{fmt} + recent window {self.recent_window.name}"
        return fmt if self.approx.exact else f"{fmt}, approx {self.approx.name}"


def parse_settings(value: Any, environ: Optional[Mapping[str, str]] = None) -> VllmSettings:
    """Settings from a format name, a JSON string, or a dict (keys as in the module docstring)."""
    environ = os.environ if environ is None else environ
    if isinstance(value, VllmSettings):
        return value
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("{"):
            value = loads_json(text, f"pagedkv settings {text[:200]!r}")  # too deep, 4300+ digits
        else:
            value = {"kv_format": text}
    if not isinstance(value, Mapping):
        raise ConfigError(f"pagedkv settings must be a format name or an object, got {value!r}")
    unknown = sorted(set(value) - set(_KEYS))
    if unknown:
        raise ConfigError(f"pagedkv settings: unknown key(s) {', '.join(unknown)}; accepted: {', '.join(_KEYS)}")
    if "kv_format" not in value:
        raise ConfigError("pagedkv settings need kv_format (a pagedkv format name, e.g. turbo3, "
                          "or one per attention layer)")
    kwargs = {k: v for k, v in value.items() if k not in _OPTION_KEYS}
    options = {"checks": False, **{k: v for k, v in value.items() if k in _OPTION_KEYS}}
    options["recent_window"] = recent_window_from(options.get("recent_window"), "pagedkv recent_window")
    try:  # the cache options, declared once (`pagedkv.options`), as the Python caches take them
        kwargs["options"] = CacheOptions.of(**options)
    except ConfigError as exc:
        raise ConfigError(f"pagedkv {exc}") from None
    if "cache_dir" not in kwargs:
        kwargs["cache_dir"] = str(default_cache_dir(environ) / "vllm")  # pagedkv's cache root
    return VllmSettings(**kwargs)


def settings_from(additional_config: Any, env_value: Optional[str]) -> Optional[VllmSettings]:
    """The engine's pagedkv settings: `additional_config["pagedkv"]`, else the environment
    variable's value (read once by the plugin), else None (pagedkv stays out of the way)."""
    if isinstance(additional_config, Mapping) and additional_config.get(CONFIG_KEY) is not None:
        return parse_settings(additional_config[CONFIG_KEY])
    if env_value:
        return parse_settings(env_value)
    return None
