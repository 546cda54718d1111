"""Swap records: write a block out, read it back whole or one layer at a time, with prefetch.

A swapped block is one record (`record.py`) in a private tier under a key unique to this swap
space (`<session>-<n>`), bound into the record's checksums. Reading back for attention is per
layer: layer l's sections of every needed record are fetched (`Tier.get_range` of the section
span: one read per block and layer) and verified against the header this space expects; with
prefetch on, layer l+1's sections are fetched in a background thread while layer l computes.
A record that is missing, short or fails a checksum raises `SwapLost` (its data would otherwise
be silently wrong; the swap tier never evicts, so this means outside damage).

Who references a record is not kept here: the block manager counts the table entries naming
each record (`pagedkv.alloc.swapstate`, the one reference-count system) and records sharing
there (fork, or one prefix block swapped out by several sequences); the policy deletes a record
here when its last entry goes.
"""

from __future__ import annotations

import os
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional, Sequence

from ..ops.batch import PagedLayer
from .record import (BlockLayout, RecordError, decode_record, encode_record, header_bytes,
                     read_block, section_offsets, section_views)
from .tiers import SwapLost, Tier

Sections = list[tuple[bytes, bytes]]


@dataclass
class SwapStats:
    swap_outs: int = 0
    swap_ins: int = 0  # whole blocks brought back into the pool (pop into swapped region)
    bytes_out: int = 0
    sections_read: int = 0
    bytes_read: int = 0
    read_s: float = 0.0  # time spent reading sections (including in the prefetch thread)
    wait_s: float = 0.0  # time attention waited for sections
    prefetch_hits: int = 0


class SwapSpace:
    """Records of swapped-out blocks in one private tier, reference counted."""

    def __init__(self, tier: Tier, *, prefetch: bool = True):
        self.tier = tier
        self.session = f"s{os.getpid()}{uuid.uuid4().hex[:10]}"
        self._heads: dict[str, tuple[int, bytes]] = {}  # live key -> (header length, digest)
        self._offsets: dict[int, tuple[BlockLayout, list[int]]] = {}  # per layout (by id)
        self.stats = SwapStats()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedkv-swap") \
            if prefetch else None
        # (layout id, layer) -> (keys, prefetch): the layers of several block groups interleave
        self._pending: dict[tuple[int, int], tuple[tuple[str, ...], Future]] = {}

    # ---- writing ----------------------------------------------------------------------------
    def key_of(self, rid: int, group: int = 0) -> str:
        """The record key of swap record `rid` of the block manager's group `group` (fixed width
        per group: fixed-size records)."""
        return f"{self.session}-r{rid:012d}" if not group else \
            f"{self.session}-g{group:03d}r{rid:012d}"

    def keys(self) -> list[str]:
        """The records held now."""
        return list(self._heads)

    def write(self, layers: Sequence[PagedLayer], layout: BlockLayout, block: int, rid: int,
              group: int = 0) -> str:
        """Store block `block` of every layer (of block group `group`) as record `rid`; returns
        its key. Raises TierWriteError with nothing stored."""
        key = self.key_of(rid, group)
        rec = encode_record(layout, key.encode(), read_block(layers, block))
        self.tier.put(key, rec)
        head = header_bytes(layout, key.encode())
        self._heads[key] = (len(head), head[-16:])
        self.stats.swap_outs += 1
        self.stats.bytes_out += len(rec)
        return key

    def release(self, key: str) -> None:
        """Delete a record (its last table entry went)."""
        if self._heads.pop(key, None) is not None:
            self.tier.delete(key)

    def clear(self) -> None:
        self._drop_pending()
        for key in list(self._heads):
            self.tier.delete(key)
        self._heads.clear()

    # ---- reading ----------------------------------------------------------------------------
    def read_whole(self, layout: BlockLayout, key: str) -> Sections:
        """Every layer's bytes of a record (SwapLost if it is not intact)."""
        t0 = time.perf_counter()
        raw = self.tier.get(key)
        head = self._heads.get(key)
        try:  # checked against the header this space wrote, as the per-layer reads are: the
            # stored header's bytes are never needed (a damaged one costs nothing)
            out = decode_record(raw, layout, key.encode()) if head is None else \
                self._sections(raw, layout, head)
        except RecordError as exc:
            raise SwapLost(f"swapped block {key} in {self.tier.name} is unusable ({exc}); its "
                           "K/V cannot be restored", keys=(key,)) from None
        self.stats.read_s += time.perf_counter() - t0
        self.stats.swap_ins += 1
        self.stats.bytes_read += len(raw)
        return out

    @staticmethod
    def _sections(raw: Optional[bytes], layout: BlockLayout, head: tuple[int, bytes]) -> Sections:
        """Every layer's (K, V) of a whole record whose header is `head` (length, digest), each
        section verified against that digest; RecordError if missing, short or failing."""
        hlen, digest = head
        if raw is None or len(raw) != hlen + layout.payload_bytes:
            raise RecordError("missing" if raw is None else
                              f"length {len(raw)}, expected {hlen + layout.payload_bytes}")
        out, pos, mv = [], hlen, memoryview(raw)
        for i, lay in enumerate(layout.layers):
            got = section_views(mv[pos:pos + lay.section_bytes], digest, i, lay.k_bytes, lay.v_bytes)
            if got is None:
                raise RecordError(f"layer {i} checksum mismatch")
            out.append((bytes(got[0]), bytes(got[1])))
            pos += lay.section_bytes
        return out

    def _fetch(self, layout: BlockLayout, layer: int, keys: tuple[str, ...]
               ) -> list[Optional[tuple[memoryview, memoryview]]]:
        t0 = time.perf_counter()
        out: list[Optional[tuple[memoryview, memoryview]]] = []
        nbytes = 0
        lay_of, offsets = self._offsets.get(id(layout), (None, []))
        if lay_of is not layout:
            offsets = section_offsets(layout)
            if len(self._offsets) > 16:
                self._offsets.clear()
            self._offsets[id(layout)] = (layout, offsets)
        lay = layout.layers[layer]
        length = lay.section_bytes
        heads = [self._heads.get(key) for key in keys]  # None: released meanwhile (stale prefetch)
        starts = [h[0] + offsets[layer] if h is not None else 0 for h in heads]
        read_ranges = getattr(self.tier, "read_ranges", None)
        if read_ranges is not None:
            raws = read_ranges(list(keys), starts, length)
        else:
            raws = [self.tier.get_range(k, st, length) if h is not None else None
                    for k, st, h in zip(keys, starts, heads)]
        for raw, head in zip(raws, heads):
            item = None if head is None else section_views(raw, head[1], layer, lay.k_bytes,
                                                           lay.v_bytes)
            out.append(item)
            nbytes += length if item is not None else 0
        self.stats.read_s += time.perf_counter() - t0
        self.stats.sections_read += len(keys)
        self.stats.bytes_read += nbytes
        return out

    def read_layer(self, layout: BlockLayout, layer: int, keys: tuple[str, ...]
                   ) -> list[tuple[bytes, bytes]]:
        """(K bytes, V bytes) of layer `layer` for each record in `keys`; then starts fetching
        the next layer (wrapping to 0) in the background. SwapLost if any is not intact."""
        pending = self._pending.pop((id(layout), layer), None)
        t0 = time.perf_counter()
        if pending is not None and pending[0] == keys:
            got = pending[1].result()
            self.stats.prefetch_hits += 1
        else:
            got = self._fetch(layout, layer, keys)
        self.stats.wait_s += time.perf_counter() - t0
        if self._pool is not None and keys:
            nxt = (layer + 1) % len(layout.layers)
            old = self._pending.get((id(layout), nxt))
            if old is None or old[0] != keys:
                self._pending[(id(layout), nxt)] = (
                    keys, self._pool.submit(self._fetch, layout, nxt, keys))
        bad = tuple(key for key, item in zip(keys, got) if item is None)
        if bad:
            raise SwapLost(f"{len(bad)} swapped block(s) (layer {layer}) in {self.tier.name} are "
                           "missing or failed their checksum; their K/V cannot be restored",
                           keys=bad)
        return got  # type: ignore[return-value]

    def _drop_pending(self) -> None:
        for _, fut in self._pending.values():
            fut.cancel()
        self._pending.clear()

    def close(self) -> None:
        self.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self.tier.close()
