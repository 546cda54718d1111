"""Parsing what the command line gives: memory sizes (`8GiB`, `512MiB`, `2GB`, `1e9`, `4096`),
counts (`4k`), comma lists of counts and of names."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from ..errors import ConfigError

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*(-?[0-9]{0,30}\.?[0-9]{1,30}(?:e[0-9]{1,4})?)\s*([a-z]*)\s*$")
MAX_BYTES = 1 << 60  # 1 EiB: any larger size is a typo
MAX_COUNT = 1 << 40  # tokens, batch rows, ...: far past any run


def parse_bytes(text: str, what: str = "size") -> int:
    """Bytes in `text` (decimal kB/MB/GB/TB, binary KiB/MiB/GiB/TiB, or a plain number)."""
    m = _SIZE.match(str(text).lower())
    if not m or m[2] not in _UNITS:
        raise ConfigError(f"{what} {text!r} is not a size; use e.g. 8GiB, 512MiB, 2GB or 4096")
    n = int(Decimal(m[1]) * _UNITS[m[2]])  # exact: no float overflow (1e400TiB)
    if n <= 0:
        raise ConfigError(f"{what} {text!r} must be a positive size (e.g. 8GiB)")
    if n > MAX_BYTES:
        raise ConfigError(f"{what} {text!r} is larger than 1 EiB (2**60 bytes); give a real size")
    return n


def parse_count(text: str, what: str = "count") -> int:
    """'4k' -> 4096, '32K' -> 32768, '1m' -> 1048576, '1000' -> 1000; ConfigError otherwise."""
    t = str(text).strip().lower()
    mult = 1
    if t.endswith("k"):
        t, mult = t[:-1], 1024
    elif t.endswith("m"):
        t, mult = t[:-1], 1024 * 1024
    try:
        if len(t) > 40:
            raise InvalidOperation
        d = Decimal(t)
        if not d.is_finite():
            raise InvalidOperation
        value = int(d * mult)
    except (InvalidOperation, ValueError):
        raise ConfigError(f"{what}: expected a count like 4096 or 4k, got {text[:40]!r}") from None
    if value < 1:
        raise ConfigError(f"{what}: expected a positive count, got {text!r}")
    if value > MAX_COUNT:
        raise ConfigError(f"{what}: {text!r} is more than 2**40; give a real count")
    return value


def parse_counts(text: str, what: str = "count") -> list[int]:
    """A comma list of counts ('1k,4k,16k'); at least one."""
    values = [parse_count(x, what) for x in str(text).split(",") if x.strip()]
    if not values:
        raise ConfigError(f"{what}: expected a comma list of counts like 1k,4k, got {text!r}")
    return values


def parse_names(text: str, what: str = "--formats") -> list[str]:
    """A comma list of names ('bf16,turbo3'); at least one, no duplicates."""
    names = [x.strip() for x in str(text).split(",") if x.strip()]
    if not names:
        raise ConfigError(f"{what} needs at least one name, got {text!r}")
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"{what} lists {', '.join(dup)} more than once")
    return names
