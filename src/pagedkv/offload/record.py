"""The stored form of one block: a self-describing, checksummed record (never pickle).

A record holds the bytes of ONE block id in EVERY layer (K then V of layer 0, then layer 1, ...),
because one block id addresses the same token slots in every layer: a prefix hit or a swap-in
always needs all of them. Each layer's bytes form a *section* with its own checksum, so a reader
that wants one layer (the per-layer swap read-back) fetches and verifies just that section.

Byte layout (little-endian, `struct` formats in brackets):

    header:
      magic b"PKVB" [4s] | version [H] | flags [H] (0) | block_size [I] | n_layers [H]
      key_len [H] | key (key_len bytes: what the record is stored under, bound into checksums)
      per layer: k_name_len [B] | k codec name | v_name_len [B] | v codec name
                 | num_kv_heads [H] | head_dim [H] | k_bytes [I] | v_bytes [I]
                 | k_scale [f] | v_scale [f] | meaning digest [8s] (codec tables + calibration)
      payload_len [Q] (bytes after the header) | header digest [16s] (blake2b of all the above)
    then per layer: K bytes | V bytes | section check [I]
      section check = crc32(header digest | layer index [H] | K | V)

The header is a pure function of (layout, key), so a reader that knows what it expects can
compute every section offset without parsing, and a section check ties the section to that exact
header (same key, same layout). Sections use crc32 (3x faster than blake2b here: attention reads
every swapped section back at every decode step) and catch truncation and corruption; the header
keeps a blake2b digest. Neither is a defence against someone who can write to the store. `parse_header` parses an unknown buffer with
explicit bounds checks; every reader treats a truncated, corrupted or mismatched record as a
miss (`decode_record` returns None / `RecordError` says why).
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from functools import lru_cache
from hashlib import blake2b
from typing import Optional, Sequence

import numpy as np
import torch

from ..codecs.catalogue import Codec
from ..ops.batch import PagedLayer

MAGIC = b"PKVB"
VERSION = 1
DIGEST = 16
CHECK = 4  # bytes of a section check (crc32)
_FIXED = struct.Struct("<4sHHIHH")  # magic, version, flags, block_size, n_layers, key_len
_LAYER_DIMS = struct.Struct("<HHIIff8s")  # heads, head_dim, k_bytes, v_bytes, k/v scale, digest
_TAIL = struct.Struct("<Q")
MAX_KEY = 1024
MAX_LAYERS = 4096
MAX_SECTION = 1 << 31


class RecordError(Exception):
    """Why a buffer is not a usable record (internal: readers turn it into a miss)."""


@lru_cache(maxsize=None)
def _codec_digest(codec: Codec) -> bytes:
    """What a codec's codes mean: its row and value table (a changed codebook must not hit)."""
    h = blake2b(digest_size=8, person=b"pagedkv-codec")
    h.update(repr((codec.name, codec.code_bits, codec.values.value, codec.group_size,
                   codec.scale_type.value, codec.rotated)).encode())
    table = codec.value_table()
    if table is not None:
        h.update(table.detach().cpu().to(torch.float32).contiguous().numpy().tobytes())
    return h.digest()


@dataclass(frozen=True)
class LayerLayout:
    """What one layer's stored block bytes mean and how many there are (per side)."""

    k_codec: str
    v_codec: str
    num_kv_heads: int
    head_dim: int
    k_bytes: int
    v_bytes: int
    k_scale: float
    v_scale: float
    meaning: bytes  # 8 bytes: digest of both codecs' tables and the calibration (centres, k_mult)

    @classmethod
    def from_layer(cls, pl: PagedLayer) -> "LayerLayout":
        h = blake2b(digest_size=8, person=b"pagedkv-layer")
        h.update(_codec_digest(pl.k_codec))
        h.update(_codec_digest(pl.v_codec))
        for tag, t in ((b"c", pl.k_centre), (b"m", getattr(pl, "k_mult", None)),
                       (b"v", getattr(pl, "v_centre", None))):  # calibration changes the bytes
            if t is not None:
                h.update(tag + t.detach().cpu().to(torch.float32).contiguous().numpy().tobytes())
        # round-trip the scales through float32 so the header compares equal after parsing
        ks, vs = (struct.unpack("<f", struct.pack("<f", float(t.reshape(-1)[0])))[0]
                  for t in (pl.k_scale, pl.v_scale))
        return cls(pl.k_codec.name, pl.v_codec.name, pl.num_kv_heads, pl.head_dim,
                   int(pl.k_pool.shape[1]), int(pl.v_pool.shape[1]), ks, vs, h.digest())

    @property
    def section_bytes(self) -> int:
        return self.k_bytes + self.v_bytes + CHECK


@dataclass(frozen=True)
class BlockLayout:
    """The layout of a record: block size and every layer's `LayerLayout`."""

    block_size: int
    layers: tuple[LayerLayout, ...]

    @classmethod
    def from_layers(cls, layers: Sequence[PagedLayer]) -> "BlockLayout":
        if not layers:
            raise ValueError("a block layout needs at least one layer")
        return cls(int(layers[0].block_size), tuple(LayerLayout.from_layer(pl) for pl in layers))

    @property
    def payload_bytes(self) -> int:
        return sum(lay.section_bytes for lay in self.layers)

    @property
    def block_bytes(self) -> int:
        """K and V bytes of one block over every layer (what a record carries, sans headers)."""
        return sum(lay.k_bytes + lay.v_bytes for lay in self.layers)

    @property
    def fingerprint(self) -> bytes:
        """16 bytes identifying the layout (mixed into shared-store keys)."""
        return blake2b(header_bytes(self, b""), digest_size=16, person=b"pagedkv-layout").digest()


def header_bytes(layout: BlockLayout, key: bytes) -> bytes:
    """The exact header a record of `layout` stored under `key` has (digest included)."""
    return _header(layout, key)


@lru_cache(maxsize=4096)
def _header(layout: BlockLayout, key: bytes) -> bytes:
    if len(key) > MAX_KEY:
        raise ValueError(f"record key of {len(key)} bytes is longer than {MAX_KEY}")
    parts = [_FIXED.pack(MAGIC, VERSION, 0, layout.block_size, len(layout.layers), len(key)), key]
    for lay in layout.layers:
        for name in (lay.k_codec, lay.v_codec):
            b = name.encode("ascii")
            parts.append(struct.pack("<B", len(b)) + b)
        parts.append(_LAYER_DIMS.pack(lay.num_kv_heads, lay.head_dim, lay.k_bytes, lay.v_bytes,
                                      lay.k_scale, lay.v_scale, lay.meaning))
    parts.append(_TAIL.pack(layout.payload_bytes))
    body = b"".join(parts)
    return body + blake2b(body, digest_size=DIGEST, person=b"pagedkv-head").digest()


def _section_digest(head_digest: bytes, index: int, k, v) -> bytes:
    crc = zlib.crc32(head_digest + struct.pack("<H", index))
    crc = zlib.crc32(k, crc)
    return struct.pack("<I", zlib.crc32(v, crc))


def section_views(buf: Optional[bytes], head_digest: bytes, index: int, k_bytes: int,
                  v_bytes: int) -> Optional[tuple[memoryview, memoryview]]:
    """Hot path of the swap read-back: (K, V) memoryviews into `buf` (one layer's section) if
    its length and check are right, else None. Same check as `decode_section`, without copies."""
    if buf is None or len(buf) != k_bytes + v_bytes + CHECK:
        return None
    mv = memoryview(buf)
    n = k_bytes + v_bytes
    crc = zlib.crc32(mv[:n], zlib.crc32(head_digest + struct.pack("<H", index)))
    if crc != int.from_bytes(mv[n:], "little"):
        return None
    return mv[:k_bytes], mv[k_bytes:n]


def section_span(layout: BlockLayout, key: bytes, index: int) -> tuple[int, int]:
    """(offset, length) of layer `index`'s section (K, V, digest) inside the record."""
    off = len(header_bytes(layout, key))
    for lay in layout.layers[:index]:
        off += lay.section_bytes
    return off, layout.layers[index].section_bytes


def record_size(layout: BlockLayout, key: bytes) -> int:
    return len(header_bytes(layout, key)) + layout.payload_bytes


def encode_record(layout: BlockLayout, key: bytes, sections: Sequence[tuple[bytes, bytes]]) -> bytes:
    """A record from per-layer (K bytes, V bytes); lengths must match the layout."""
    if len(sections) != len(layout.layers):
        raise ValueError(f"{len(sections)} sections for {len(layout.layers)} layers")
    head = header_bytes(layout, key)
    hd = head[-DIGEST:]
    parts = [head]
    for i, ((k, v), lay) in enumerate(zip(sections, layout.layers)):
        if len(k) != lay.k_bytes or len(v) != lay.v_bytes:
            raise ValueError(f"layer {i}: got {len(k)}+{len(v)} bytes, layout says "
                             f"{lay.k_bytes}+{lay.v_bytes}")
        parts += [k, v, _section_digest(hd, i, k, v)]
    return b"".join(parts)


@dataclass(frozen=True)
class ParsedHeader:
    """What `parse_header` read from an unknown buffer."""

    version: int
    key: bytes
    layout: BlockLayout
    header_len: int
    payload_len: int
    digest: bytes


def parse_header(buf: bytes) -> ParsedHeader:
    """Parse a record header with explicit bounds checks; RecordError on anything wrong."""
    mv = memoryview(buf)
    n = len(mv)
    pos = 0

    def take(size: int) -> memoryview:
        nonlocal pos
        if size < 0 or pos + size > n:
            raise RecordError(f"truncated: need {size} bytes at offset {pos}, have {n - pos}")
        out = mv[pos:pos + size]
        pos += size
        return out

    magic, version, flags, block_size, n_layers, key_len = _FIXED.unpack(take(_FIXED.size))
    if magic != MAGIC:
        raise RecordError(f"bad magic {bytes(magic)!r}")
    if version != VERSION:
        raise RecordError(f"format version {version}, this reader knows {VERSION}")
    if flags != 0:
        raise RecordError(f"unknown flags {flags:#x}")
    if not 0 < n_layers <= MAX_LAYERS or key_len > MAX_KEY or block_size == 0:
        raise RecordError(f"implausible header: {n_layers} layers, key {key_len} bytes, "
                          f"block_size {block_size}")
    key = bytes(take(key_len))
    layers = []
    for _ in range(n_layers):
        names = []
        for _side in range(2):
            (ln,) = struct.unpack("<B", take(1))
            try:
                names.append(bytes(take(ln)).decode("ascii"))
            except UnicodeDecodeError:
                raise RecordError("codec name is not ascii") from None
        h, d, kb, vb, ks, vs, meaning = _LAYER_DIMS.unpack(take(_LAYER_DIMS.size))
        if kb > MAX_SECTION or vb > MAX_SECTION:
            raise RecordError(f"implausible section sizes {kb}, {vb}")
        layers.append(LayerLayout(names[0], names[1], h, d, kb, vb, ks, vs, bytes(meaning)))
    (payload_len,) = _TAIL.unpack(take(_TAIL.size))
    body_end = pos
    digest = bytes(take(DIGEST))
    if blake2b(mv[:body_end], digest_size=DIGEST, person=b"pagedkv-head").digest() != digest:
        raise RecordError("header checksum mismatch")
    layout = BlockLayout(block_size, tuple(layers))
    if payload_len != layout.payload_bytes:
        raise RecordError(f"payload length {payload_len} disagrees with the layers "
                          f"({layout.payload_bytes})")
    return ParsedHeader(version, key, layout, pos, payload_len, digest)


def decode_record(buf: Optional[bytes], layout: BlockLayout, key: bytes) -> list[tuple[bytes, bytes]]:
    """Per-layer (K bytes, V bytes) of a record, verified; RecordError if unusable."""
    if buf is None:
        raise RecordError("missing")
    head = parse_header(buf)
    if head.key != key:
        raise RecordError("stored under a different key")
    if head.layout != layout:
        raise RecordError("layout mismatch (model, format, dims, scales or codebooks differ)")
    if len(buf) != head.header_len + head.payload_len:
        raise RecordError(f"length {len(buf)}, header says {head.header_len + head.payload_len}")
    mv = memoryview(buf)
    out = []
    pos = head.header_len
    for i, lay in enumerate(layout.layers):
        k = bytes(mv[pos:pos + lay.k_bytes])
        v = bytes(mv[pos + lay.k_bytes:pos + lay.k_bytes + lay.v_bytes])
        d = bytes(mv[pos + lay.k_bytes + lay.v_bytes:pos + lay.section_bytes])
        assert len(d) == CHECK
        if _section_digest(head.digest, i, k, v) != d:
            raise RecordError(f"layer {i} checksum mismatch")
        out.append((k, v))
        pos += lay.section_bytes
    return out


def try_decode_record(buf: Optional[bytes], layout: BlockLayout, key: bytes
                      ) -> Optional[list[tuple[bytes, bytes]]]:
    """`decode_record`, with None for any unusable buffer (a miss)."""
    try:
        return decode_record(buf, layout, key)
    except RecordError:
        return None


def section_offsets(layout: BlockLayout) -> list[int]:
    """Offset of each layer's section after the header (add the header length)."""
    out, off = [], 0
    for lay in layout.layers:
        out.append(off)
        off += lay.section_bytes
    return out


def header_digest(layout: BlockLayout, key: bytes) -> bytes:
    return header_bytes(layout, key)[-DIGEST:]


def decode_section(buf: Optional[bytes], layout: BlockLayout, key: bytes, index: int,
                   head_digest: Optional[bytes] = None) -> tuple[bytes, bytes]:
    """(K bytes, V bytes) of layer `index` from its section alone (as read at `section_span`);
    RecordError if missing, short, or its check does not match the expected header.
    head_digest: `header_digest(layout, key)` when the caller has it already."""
    lay = layout.layers[index]
    if buf is None:
        raise RecordError("missing")
    if len(buf) != lay.section_bytes:
        raise RecordError(f"section of {len(buf)} bytes, expected {lay.section_bytes}")
    hd = head_digest if head_digest is not None else header_digest(layout, key)
    mv = memoryview(buf)
    k, v, d = mv[:lay.k_bytes], mv[lay.k_bytes:lay.k_bytes + lay.v_bytes], bytes(mv[-CHECK:])
    if _section_digest(hd, index, k, v) != d:
        raise RecordError(f"layer {index} checksum mismatch")
    return bytes(k), bytes(v)


# ---- pool <-> bytes -----------------------------------------------------------------------------
def read_block(layers: Sequence[PagedLayer], block: int) -> list[tuple[bytes, bytes]]:
    """Per-layer (K bytes, V bytes) of block id `block` (copied to host)."""
    out = []
    for pl in layers:
        out.append((pl.k_pool[block].cpu().numpy().tobytes(),
                    pl.v_pool[block].cpu().numpy().tobytes()))
    return out


def write_block(layers: Sequence[PagedLayer], block: int, sections: Sequence[tuple[bytes, bytes]]) -> None:
    """Write per-layer (K bytes, V bytes) into block id `block` of every layer's pools."""
    for pl, (k, v) in zip(layers, sections):
        for pool, data in ((pl.k_pool, k), (pl.v_pool, v)):
            if not pool.shape[1]:  # an empty side (a latent layer's record member has no V)
                continue
            if pool.device.type == "cpu":  # a numpy view of the row: no tensor op per row
                pool[block].numpy()[:] = np.frombuffer(data, dtype=np.uint8)
            else:
                pool[block].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(pool.device))
