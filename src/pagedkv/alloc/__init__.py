"""Block bookkeeping without torch: the pool of block ids and the sequences over it.

- `BlockPool`: free list, reference counts, prefix index (chain hash -> block), LRU of
  unreferenced cached blocks, optional event trace. O(1) per operation.
- `SequenceManager`: one block group's sequences: token ids and block tables; add with prefix
  hits, extend (with copy-on-write of a shared partly filled block), commit, fork, pop, free.
- `BlockManager` (`manager.py`): THE block manager every front door uses: sequences over every
  block group, all or nothing, prefix hits every group serves, the per-step plan;
  `load_prefix` (`tierload.py`) for a tier below memory.
- `hashing`: the deterministic prefix-key chain (blake2b over parent key + int64 token ids).

The cache (`pagedkv.cache`) owns the tensors and applies the block copies this layer asks for.
"""

from .hashing import chain_hash, root_hash
from .pool import BlockPool
from .sequences import SequenceManager
from .trace import BlockEvent, BlockTrace

__all__ = ["BlockPool", "SequenceManager", "BlockEvent", "BlockTrace", "chain_hash", "root_hash"]
