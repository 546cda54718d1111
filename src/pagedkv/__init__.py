"""pagedkv: paged, compressed KV cache with attention on the compressed pages."""
