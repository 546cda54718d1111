"""The paged cache: per-layer pools sized from the codec catalogue, and the sequences over them.

Public API (stable; see docs/internals.md, "Cache"):
- `CacheConfig` (frozen): layers, dims, formats, high-precision layers, block size, capacity.
- `PagedCache(config)`: `add_sequence`, `allocate`, `step`, `commit`, `fork`, `pop`, `reset`,
  `free`, `clear`, `reset_prefix_cache`, `block_tables`, `seq_lens`, `slot_mapping`, `store`,
  `gather`, `configure_layer`, `stats`, `trace`; `layers[i]` is layer i's `PagedLayer`.
- `NewSequence`, `StepBatch`, `CacheStats`: frozen results.
- `slots_from_block_table`: slot mapping from block tables and positions (tensor helper).
"""

from .config import CacheConfig, LayerSpec
from .paged import CacheStats, NewSequence, PagedCache
from .tables import StepBatch, slots_from_block_table

__all__ = ["CacheConfig", "LayerSpec", "PagedCache", "NewSequence", "CacheStats", "StepBatch",
           "slots_from_block_table"]
