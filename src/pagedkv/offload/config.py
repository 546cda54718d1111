"""OffloadConfig: which tiers sit below memory, and where; built once, frozen.

Two independent features:
- **resident cap** (`resident_blocks_per_seq`, None = off): a sequence keeps at most that many
  blocks in memory; older full blocks are swapped to a private tier (`swap`: "disk", a slot
  file under `swap_dir`, or "memory") and read back, bit-exact, when attention needs them;
- **shared prefix store** (`prefix_store`: "none", "disk" under `prefix_dir`, or "redis" at
  `redis_url`): full blocks are published under a key derived from their token chain, the
  cache's fingerprint (model id, formats, dims), the record layout and the sequence's salt;
  a new sequence loads the blocks it finds instead of recomputing them.

Directories default to `<cache_dir>/swap` and `<cache_dir>/prefix`; `cache_dir` defaults to
`default_cache_dir()`, which the CLI resolves from XDG_CACHE_HOME (the one place the
environment is read): library callers pass paths explicitly or accept `~/.cache/pagedkv`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Mapping, Optional, Union
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from ..errors import ConfigError
from .keys import check_namespace, secret_bytes

SWAP_KINDS = ("disk", "memory")
PREFIX_KINDS = ("none", "disk", "redis")


def redacted_repr(config) -> str:
    """A dataclass's repr with its `redis_url` field through `redact_url` (and `repr=False`
    fields left out): what a config that may hold a Redis password prints."""
    shown = []
    for f in fields(config):
        if f.repr:
            v = getattr(config, f.name)
            shown.append(f"{f.name}={redact_url(v) if f.name == 'redis_url' else repr(v)}")
    return f"{type(config).__name__}({', '.join(shown)})"


def default_cache_dir(environ: Optional[Mapping[str, str]] = None) -> Path:
    """`$XDG_CACHE_HOME/pagedkv`, else `~/.cache/pagedkv`. `environ` is passed by the CLI; the
    library default (None) ignores the environment and uses `~/.cache/pagedkv`."""
    env = environ or {}
    base = env.get("XDG_CACHE_HOME") or ""
    root = Path(base) if base and os.path.isabs(base) else Path("~/.cache").expanduser()
    return root / "pagedkv"


def redact_url(url) -> str:
    """`url` with its password (userinfo, or a `password=` query parameter) shown as `***`: what
    every message, log line and repr prints of a Redis URL."""
    if not isinstance(url, str):
        return repr(url)
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<an unparsable url>"
    netloc = parts.netloc
    if "@" in netloc:
        user, host = netloc.rsplit("@", 1)
        netloc = (user.split(":", 1)[0] + ":***" if ":" in user else "***") + "@" + host
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode([(k, "***" if k.lower() == "password" else v) for k, v in pairs],
                          safe="*")
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def _pos_int_or_none(name: str, v) -> None:
    if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
        raise ConfigError(f"{name} must be a positive integer or None, got {v!r}")


@dataclass(frozen=True)
class OffloadConfig:
    """Tiers below memory (see module doc). All sizes in bytes.

    resident_blocks_per_seq: None (off) or N >= 1 blocks kept in memory per sequence.
    swap: "disk" or "memory"; swap_dir: None = `<cache_dir>/swap`; swap_limit_bytes: None =
    unbounded, else the most bytes this cache's swap holds, over every block group together (a
    swap write past it raises TierWriteError; swapped data is never dropped).
    prefix_store: "none", "disk" or "redis"; prefix_dir: None = `<cache_dir>/prefix`;
    prefix_limit_bytes: the disk store's size (LRU eviction).
    redis_url, redis_prefix, redis_timeout_s, redis_retry_after_s, redis_ttl_s: the Redis tier.
    store_secret: the operator's secret (str or bytes, >= 16 bytes) that store keys and record
    MACs are derived from (`keys.py`); required for Redis (every process sharing the server
    passes the same one), a disk store without one uses `<prefix_dir>/.secret` (generated 0600).
    Never printed in the config's repr (nor is a password in `redis_url`: `redact_url`).
    store_namespace: a key namespace (`[0-9A-Za-z_-]`, e.g. one per tenant): Redis keys start
    `redis_prefix + namespace + ":"` (confine a Redis ACL user to that pattern), a disk store
    lives in `<prefix_dir>/<namespace>/`; mixed into every key and MAC.
    prefetch: read the next layer's swapped blocks in a background thread during attention.
    cache_dir: root of the default directories (None = `default_cache_dir()`).
    """

    resident_blocks_per_seq: Optional[int] = None
    swap: str = "disk"
    swap_dir: Optional[str] = None
    swap_limit_bytes: Optional[int] = None
    prefix_store: str = "none"
    prefix_dir: Optional[str] = None
    prefix_limit_bytes: int = 4 << 30
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_prefix: str = "pagedkv:"
    redis_timeout_s: float = 0.5
    redis_retry_after_s: float = 5.0
    redis_ttl_s: Optional[int] = None
    prefetch: bool = True
    cache_dir: Optional[str] = None
    store_secret: Union[None, str, bytes] = field(default=None, repr=False)
    store_namespace: str = ""

    def __post_init__(self) -> None:
        _pos_int_or_none("resident_blocks_per_seq", self.resident_blocks_per_seq)
        if self.swap not in SWAP_KINDS:
            raise ConfigError(f"swap must be one of {', '.join(SWAP_KINDS)}; got {self.swap!r}")
        if self.prefix_store not in PREFIX_KINDS:
            raise ConfigError(
                f"prefix_store must be one of {', '.join(PREFIX_KINDS)}; got {self.prefix_store!r}"
            )
        _pos_int_or_none("swap_limit_bytes", self.swap_limit_bytes)
        _pos_int_or_none("prefix_limit_bytes", self.prefix_limit_bytes)
        if self.prefix_limit_bytes is None:
            raise ConfigError("prefix_limit_bytes must be a positive integer, got None")
        _pos_int_or_none("redis_ttl_s", self.redis_ttl_s)
        if self.store_secret is not None:
            secret_bytes(self.store_secret)
        check_namespace(self.store_namespace)
        if not isinstance(self.prefetch, bool):
            raise ConfigError(f"prefetch must be a bool, got {self.prefetch!r}")

    def __repr__(self) -> str:  # the secret is left out, the Redis password shown as ***
        return redacted_repr(self)

    @property
    def enabled(self) -> bool:
        return self.resident_blocks_per_seq is not None or self.prefix_store != "none"

    def root(self) -> Path:
        return Path(self.cache_dir).expanduser() if self.cache_dir else default_cache_dir()

    def swap_path(self) -> Path:
        """Each cache swaps into a fresh subdirectory `<host>-<pid>-<id>` of this."""
        return Path(self.swap_dir).expanduser() if self.swap_dir else self.root() / "swap"

    def prefix_path(self) -> Path:
        """The disk prefix store's directory (`<prefix_dir>/<store_namespace>` with one)."""
        base = Path(self.prefix_dir).expanduser() if self.prefix_dir else self.root() / "prefix"
        return base / self.store_namespace if self.store_namespace else base
