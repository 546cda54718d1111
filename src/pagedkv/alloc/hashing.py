"""Deterministic prefix hashes: a chain over full blocks of token ids.

`root_hash(namespace, salt)` starts a chain; `chain_hash(parent, tokens)` extends it by one full
block. A block's key therefore depends on every token before it, on the cache's namespace (model
identity, format and layer layout, see `CacheConfig.fingerprint`) and on an optional salt (tenant
isolation). blake2b with a 16-byte digest is used (fast, stable across processes and machines);
Python's `hash()` of str/bytes is salted per process and is never used. Token ids are packed as
little-endian int64, so the keys are the same on every platform: a later disk or Redis tier can
publish them.
"""

from __future__ import annotations

import struct
from hashlib import blake2b
from typing import Optional, Sequence, Union

DIGEST_SIZE = 16

Salt = Union[None, str, bytes, int]


def _salt_bytes(salt: Salt) -> bytes:
    if salt is None:
        return b""
    if isinstance(salt, bytes):
        return b"b" + salt
    if isinstance(salt, str):
        return b"s" + salt.encode("utf-8")
    if isinstance(salt, int) and not isinstance(salt, bool):
        return b"i" + str(salt).encode("ascii")
    raise TypeError(f"salt must be None, str, bytes or int, got {type(salt).__name__}")


def root_hash(namespace: bytes = b"", salt: Salt = None) -> bytes:
    """The hash every chain starts from: namespace (bytes) and salt (None, str, bytes or int)."""
    h = blake2b(digest_size=DIGEST_SIZE, person=b"pagedkv-root")
    h.update(struct.pack("<I", len(namespace)))
    h.update(namespace)
    h.update(_salt_bytes(salt))
    return h.digest()


def chain_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """Key of the block holding `tokens` (a full block's token ids) after the chain `parent`."""
    h = blake2b(parent, digest_size=DIGEST_SIZE, person=b"pagedkv-blk")
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return h.digest()


def chain(root: bytes, tokens: Sequence[int], block_size: int, start: Optional[bytes] = None,
          first_block: int = 0, end_block: Optional[int] = None) -> list[bytes]:
    """Keys of the full blocks of `tokens`, from block `first_block` on (parent `start`, or root)
    up to `end_block` (None: every full block). The one walk of the chain."""
    out = []
    h = root if start is None else start
    end = len(tokens) // block_size if end_block is None else end_block
    for i in range(first_block, end):
        h = chain_hash(h, tokens[i * block_size:(i + 1) * block_size])
        out.append(h)
    return out
