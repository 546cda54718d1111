"""Tiers below memory: a per-sequence resident cap with swap, and a shared prefix store.

- Policies (`policy.py`) the cache core calls at admit, commit and attend: `SwapPolicy` (the
  resident cap), `PrefixPolicy` (the prefix store), one per block group; `coretiers.CoreTiers`
  holds them for every group of a block manager: `pagedkv.cache.PagedCache(config,
  offload=OffloadConfig(...))` and the transformers drop-in use it.
- Tiers: `DiskTier` (a file per value, size limit, LRU: the embedded prefix store),
  `SwapFileTier` (fixed-size slots in one file: the disk swap; `GroupedSwapFiles`, one per
  block group, when a cache has several), `RedisTier` (shared across
  processes and machines), `MemoryTier` (tests, benchmarks, swap in memory).
- `record`: the checksummed byte format of one stored block (every layer, K and V).
- `keys` / `store` / `identity`: keyed store keys and sealed records (the operator's secret),
  namespaces, and the model identity a shared prefix store requires (`weights_identity`).
See docs/offload.md.
"""

from .config import OffloadConfig, default_cache_dir
from .disk import DiskTier
from .identity import store_identity, weights_identity
from .keys import StoreKeys
from .prefix import PrefixStore
from .record import BlockLayout, RecordError, decode_record, encode_record, parse_header
from .swap import SwapSpace
from .store import open_prefix_store
from .swapfile import SwapFileTier
from .tiers import MemoryTier, SwapLost, Tier, TierWarning, TierWriteError

__all__ = [
    "OffloadConfig", "default_cache_dir",
    "Tier", "MemoryTier", "DiskTier", "SwapFileTier", "TierWarning", "TierWriteError", "SwapLost",
    "PrefixStore", "StoreKeys", "open_prefix_store", "store_identity", "weights_identity",
    "SwapSpace",
    "BlockLayout", "RecordError", "encode_record", "decode_record", "parse_header",
]


def __getattr__(name):  # RedisTier imports the optional `redis` package lazily
    if name == "RedisTier":
        from .redis_tier import RedisTier

        return RedisTier
    raise AttributeError(name)
