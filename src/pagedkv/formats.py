"""KV formats: a (K codec, V codec) pair, parsed once from a name.

Accepted spellings (case-insensitive):
- symmetric: a codec name, `turbo3` = (turbo3, turbo3);
- asymmetric: `<k>k_<v>v` for any two codecs (`bf16k_turbo3v`, `q8_0k_q4_0v`);
- the short aliases of the original system, `<k>k<N>v` = `<k>k_turbo<N>v` (`turbo4k3v`,
  `bf16k4v`, `fp8k2v`);
- `k=<codec>,v=<codec>` (`k=fp8,v=turbo2`).
A codec may be spelled by one of its aliases (`catalogue.ALIASES`: vLLM's `fp8_e4m3`, `bfloat16`,
`auto`; `float16`/`fp16`/`half` for f16); a name another system uses for different bytes
(`catalogue.REFUSED`: `fp8_inc`, llama.cpp's `q5_0`, ...) is refused with what to use instead.
Canonical names are the first two forms. Every pair of catalogue codecs is a format.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterator

from .codecs.catalogue import ALIASES, CODECS, Codec, canonical_codec_name, get_codec, refusal_hint
from .errors import ConfigError

_ASYM = re.compile(r"^(?P<k>[a-z0-9_]+?)k_(?P<v>[a-z0-9_]+)v$")
_ALIAS = re.compile(r"^(?P<k>[a-z0-9_]+?)k(?P<bits>\d)v$")
_KV = re.compile(r"^k\s*=\s*(?P<k>[a-z0-9_]+)\s*,\s*v\s*=\s*(?P<v>[a-z0-9_]+)$")


@dataclass(frozen=True)
class KVFormat:
    """How one layer stores its keys (k) and values (v)."""

    k: Codec
    v: Codec

    @property
    def name(self) -> str:
        if self.k == self.v:
            return self.k.name
        return f"{self.k.name}k_{self.v.name}v"

    @property
    def symmetric(self) -> bool:
        return self.k == self.v

    @property
    def bits_per_element(self) -> float:
        """Mean stored bits per K and V element."""
        return (self.k.bits_per_element + self.v.bits_per_element) / 2

    def k_block_bytes(self, block_size: int, num_kv_heads: int, head_dim: int) -> int:
        return self.k.block_bytes(block_size, num_kv_heads, head_dim)

    def v_block_bytes(self, block_size: int, num_kv_heads: int, head_dim: int) -> int:
        return self.v.block_bytes(block_size, num_kv_heads, head_dim)

    def check_head_dim(self, head_dim: int) -> None:
        self.k.check_head_dim(head_dim)
        self.v.check_head_dim(head_dim)

    def __str__(self) -> str:
        return self.name


def _valid_names_hint() -> str:
    codecs = ", ".join(CODECS)
    aliases = ", ".join(f"{a}={c}" for a, c in ALIASES.items())
    return (
        f"valid: a codec ({codecs}; aliases {aliases}), '<k>k_<v>v' with two codecs (e.g. "
        "bf16k_turbo3v), '<k>k<N>v' for a turbo<N> V (e.g. turbo4k3v), or 'k=<codec>,v=<codec>'"
    )


def _refused_parts(key: str) -> str:
    """The refusal hint of the first refused codec name in `key` (whole, or a K / V part)."""
    parts = [key]
    for pattern in (_KV, _ASYM):
        m = pattern.match(key)
        if m:
            parts += [m["k"], m["v"]]
    return next((h for h in map(refusal_hint, parts) if h), "")


def parse_format(name: "str | KVFormat") -> KVFormat:
    """The KVFormat a name stands for; ConfigError naming the bad value and the valid forms."""
    if isinstance(name, KVFormat):
        return name
    if not isinstance(name, str):
        raise ConfigError(f"KV format must be a name, got {name!r}; {_valid_names_hint()}")
    key = name.strip().lower()
    whole = canonical_codec_name(key)
    if whole is not None:
        c = CODECS[whole]
        return KVFormat(c, c)
    for pattern in (_KV, _ASYM):
        m = pattern.match(key)
        if m:
            k, v = canonical_codec_name(m["k"]), canonical_codec_name(m["v"])
            if k is not None and v is not None:
                return KVFormat(CODECS[k], CODECS[v])
    m = _ALIAS.match(key)
    if m:
        k = canonical_codec_name(m["k"])
        if k is not None and f"turbo{m['bits']}" in CODECS:
            return KVFormat(CODECS[k], get_codec(f"turbo{m['bits']}"))
    raise ConfigError(f"unknown KV format {name!r}{_refused_parts(key)}; {_valid_names_hint()}")


def all_formats() -> Iterator[KVFormat]:
    """Every (K codec, V codec) pair of the catalogue, symmetric ones first."""
    codecs = list(CODECS.values())
    for c in codecs:
        yield KVFormat(c, c)
    for k in codecs:
        for v in codecs:
            if k != v:
                yield KVFormat(k, v)


# ---- plan files (`pagedkv tune --out plan.json`): a per-layer format wherever a format is accepted ----
PLAN_VERSION = 1
MAX_PLAN_BYTES = 1 << 20  # a plan of 1000 layers is ~60 KB


def is_plan_path(name) -> bool:
    """True for a format argument that names a plan file (a path ending in .json)."""
    return isinstance(name, str) and name.strip().lower().endswith(".json")


def read_plan(path: str, layer_dims=None) -> dict:
    """The plan file at `path` as {"formats": tuple[KVFormat] per layer, "recent_window": None or
    {"tokens", "codec"}, "doc": the JSON}; with `layer_dims` (per layer (kv heads, head_dim)) it
    is checked against the model's layout. ConfigError naming the file and what is wrong."""
    from .safe_io import loads_json, read_regular_file

    # a plan is kilobytes: a FIFO, a device (a link to /dev/zero) or a huge file is refused unread
    doc = loads_json(read_regular_file(path, MAX_PLAN_BYTES, "plan file"), f"plan file {path!r}")
    if not isinstance(doc, dict) or doc.get("pagedkv_plan") != PLAN_VERSION or not isinstance(doc.get("layers"), list):
        raise ConfigError(f"plan file {path!r} is not a pagedkv plan (version {PLAN_VERSION}; make one "
                          "with `pagedkv tune`)")
    try:
        formats = tuple(KVFormat(get_codec(e["k"]), get_codec(e["v"])) for e in doc["layers"])
    except (TypeError, KeyError) as exc:
        raise ConfigError(f"plan file {path!r}: every layer needs 'k' and 'v' codecs ({exc})") from None
    if layer_dims is not None:
        dims = [tuple(d) for d in layer_dims]
        planned = [tuple(d) for d in doc.get("layer_dims") or []]
        if len(formats) != len(dims) or (planned and planned != dims):
            raise ConfigError(f"plan file {path!r} was made for {len(formats)} layers {planned[:1]}..., the model "
                              f"has {len(dims)} layers {dims[:1]}... (kv heads, head_dim): run `pagedkv tune` for it")
        for f, (_, d) in zip(formats, dims):
            f.check_head_dim(d)
    recent = doc.get("recent_window")
    if recent is not None and not (isinstance(recent, dict) and {"tokens", "codec"} <= set(recent)
                                   and set(recent) <= {"tokens", "codec", "sinks"}):
        raise ConfigError(f"plan file {path!r}: recent_window must be null or {{'tokens', 'codec'[, 'sinks']}}")
    return {"formats": formats, "recent_window": recent, "doc": doc}
