"""Views of a pool of blocks as its data and scale sections (see docs/internals.md)."""

from __future__ import annotations

import torch

from .catalogue import Codec


def block_views(codec: Codec, pool: torch.Tensor, block_size: int, num_kv_heads: int, head_dim: int):
    """pool uint8 [num_blocks, block_bytes] -> (data [nb, bs, H, row_data_bytes],
    scales [nb, bs, H, row_scale_bytes]); both are views sharing the pool's memory."""
    nb = pool.shape[0]
    data_end = block_size * num_kv_heads * codec.row_data_bytes(head_dim)
    expected = codec.block_bytes(block_size, num_kv_heads, head_dim)
    assert pool.dtype == torch.uint8 and pool.shape[1] == expected, (pool.shape, expected)
    data = pool[:, :data_end].view(nb, block_size, num_kv_heads, codec.row_data_bytes(head_dim))
    scales = pool[:, data_end:].view(nb, block_size, num_kv_heads, codec.row_scale_bytes(head_dim))
    return data, scales
