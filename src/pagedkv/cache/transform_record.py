"""The stored form of every layer's transform (key centre and multipliers, value centre, fp8
scales): what a shared prefix store keeps beside the blocks, so a second process stores and
reads blocks relative to the same transform (its blocks then mean the same bytes).

Byte layout (little-endian): magic b"PKVT" | version [H] | n_layers [H] | per layer, per field
(k_centre, k_mult, v_centre, k_scale, v_scale): numel [i] (-1 = none) then float32 data |
blake2b-16 digest of all the above. Never pickle; a damaged record reads as None.
"""

from __future__ import annotations

import logging
import struct
from hashlib import blake2b
from typing import Optional, Sequence

import numpy as np
import torch

from ..offload.keys import TAG

MAGIC = b"PKVT"
FIELDS = ("k_centre", "k_mult", "v_centre", "k_scale", "v_scale")
_HEAD = struct.Struct("<4sHH")
_N = struct.Struct("<i")

Transform = dict  # field name -> float32 tensor or None
log = logging.getLogger(__name__)


def encode_transforms(layers: Sequence[Transform]) -> bytes:
    out = bytearray(_HEAD.pack(MAGIC, 1, len(layers)))
    for t in layers:
        for f in FIELDS:
            x = t.get(f)
            if x is None:
                out += _N.pack(-1)
            else:
                a = x.detach().cpu().float().contiguous().numpy()
                out += _N.pack(a.size) + a.tobytes()
    out += blake2b(bytes(out), digest_size=16).digest()
    return bytes(out)


def max_record_size(shapes: Sequence[dict]) -> int:
    """The longest record `encode_transforms` writes for layers of `shapes` (every field that
    has a shape present): what a reader reads at most."""
    fields = sum(_N.size + (4 * int(np.prod(sh[f])) if sh.get(f) is not None else 0)
                 for sh in shapes for f in FIELDS)
    return _HEAD.size + fields + 16


def decode_transforms(raw: Optional[bytes], shapes: Sequence[dict]) -> Optional[list[Transform]]:
    """The transforms of `len(shapes)` layers (shapes: per layer field -> expected shape), or
    None when `raw` is missing, damaged or for another layout."""
    if raw is None or len(raw) < _HEAD.size + 16:
        return None
    body, digest = raw[:-16], raw[-16:]
    if blake2b(body, digest_size=16).digest() != digest:
        return None
    magic, version, n = _HEAD.unpack_from(body)
    if magic != MAGIC or version != 1 or n != len(shapes):
        return None
    pos, out = _HEAD.size, []
    for shape in shapes:
        t: Transform = {}
        for f in FIELDS:
            if pos + _N.size > len(body):
                return None
            (k,) = _N.unpack_from(body, pos)
            pos += _N.size
            if k < 0:
                t[f] = None
                continue
            want = shape.get(f)
            if want is None or int(np.prod(want)) != k or pos + 4 * k > len(body):
                return None
            t[f] = torch.from_numpy(np.frombuffer(body, np.float32, k, pos).copy()).view(*want)
            pos += 4 * k
        out.append(t)
    return out if pos == len(body) else None


TRANSFORM_RECORD = "transform"  # the side record's name in a prefix store (`StoreKeys.aux_key`)


class SharedTransform:
    """The layers' transform as a side record of a shared prefix store (`store`: a
    `pagedkv.offload.prefix.PrefixStore`), for the front doors that fit a transform themselves
    (the transformers drop-ins' first-chunk statistics, the engine cache's latent fp8 scales).
    The first cache to publish wins (`if_absent`): a cache that has fitted nothing yet adopts the
    stored transform before looking up a prefix, so it reads (and writes) blocks relative to the
    same transform. Block keys cover the record layout (scales included), so blocks written
    under any other transform are plain misses."""

    _damage_warned = False  # one warning per process for a damaged record

    def __init__(self, store=None):
        self.store = store  # the prefix store (None: nothing to share)
        self._transform_published = False

    def publish_transform(self, layers: Sequence[Transform]) -> None:
        """Publish `layers`' transforms once (never raises: a tier fault only logs)."""
        if self._transform_published or self.store is None:
            return
        key = self.store.keys.aux_key(TRANSFORM_RECORD)
        rec = self.store.keys.seal_bytes(key, encode_transforms(layers))
        self._transform_published = True
        try:
            self.store.tier.put(key, rec, if_absent=True)
        except Exception as exc:  # a tier fault never stops generation
            log.warning("prefix store: the layers' transform was not published (%s)", exc)

    def stored_transform(self, shapes: Sequence[dict]) -> Optional[list[Transform]]:
        """The store's transforms for layers of `shapes` (per layer field -> shape), or None
        (none stored, damaged, forged, or for another layout). Once adopted, this cache's
        transform is the stored one: nothing left to publish. At most the longest record for
        `shapes` is read; a record that fails its checks (its key covers the layout, so it is
        damage, not another model's) is deleted, with one warning, so this cache's own
        transform is published in its place."""
        if self.store is None:
            return None
        keys, tier = self.store.keys, self.store.tier
        key = keys.aux_key(TRANSFORM_RECORD)
        raw = tier.get_bounded(key, max_record_size(shapes) + TAG)
        got = decode_transforms(keys.open_bytes(raw, key), shapes)
        if got is not None:
            self._transform_published = True
        elif raw is not None:
            if not SharedTransform._damage_warned:
                SharedTransform._damage_warned = True
                log.warning("prefix store: the layers' transform record (%s in %s) failed its "
                            "checks; deleted it, this cache publishes its own", key, tier.name)
            tier.delete(key)
            self.store.stats.damaged_removed += 1
        return got
