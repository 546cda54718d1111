"""The Redis tier: a shared store of compressed blocks that several processes or machines use.

Values are records (`record.py`) under `prefix + key`. Reads with an expected size
(the prefix store's) are bounded: `STRLEN` then `GETRANGE` of at most that many bytes (and
`EXISTS`, so an empty value is damage to repair, not a miss forever), in one pipelined round
trip, so an oversized value planted under a key costs nothing to skip. Everything
that can go wrong with the server is a miss, never an exception in the caller's run:
- down / refused / slow (socket timeouts): the read or write is a miss or a skipped write, ONE
  `TierWarning` is issued, and the tier stays quiet for `retry_after_s` (no request is sent:
  misses are instant) before it tries the server again; on success it logs that it is back;
- full (`OOM command not allowed`, maxmemory without eviction): the write is skipped with one
  warning; reads continue;
- denied by the server's ACL (NOPERM): a miss or a skipped write, with one warning that says so
  (never reported as a damaged entry, never deleted);
- any other Redis error: a miss with one warning.
The tier's name (in every warning and log line) is its URL with the password shown as `***`.
The client retries nothing itself (a dead server must cost one timeout, not several).

Requires the `redis` package (`pip install redis`, or the `test` extra).
"""

from __future__ import annotations

import logging
import time
from typing import Optional

from ..errors import ConfigError
from .config import redact_url
from .tiers import Tier

log = logging.getLogger(__name__)


def _import_redis():
    try:
        import redis  # noqa: F401
        from redis.backoff import NoBackoff
        from redis.retry import Retry
    except ImportError:
        raise ConfigError(
            "the Redis tier needs the 'redis' package: pip install 'pagedkv[redis]' (or pip install redis)"
        ) from None
    return redis, Retry, NoBackoff


class RedisTier(Tier):
    """A tier on a Redis server.

    url: e.g. "redis://127.0.0.1:6379/0" (also rediss:// and unix://).
    prefix: prepended to every key (namespace several deployments on one server).
    timeout_s: socket connect and read timeout; retry_after_s: quiet period after a fault.
    ttl_s: expiry of written values (None = keep; let the server's maxmemory policy evict).
    """

    name = "redis"
    remote = True

    def __init__(self, url: str, *, prefix: str = "pagedkv:", timeout_s: float = 0.5,
                 retry_after_s: float = 5.0, ttl_s: Optional[int] = None):
        super().__init__()
        redis, Retry, NoBackoff = _import_redis()
        if not isinstance(url, str) or "://" not in url:
            raise ConfigError(f"redis url must look like redis://host:port/db, got {redact_url(url)!r}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ConfigError(f"redis timeout_s must be a number > 0, got {timeout_s!r}")
        if isinstance(retry_after_s, bool) or not isinstance(retry_after_s, (int, float)) \
                or not retry_after_s >= 0:
            raise ConfigError(f"redis retry_after_s must be a number >= 0, got {retry_after_s!r}")
        if ttl_s is not None and (not isinstance(ttl_s, int) or ttl_s <= 0):
            raise ConfigError(f"redis ttl_s must be a positive int or None, got {ttl_s!r}")
        self._errors = redis.exceptions
        try:
            self.client = redis.Redis.from_url(
                url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                retry=Retry(NoBackoff(), 0), retry_on_timeout=False,
            )
        except ValueError as exc:
            raise ConfigError(f"redis url {redact_url(url)!r} is not valid: {exc}") from None
        self.name = f"redis tier {redact_url(url)}"  # in every warning and log line: no password
        self.url = url
        self.prefix = prefix
        self.retry_after_s = float(retry_after_s)
        self.ttl_s = ttl_s
        self._down_until = 0.0
        self._was_down = False
        self._unsure: list[tuple[str, int]] = []  # writes a connection fault cut: maybe stored

    def _k(self, key: str) -> str:
        return self.prefix + key

    def _available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _fault(self, exc: Exception, doing: str) -> None:
        e = self._errors
        if isinstance(exc, e.OutOfMemoryError) or (
                isinstance(exc, e.ResponseError) and str(exc).startswith("OOM")):
            self._warn_once("full", f"server out of memory while {doing} ({exc}); writes are "
                                    "skipped until it has room")
            return
        if isinstance(exc, e.NoPermissionError) or str(exc).startswith("NOPERM"):
            self._warn_once("noperm", f"the server's ACL denies this user (NOPERM) while "
                                      f"{doing} ({exc}); reads are misses and writes are "
                                      "skipped: allow the user GET, SET, STRLEN, GETRANGE, "
                                      "EXISTS, MGET and DEL on the store's keys")
            return
        if isinstance(exc, (e.ConnectionError, e.TimeoutError, OSError)):
            self._down_until = time.monotonic() + self.retry_after_s
            self._was_down = True
            self._warn_once("down", f"server unreachable or slow while {doing} ({exc}); reads "
                                    f"are misses, retrying in {self.retry_after_s:g}s")
            return
        self._warn_once("error", f"error while {doing} ({exc}); treated as a miss")

    def _ok(self) -> None:
        if self._was_down:
            self._was_down = False
            self._recovered("down")
            log.info("%s is reachable again", self.name)
            self._settle()

    def _settle(self) -> None:
        """Count the writes of a pipeline that a connection fault cut (a timeout while the
        server paused after storing some of them) by what the server holds: one EXISTS each,
        once it answers again; those stored move from put_failures to puts (and the
        `settled` callbacks, e.g. the prefix store's counters, hear of them)."""
        unsure, self._unsure = self._unsure, []
        if not unsure:
            return
        try:
            pipe = self.client.pipeline(transaction=False)
            for key, _ in unsure:
                pipe.exists(self._k(key))
            found = pipe.execute(raise_on_error=False)
        except (self._errors.RedisError, OSError):
            return
        stored = [(k, n) for (k, n), e in zip(unsure, found) if e == 1]
        with self._lock:
            self.stats.put_failures -= len(stored)
            self.stats.puts += len(stored)
            self.stats.bytes_written += sum(n for _, n in stored)
        for hook in self.settled:
            hook(stored)

    def _call(self, doing: str, fn, *args):
        """Run one client call: (True, result) or (False, None) after a counted fault."""
        if not self._available():
            with self._lock:
                self.stats.faults += 1
            return False, None
        try:
            out = fn(*args)
        except self._errors.RedisError as exc:
            self._fault(exc, doing)
            return False, None
        except OSError as exc:
            self._fault(exc, doing)
            return False, None
        self._ok()
        return True, out

    def _get(self, key: str) -> Optional[bytes]:
        ok, v = self._call("reading", self.client.get, self._k(key))
        return v if ok else None

    def _get_sized(self, key: str, size: int) -> Optional[bytes]:
        return self._get_many([key], size)[0]

    def _get_bounded(self, key: str, limit: int) -> Optional[bytes]:
        return self._read_bounded([key], limit, exact=False)[0]

    def _get_many(self, keys: list[str], size: Optional[int]) -> list[Optional[bytes]]:
        """MGET, or with `size` `_read_bounded` (exactly `size` bytes each)."""
        if not keys:
            return []
        if size is None:
            ok, vals = self._call("reading", self.client.mget, [self._k(k) for k in keys])
            return list(vals) if ok else [None] * len(keys)
        return self._read_bounded(keys, size, exact=True)

    def _read_bounded(self, keys: list[str], size: int, exact: bool) -> list[Optional[bytes]]:
        """One pipeline of STRLEN + GETRANGE(0, size - 1) + EXISTS per key: a value longer than
        `size` (with `exact`: of another length), empty, or of another type is b"" (present but
        unusable, so the caller repairs it) and at most `size` bytes come back. EXISTS tells an
        empty value from an absent key (both have STRLEN 0); a user whose ACL denies EXISTS
        reads an empty value as absent, as before."""
        def run():
            pipe = self.client.pipeline(transaction=False)
            for k in keys:
                pipe.strlen(self._k(k))
                pipe.getrange(self._k(k), 0, size - 1)
                pipe.exists(self._k(k))
            return pipe.execute(raise_on_error=False)

        ok, res = self._call("reading", run)
        if not ok:
            return [None] * len(keys)
        out: list[Optional[bytes]] = []
        for n, v, there in zip(res[0::3], res[1::3], res[2::3]):
            err = n if isinstance(n, Exception) else v if isinstance(v, Exception) else None
            if err is not None and not str(err).startswith("WRONGTYPE"):
                self._fault(err, "reading")  # NOPERM or another refusal: not the entry's fault
                out.append(None)
            elif err is not None:
                out.append(b"")  # WRONGTYPE: something else lives under the key
            elif n == 0:
                out.append(b"" if there == 1 else None)  # an empty value: damaged, repaired
            elif exact:
                out.append(v if n == size and len(v) == size else b"")
            else:
                out.append(v if n <= size and len(v) == n else b"")
        return out

    def _get_range(self, key: str, start: int, length: int) -> Optional[bytes]:
        if length == 0:
            return b""
        ok, v = self._call("reading", self.client.getrange, self._k(key), start, start + length - 1)
        return v if ok and v else None

    def _put(self, key: str, value: bytes, if_absent: bool) -> bool:
        ok, res = self._call("writing", lambda: self.client.set(self._k(key), value, ex=self.ttl_s,
                                                                 nx=if_absent))
        if not ok:
            return False
        if res is None and if_absent:  # NX and the key already exists: as good as stored
            return True
        self._recovered("full")
        return True

    def _put_many(self, items: list[tuple[str, bytes]], if_absent: bool) -> list[bool]:
        if not items:
            return []

        def run():
            pipe = self.client.pipeline(transaction=False)
            for key, value in items:
                pipe.set(self._k(key), value, ex=self.ttl_s, nx=if_absent)
            return pipe.execute(raise_on_error=False)

        ok, res = self._call("writing", run)
        if not ok:
            if self._was_down:  # the pipeline may have reached the server: settled when back
                self._unsure = (self._unsure + [(k, len(v)) for k, v in items])[-4096:]
            return [False] * len(items)
        out = []
        for r in res:
            if isinstance(r, Exception):
                self._fault(r, "writing")
                out.append(False)
            else:
                out.append(True)
        if all(out):
            self._recovered("full")
        return out

    def _delete(self, key: str) -> None:
        self._call("deleting", self.client.delete, self._k(key))

    def close(self) -> None:
        try:
            self.client.close()
        except Exception:  # pragma: no cover - closing a dead connection
            pass
