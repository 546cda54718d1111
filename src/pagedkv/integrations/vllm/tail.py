"""The high-precision recent window in vLLM: every pagedkv layer's tail is a second KV-cache group.

`pagedkv.ops.recent` reads the last R keys of each query from a tail (the window's codec, e.g.
q8_0, on both sides) and older keys from the format's pages, in one softmax. In vLLM the tail of
layer L is a module of its own, `TailLayer` (registered in the forward context as
`L.pagedkv_tail`), whose KV-cache spec is vLLM's `SlidingWindowSpec` of window R. vLLM's hybrid
KV-cache manager then gives the tails their own block group: its sliding-window manager frees a
tail block once no query can see it (only the blocks covering the last R positions stay
allocated), and a prefix-cache hit needs the window's tail blocks cached as well (vLLM
reconciles the hit over both groups), so a hit is exact.

Pricing: vLLM draws every group's blocks from one pool whose block is as large as the widest
group's (the bytes of every layer's page of one block). `tail_block_size` picks the largest
tail block (a power-of-two divisor of the page block) whose 30-layer (all-layer) tail still fits
in that block, so the tail never widens a page block; each tail block then costs one pool block,
and a sequence holds cdiv(R - 1, bt) + 1 of them at most (plus those of a prefill chunk in
flight). The capacity vLLM reports is the pool's, in page blocks.

Attention sinks (`RecentWindow(sinks=S)`, the first S positions read from the tail too) need a
group that keeps each sequence's first blocks beside its window: `SinkWindowSpec` (a
SlidingWindowSpec with `sink_blocks`) and its manager `SinkWindowManager` (vLLM's sliding-window
manager that never frees a sequence's first sink blocks, counts them in admission, and reports a
prefix hit only when they are cached too), registered through the platform's
`register_custom_kv_cache_specs` hook (`plugin.py`); without sinks the tail is vLLM's own
SlidingWindowSpec and manager.

The metadata builder of the tail group hands each step's tail block tables and slots to the
layer's implementation (`impl.py`), which stores each new token in both and attends with
`ops.recent` (`tail_block_tables=`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional, Sequence

import torch
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.attention.backend import AttentionBackend, AttentionMetadataBuilder, CommonAttentionMetadata
from vllm.utils.math_utils import cdiv
from vllm.v1.core.kv_cache_utils import resolve_block_hashes
from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager
from vllm.v1.kv_cache_interface import KVCacheLayout, SlidingWindowSpec

from ...formats import KVFormat
from ...spec import RecentWindow
from .layout import content_bytes, page_bytes

TAIL_SUFFIX = ".pagedkv_tail"
MIN_TAIL_BLOCK = 16


def tail_format(recent: RecentWindow) -> KVFormat:
    """The tail's page format: the window's codec on both sides."""
    return KVFormat(recent.codec, recent.codec)


def tail_block_size(recent: RecentWindow, formats: Sequence[KVFormat], dims: Sequence[tuple[int, int]],
                    block_size: int) -> int:
    """The tail group's block size: the largest bt = block_size / 2^k >= 16 whose tails of every
    layer fit in the pages of one block of every layer (so the pool block stays the pages'
    size), else the smallest such bt."""
    pages = sum(page_bytes(f, block_size, h, d) for f, (h, d) in zip(formats, dims))
    tf = tail_format(recent)
    bt = block_size
    while bt > MIN_TAIL_BLOCK and bt % 2 == 0 and sum(page_bytes(tf, bt, h, d) for h, d in dims) > pages:
        bt //= 2
    return bt


@dataclass(frozen=True, kw_only=True)
class SinkWindowSpec(SlidingWindowSpec):
    """vLLM's sliding-window spec whose group also keeps each sequence's first `sink_blocks`
    blocks (the attention sinks of the recent window)."""

    sink_blocks: int = 0

    def max_admission_blocks_per_request(self, max_in_flight_tokens: int, max_model_len: int) -> int:
        return super().max_admission_blocks_per_request(max_in_flight_tokens, max_model_len) + self.sink_blocks

    def is_uniform_with_collection(self, kv_cache_specs) -> bool:
        return super().is_uniform_with_collection(kv_cache_specs) and all(
            getattr(s, "sink_blocks", 0) == self.sink_blocks for s in kv_cache_specs.values())


class SinkWindowManager(SlidingWindowManager):
    """SlidingWindowManager keeping blocks 0 .. sink_blocks - 1 of every sequence (see the module
    docstring): freed with the sequence, reused from the prefix cache only when cached."""

    def __init__(self, kv_cache_spec: SinkWindowSpec, **kwargs) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        self.keep = kv_cache_spec.sink_blocks

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: Optional[int] = None) -> None:
        blocks = self.req_to_blocks.get(request_id)
        if blocks:
            skipped = self.get_num_skipped_tokens(processed_computed_tokens) // self.block_size
            self._remove_blocks_in_range(request_id, self.keep, min(skipped, len(blocks)))

    def _sink_hits(self, new_computed_blocks, computed_tokens: int) -> int:
        """How many of a prefix hit's first blocks the base class would skip that are sinks."""
        skipped = self.get_num_skipped_tokens(computed_tokens) // self.block_size
        return min(self.keep, skipped, len(new_computed_blocks))

    def get_num_blocks_to_allocate(self, request_id, num_tokens, new_computed_blocks, total_computed_tokens,
                                   num_local_computed_tokens, num_tokens_main_model, **kwargs) -> int:
        n = super().get_num_blocks_to_allocate(request_id, num_tokens, new_computed_blocks, total_computed_tokens,
                                               num_local_computed_tokens, num_tokens_main_model, **kwargs)
        if request_id in self.num_cached_block:
            return n
        sinks = new_computed_blocks[:self._sink_hits(new_computed_blocks, total_computed_tokens)]
        return n + self._get_num_evictable_blocks(sinks)  # touched below, out of the free queue

    def add_local_computed_blocks(self, request_id, new_computed_blocks, num_local_computed_tokens,
                                  num_external_computed_tokens) -> None:
        keep = self._sink_hits(new_computed_blocks, num_local_computed_tokens + num_external_computed_tokens)
        super().add_local_computed_blocks(request_id, new_computed_blocks, num_local_computed_tokens,
                                          num_external_computed_tokens)
        if keep:  # the base class padded the skipped blocks, sinks included, with nulls
            sinks = list(new_computed_blocks[:keep])
            if self.enable_caching:
                self.block_pool.touch(sinks)
            self.req_to_blocks[request_id][:keep] = sinks

    @classmethod
    def find_longest_cache_hit(cls, block_hashes, max_length, kv_cache_group_ids, block_pool, kv_cache_spec,
                               drop_eagle_block, alignment_tokens, dcp_world_size=1, pcp_world_size=1):
        computed, length = super().find_longest_cache_hit(
            block_hashes, max_length, kv_cache_group_ids, block_pool, kv_cache_spec, drop_eagle_block,
            alignment_tokens, dcp_world_size, pcp_world_size)
        keep = min(kv_cache_spec.sink_blocks, len(computed[0]))
        if not keep or all(not c.is_null for c in computed[0][:keep]):
            return computed, length
        hashes = resolve_block_hashes(block_hashes, block_pool.hash_block_size, kv_cache_spec.block_size,
                                      supports_fine_grained_hash_lookup=cls.supports_fine_grained_hash_lookup,
                                      alignment_tokens=alignment_tokens)
        for i in range(keep):
            if computed[0][i].is_null:
                cached = block_pool.get_cached_block(hashes[i], kv_cache_group_ids)
                if not cached:  # the sinks were evicted: no hit (their K/V would be missing)
                    return tuple([] for _ in computed), 0
                for blocks, block in zip(computed, cached):
                    blocks[i] = block
        return computed, length

    @classmethod
    def reachable_block_mask(cls, start_block, end_block, alignment_tokens, kv_cache_spec, use_eagle, *args,
                             **kwargs):
        mask = super().reachable_block_mask(start_block, end_block, alignment_tokens, kv_cache_spec, use_eagle,
                                            *args, **kwargs)
        if mask is not None:  # the sink blocks serve every later hit: always cached
            for i in range(start_block, min(end_block, kv_cache_spec.sink_blocks)):
                mask[i - start_block] = True
        return mask


def register_specs() -> None:
    """Register SinkWindowSpec with its manager (idempotent; vLLM's registry hook calls it)."""
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    KVCacheSpecRegistry.register(SinkWindowSpec, SinkWindowManager, uniform_type_base_spec=SinkWindowSpec)


@dataclass
class TailMetadata:
    """One step's tail tables (int32 [B, max_blocks], rows in the batch's order: decodes first)
    and the tail slots of the step's new tokens (int64 [T]); `checked` as in PagedKVMetadata."""

    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    checked: dict[Any, Any] = field(default_factory=dict)


class TailMetadataBuilder(AttentionMetadataBuilder[TailMetadata]):
    """The tail group's metadata: its block tables and slots, converted once per step."""

    # vLLM 0.32 declares AttentionMetadataBuilder.__init__ abstract: a subclass must define one.
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> TailMetadata:
        m = common_attn_metadata
        n = m.num_reqs
        return TailMetadata(block_tables=m.block_table_tensor[:n].to(torch.int32).contiguous(),
                            slot_mapping=m.slot_mapping[:m.num_actual_tokens].long())


class TailBackend(AttentionBackend):
    """The tail group's backend: no attention of its own (the page layer's impl reads the tail)."""

    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls():
        raise NotImplementedError("a pagedkv tail has no attention implementation of its own")

    @staticmethod
    def get_builder_cls():
        return TailMetadataBuilder

    @classmethod
    def supported_kv_cache_layouts(cls):
        return (KVCacheLayout.BLHNC, KVCacheLayout.LBHNC)


class TailLayer(torch.nn.Module, AttentionLayerBase):
    """The KV-cache side of one layer's tail: vLLM allocates its pages (a sliding-window group of
    window R) and binds them here (`kv_cache`); it is never called as a module."""

    def __init__(self, name: str, recent: RecentWindow, num_kv_heads: int, head_size: int,
                 block_size: int) -> None:
        super().__init__()
        self.layer_name = name
        self.recent = recent
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.block_size = block_size
        self.kv_cache = torch.tensor([])

    def get_attn_backend(self) -> type[AttentionBackend]:
        return TailBackend

    def get_kv_cache_spec(self, vllm_config) -> SlidingWindowSpec:
        kw = dict(block_size=self.block_size, num_kv_heads=self.num_kv_heads, head_size=self.head_size,
                  dtype=torch.uint8, sliding_window=self.recent.tokens,
                  state_content_bytes=content_bytes(tail_format(self.recent), self.head_size))
        if self.recent.sinks:
            return SinkWindowSpec(sink_blocks=cdiv(self.recent.sinks, self.block_size), **kw)
        return SlidingWindowSpec(**kw)


def add_tails(vllm_config, layers, recent: RecentWindow) -> list[TailLayer]:
    """Create and register (in the forward context) the tail of every (name, module) page layer."""
    impls = [mod.impl for _, mod in layers]
    dims = [(i.num_kv_heads, i.head_size) for i in impls]
    tail_format(recent).check_head_dim(dims[0][1])
    bt = tail_block_size(recent, [i.fmt for i in impls], dims, vllm_config.cache_config.block_size)
    ctx = vllm_config.compilation_config.static_forward_context
    tails = []
    for (name, _), (h, d) in zip(layers, dims):
        tail = ctx.get(name + TAIL_SUFFIX)
        if not isinstance(tail, TailLayer):
            tail = TailLayer(name + TAIL_SUFFIX, recent, h, d, bt)
            ctx[tail.layer_name] = tail
        tails.append(tail)
    return tails
