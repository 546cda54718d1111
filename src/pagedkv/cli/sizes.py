"""Parsing memory sizes given on the command line: `8GiB`, `512MiB`, `2GB`, `1e9`, `4096`."""

from __future__ import annotations

import re

from ..errors import ConfigError

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*$")


def parse_bytes(text: str, what: str = "size") -> int:
    """Bytes in `text` (decimal kB/MB/GB/TB, binary KiB/MiB/GiB/TiB, or a plain number)."""
    m = _SIZE.match(str(text).lower())
    if not m or m[2] not in _UNITS:
        raise ConfigError(f"{what} {text!r} is not a size; use e.g. 8GiB, 512MiB, 2GB or 4096")
    n = int(float(m[1]) * _UNITS[m[2]])
    if n <= 0:
        raise ConfigError(f"{what} {text!r} must be positive")
    return n
