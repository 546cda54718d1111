"""Swap records: write a block out, read it back whole or one layer at a time, with prefetch.

A swapped block is one record (`record.py`) in a private tier under a key unique to this swap
space (`<session>-<n>`), bound into the record's checksums. Reading back for attention is per
layer: layer l's sections of every needed record are fetched (`Tier.get_range` of the section
span: one read per block and layer) and verified against the header this space expects; with
prefetch on, layer l+1's sections are fetched in a background thread while layer l computes.
A record that is missing, short or fails a checksum raises `SwapLost` (its data would otherwise
be silently wrong; the swap tier never evicts, so this means outside damage).

Several sequences may reference one record (fork, or the same prefix block swapped out by
several sequences: records of prefix-keyed blocks are shared by chain hash, so a common prompt is
swapped out once); a record is deleted when its last reference goes.
"""

from __future__ import annotations

import itertools
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
        self._ids = itertools.count()
        self.refs: dict[str, int] = {}
        self.by_chain: dict[bytes, str] = {}  # prefix chain hash -> record of that block
        self._heads: dict[str, tuple[int, bytes]] = {}  # key -> (header length, header digest)
        self._offsets: tuple[Optional[BlockLayout], list[int]] = (None, [])
        self._chain_of: dict[str, bytes] = {}
        self.stats = SwapStats()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedkv-swap") \
            if prefetch else None
        self._pending: dict[int, tuple[tuple[str, ...], Future]] = {}

    # ---- writing ----------------------------------------------------------------------------
    def key_of(self, rid: int) -> str:
        """The record key of the block manager's swap record `rid`."""
        return f"{self.session}-r{rid:012d}"

    def write(self, layers: Sequence[PagedLayer], layout: BlockLayout, block: int,
              chain: Optional[bytes] = None, rid: Optional[int] = None) -> str:
        """Store block `block` of every layer; returns its record key (one more reference).
        `chain`: the block's prefix key when it has one (immutable contents): a record already
        holding that block is shared instead of written again. Raises TierWriteError with
        nothing stored."""
        if chain is not None and chain in self.by_chain:
            key = self.by_chain[chain]
            self.refs[key] += 1
            return key
        key = self.key_of(rid) if rid is not None else \
            f"{self.session}-{next(self._ids):013d}"  # fixed width: fixed-size records
        rec = encode_record(layout, key.encode(), read_block(layers, block))
        self.tier.put(key, rec)
        self.refs[key] = 1
        head = header_bytes(layout, key.encode())
        self._heads[key] = (len(head), head[-16:])
        if chain is not None:
            self.by_chain[chain] = key
            self._chain_of[key] = chain
        self.stats.swap_outs += 1
        self.stats.bytes_out += len(rec)
        return key

    def share(self, key: str) -> None:
        self.refs[key] += 1

    def release(self, key: str) -> None:
        r = self.refs[key] - 1
        if r:
            self.refs[key] = r
        else:
            del self.refs[key]
            self._heads.pop(key, None)
            chain = self._chain_of.pop(key, None)
            if chain is not None:
                del self.by_chain[chain]
            self.tier.delete(key)

    def clear(self) -> None:
        self._drop_pending()
        for key in list(self.refs):
            self.tier.delete(key)
        self.refs.clear()
        self._heads.clear()
        self.by_chain.clear()
        self._chain_of.clear()

    # ---- reading ----------------------------------------------------------------------------
    def read_whole(self, layout: BlockLayout, key: str) -> Sections:
        """Every layer's bytes of a record (SwapLost if it is not intact)."""
        t0 = time.perf_counter()
        raw = self.tier.get(key)
        try:
            out = decode_record(raw, layout, key.encode())
        except RecordError as exc:
            raise SwapLost(f"swapped block {key} in {self.tier.name} is unusable ({exc}); its "
                           "K/V cannot be restored", keys=(key,)) from None
        self.stats.read_s += time.perf_counter() - t0
        self.stats.swap_ins += 1
        self.stats.bytes_read += len(raw)
        return out

    def _fetch(self, layout: BlockLayout, layer: int, keys: tuple[str, ...]
               ) -> list[Optional[tuple[memoryview, memoryview]]]:
        t0 = time.perf_counter()
        out: list[Optional[tuple[memoryview, memoryview]]] = []
        nbytes = 0
        lay_of, offsets = self._offsets
        if lay_of is not layout:
            offsets = section_offsets(layout)
            self._offsets = (layout, offsets)
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
        pending = self._pending.pop(layer, None)
        t0 = time.perf_counter()
        if pending is not None and pending[0] == keys:
            got = pending[1].result()
            self.stats.prefetch_hits += 1
        else:
            got = self._fetch(layout, layer, keys)
        self.stats.wait_s += time.perf_counter() - t0
        if self._pool is not None and keys:
            nxt = (layer + 1) % len(layout.layers)
            old = self._pending.get(nxt)
            if old is None or old[0] != keys:
                self._pending[nxt] = (keys, self._pool.submit(self._fetch, layout, nxt, keys))
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
