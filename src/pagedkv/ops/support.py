"""What each ops backend implements, stated in codec traits; the dispatcher enforces it.

A backend declares a `CodecSupport`: the (decode kind, code bits) pairs its attention reads, the
(encode rule, code bits) pairs its store writes, and the group sizes it handles (0 = no per-group
scale; the store's own set where it differs), each None for "every row `pagedkv.codecs.derive.traits`
describes" (the reference). The
dispatcher (`dispatch.select_backend`) asks `refusal(...)` for both codecs of a layer before it
runs a backend: automatic selection then falls back to the next backend (finally the reference),
and a backend named by the caller raises InvalidInput with the reason. A row `traits` cannot
describe raises ConfigError for every backend, the reference included, so a new catalogue row
is either computed right or refused; never decoded with another row's rules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..codecs.catalogue import Codec
from ..codecs.derive import DecodeKind, EncodeRule, traits


@dataclass(frozen=True)
class CodecSupport:
    """decode: frozenset of (DecodeKind, bits) attention reads; encode: frozenset of
    (EncodeRule, bits) the store writes; groups: frozenset of group sizes; None = any.
    store_groups: the group sizes the store handles where they differ from `groups` (None: the
    same as `groups`). unrotated_encode: the (EncodeRule, bits) the store writes for rows without
    the WHT rotation, where that differs from `encode` (None: the same)."""

    decode: Optional[frozenset] = None
    encode: Optional[frozenset] = None
    groups: Optional[frozenset] = None
    store_groups: Optional[frozenset] = None
    unrotated_encode: Optional[frozenset] = None

    def refusal(self, codec: Codec, *, store: bool) -> Optional[str]:
        """None when this backend implements `codec` for the store (store=True) or attention,
        else why not. ConfigError when no backend can (the row has no derivation)."""
        t = traits(codec)
        if store:
            wanted, have, what = (t.encode, t.bits), self.encode, "encode rule"
            if not codec.rotated and self.unrotated_encode is not None:
                have, what = self.unrotated_encode, "encode rule (unrotated row)"
        else:
            wanted, have, what = (t.decode, t.bits), self.decode, "decode kind"
        if have is not None and wanted not in have:
            return f"{what} {wanted[0].value} at {t.bits} bits is not implemented"
        groups = self.store_groups if store and self.store_groups is not None else self.groups
        if groups is not None and t.group not in groups:
            return f"group size {t.group} is not implemented (groups {sorted(groups)})"
        return None


def pairs(kind, bits) -> frozenset:
    """frozenset of (kind, b) for every b in bits: a declaration helper."""
    return frozenset((kind, b) for b in bits)


ANY = CodecSupport()

__all__ = ["CodecSupport", "DecodeKind", "EncodeRule", "pairs", "ANY"]
