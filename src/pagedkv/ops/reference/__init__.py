"""The reference ops: readable torch, any device, the oracle every fast path is tested against.

Same signatures as the public ops in `pagedkv.ops` (which validate, then dispatch); registered
as the "reference" backend, the fallback for every device.
"""

from ..dispatch import Backend, register_backend
from ..support import ANY
from .attention import attend, attention_weights, decode_attention, gather_rows, prefill_attention
from .sparse import SparseVStats, measure_sparse_v
from .store import store, store_side

BACKEND = Backend(
    name="reference",
    device_types=(),
    store=store,
    decode_attention=decode_attention,
    prefill_attention=prefill_attention,
    priority=-1000,
    codecs=ANY,  # every row codecs.derive describes (generic packing, the value table)
)
register_backend(BACKEND)

__all__ = [
    "store", "store_side", "decode_attention", "prefill_attention", "attend", "attention_weights",
    "gather_rows", "measure_sparse_v", "SparseVStats", "BACKEND",
]
