"""Keyed store keys and sealed records: what a shared prefix store lets its readers and writers do.

A shared store (a directory, a Redis server) is readable and writable by more than this process.
Two things protect what this process reads back from it:

- **store keys** are a keyed MAC (blake2b with a key derived from the operator's secret) over the
  store identity (model identity and every setting that changes stored K/V, see
  `store_identity`), the namespace, the record layout and the block's prefix chain hash. Without
  the secret nobody can compute the key of a prompt's block: a store reader cannot test whether
  a prompt is stored (no membership oracle), cannot follow a chain to the next block, and cannot
  aim a forged value at another tenant's next block. The chain hash itself is never stored.
- **sealed records**: a stored value is `record | tag`, the tag a keyed MAC over the store key
  and the whole record (`record.py`'s checksums only catch accidents). A value that anyone
  without the secret wrote, or that was moved from another key, fails the tag and is a miss.

What they do not protect: the K/V bytes themselves are stored in the clear, so anyone who can
read the store can read them, and layer-0 keys reveal the tokens to someone who has the model.
Keep readers out with access control: a namespace per tenant (a key prefix on Redis, to which a
Redis ACL user can be confined; a subdirectory on disk, with its own permissions), and a
different secret per tenant if tenants must not even verify each other's entries. Anyone with
write access can still delete or overwrite entries (a denial of hits, never wrong K/V).
The per-sequence salt separates prefix chains (sequences with different salts never share a
block, in memory or in the store), it is not a secret and protects nothing against store readers.
"""

from __future__ import annotations

import hmac
import os
import re
import secrets
import tempfile
from hashlib import blake2b
from typing import Optional, Sequence

from ..errors import ConfigError
from ..private import private_problem, stat_problem
from .record import BlockLayout, encode_record, record_size, try_decode_record

KEY_SCHEME = "pkv2"  # v1 keys hashed the chain without a secret
TAG = 16  # bytes of a record's MAC
SECRET_FILE = ".secret"  # the disk store's generated secret, 0600, in its directory
MIN_SECRET = 16
_NAMESPACE = re.compile(r"^[0-9A-Za-z_\-]{0,64}$")
_PROCESS_SECRET = secrets.token_bytes(32)  # for tiers private to this process (memory)


def check_namespace(namespace: str) -> str:
    if not isinstance(namespace, str) or not _NAMESPACE.match(namespace):
        raise ConfigError("store_namespace must be 0-64 characters of [0-9A-Za-z_-], got "
                          f"{namespace!r}")
    return namespace


def secret_bytes(secret, what: str = "store_secret") -> bytes:
    """The operator's secret as bytes (str is UTF-8); at least 16 bytes."""
    if isinstance(secret, str):
        secret = secret.encode("utf-8")
    if not isinstance(secret, (bytes, bytearray)) or len(secret) < MIN_SECRET:
        shown = f"{len(secret)} bytes" if isinstance(secret, (bytes, bytearray)) else \
            type(secret).__name__
        raise ConfigError(f"{what} must be a str or bytes of at least {MIN_SECRET} bytes (e.g. "
                          f"secrets.token_hex(32)), got {shown}")
    return bytes(secret)


class StoreKeys:
    """Store keys and record seals of one prefix store (one secret, identity and namespace)."""

    def __init__(self, secret: bytes, identity: bytes, namespace: str = ""):
        k = blake2b(secret_bytes(secret), digest_size=32, person=b"pagedkv-secret").digest()
        self.namespace = check_namespace(namespace)
        ns = namespace.encode()
        self._key = blake2b(key=k, digest_size=20, person=b"pagedkv-key")
        self._key.update(len(ns).to_bytes(1, "little") + ns + len(identity).to_bytes(2, "little")
                         + identity)
        self._tag = blake2b(key=k, digest_size=TAG, person=b"pagedkv-seal")

    def key(self, layout: BlockLayout, chain: bytes, group: bytes = b"") -> str:
        """The tier key of the block whose prefix chain hash is `chain` (group: which block
        group of the cache it belongs to, b"" for the global one: two groups of one cache may
        have the same record layout)."""
        h = self._key.copy()
        h.update(layout.fingerprint)
        h.update(chain)
        if group:
            h.update(b"|group|" + group)
        return f"{KEY_SCHEME}.{h.hexdigest()}"

    def aux_key(self, name: str) -> str:
        """The tier key of a named side record of this store (e.g. the layers' transform)."""
        h = self._key.copy()
        h.update(b"aux|" + name.encode())
        return f"{KEY_SCHEME}.{h.hexdigest()}"

    def seal_bytes(self, key: str, payload: bytes) -> bytes:
        """`payload` with its tag, bound to `key` (a side record)."""
        return payload + self._mac(key, payload)

    def open_bytes(self, value: Optional[bytes], key: str) -> Optional[bytes]:
        """The payload of a sealed side record, or None unless its tag holds."""
        if not value or len(value) <= TAG:
            return None
        mv = memoryview(value)
        if not hmac.compare_digest(self._mac(key, mv[:-TAG]), bytes(mv[-TAG:])):
            return None
        return bytes(mv[:-TAG])

    @staticmethod
    def size(layout: BlockLayout, key: str) -> int:
        """Exact length of the value stored under `key` (what a reader reads at most)."""
        return record_size(layout, key.encode()) + TAG

    def _mac(self, key: str, record) -> bytes:
        h = self._tag.copy()
        h.update(key.encode() + b"\0")
        h.update(record)
        return h.digest()

    def seal(self, layout: BlockLayout, key: str, sections: Sequence[tuple[bytes, bytes]]) -> bytes:
        """The value to store under `key`: the block's record (bound to `key`) and its tag."""
        rec = encode_record(layout, key.encode(), sections)
        return rec + self._mac(key, rec)

    def open(self, value: Optional[bytes], layout: BlockLayout, key: str
             ) -> Optional[list[tuple[bytes, bytes]]]:
        """Per-layer (K, V) bytes of a value read under `key`, or None unless its length, tag
        and record checks all hold."""
        if not value or len(value) != self.size(layout, key):
            return None
        mv = memoryview(value)
        if not hmac.compare_digest(self._mac(key, mv[:-TAG]), bytes(mv[-TAG:])):
            return None
        return try_decode_record(bytes(mv[:-TAG]), layout, key.encode())


def disk_secret(root: os.PathLike) -> bytes:
    """The secret of a disk store that was given none: `root/.secret` (32 random bytes, created
    0600 by the first process; whoever can read it can use the store, as whoever can read the
    directory can read its entries). Trusted only when the directory and the file are private to
    this user (`pagedkv.private`: owned by this user, no symbolic link, not writable by group or
    others): another local user who made the directory first, or can replace the file, would
    know the secret and could seal K/V this store then loads. ConfigError naming `store_secret`
    otherwise, or if it cannot be created or read."""
    root = os.fspath(root)
    path = os.path.join(root, SECRET_FILE)
    hint = ("pass OffloadConfig(store_secret=...) (the same secret in every process that shares "
            "the store)")
    problem = private_problem(root, directory=True)
    if problem is not None:
        raise ConfigError(f"the disk prefix store's directory {root!r} {problem}: another user "
                          "could have planted its secret (and K/V sealed with it); make it "
                          f"private to this user (chmod 700) or {hint}")
    if not os.path.lexists(path):
        try:  # write it whole, then link it into place: a reader never sees half a secret
            fd, tmp = tempfile.mkstemp(prefix=".secret.", dir=root)
        except OSError:
            pass  # read-only directory: it must already be there
        else:
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(secrets.token_bytes(32))
                os.link(tmp, path)
            except OSError:
                pass  # another process linked its own first: use that one
            finally:
                os.unlink(tmp)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | os.O_NONBLOCK)
    except OSError as exc:
        raise ConfigError(f"the prefix store's secret file {path!r} cannot be read ({exc}); "
                          f"{hint}") from None
    try:
        st = os.fstat(fd)
        problem = stat_problem(st, directory=False)
        data = os.read(fd, 64) if problem is None and st.st_size == 32 else b""
    finally:
        os.close(fd)
    if problem is not None:
        raise ConfigError(f"the prefix store's secret file {path!r} {problem}: another user "
                          f"could have planted it; remove it or {hint}")
    if len(data) != 32:  # a concurrent creator has not finished writing, or it was replaced
        raise ConfigError(f"the prefix store's secret file {path!r} is not 32 bytes; remove it "
                          f"or {hint}")
    return data


def process_secret() -> bytes:
    """A random secret of this process (for a store no other process can reach)."""
    return _PROCESS_SECRET
