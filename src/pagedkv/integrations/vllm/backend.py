"""The vLLM attention backend: pages of pagedkv bytes, metadata split into decodes and prefills.

`PagedKVBackend` is what vLLM resolves (on CPU as the override of CPU_ATTN, on CUDA as CUSTOM;
see `plugin.py`). Every layer's page is sized by its own format (`customize_spec`: uint8 cells
of `layout.content_bytes`), so each layer's module gets a per-format subclass
(`backend_for`) once the layers know their formats; layers of one format share one attention
group and one metadata build per step.

The metadata builder reorders decodes first (`reorder_batch_threshold = 1`) and splits the batch
once per step: decode rows (one query each) go to `pagedkv.ops.decode_attention`, the rest
(prefill chunks, varlen, bottom-right causal) to `pagedkv.ops.prefill_attention`.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

import torch
from vllm.v1.attention.backend import (AttentionBackend, AttentionMetadataBuilder, AttentionType,
                                       CommonAttentionMetadata, MultipleOf)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from ...errors import ConfigError
from ...formats import parse_format
from .layout import content_bytes


@dataclass
class PagedKVMetadata:
    """One step's batch for every layer of an attention group (int32 tables and lengths).

    Rows 0..num_decodes-1 are decodes (one query each, tokens 0..num_decodes-1); the prefill
    rows follow, their queries at tokens num_decodes.. with prefill_query_start from 0.
    `checked`: filled by the step's first layer (`impl.attend`): the ops backend that validated
    these tensors, per op (with a recent window, `impl.attend_recent`: the tail tables it
    validated); the group's other layers (same tensors, same page geometry) then call it directly
    instead of validating the same tables again.
    """

    num_actual_tokens: int
    num_decodes: int
    decode_block_tables: torch.Tensor
    decode_seq_lens: torch.Tensor
    prefill_block_tables: torch.Tensor
    prefill_seq_lens: torch.Tensor
    prefill_query_start: torch.Tensor
    checked: dict[Any, Any] = field(default_factory=dict)


class PagedKVMetadataBuilder(AttentionMetadataBuilder[PagedKVMetadata]):
    """Builds `PagedKVMetadata` once per step and group; fits the engine's statistics once."""

    reorder_batch_threshold: int | None = 1

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=False)
        from .impl import prepare_layers

        prepare_layers(vllm_config)  # statistics fixed at engine start, before any request

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> PagedKVMetadata:
        m = common_attn_metadata
        nd, _, nd_tokens, _ = split_decodes_and_prefills(m, decode_threshold=1)
        assert nd == nd_tokens, "decode rows carry one query each"
        n = m.num_reqs
        return split_rows(m.query_start_loc[:n + 1], m.seq_lens[:n], m.block_table_tensor[:n],
                          int(nd), int(m.num_actual_tokens))


def split_rows(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
               num_decodes: int, num_actual_tokens: int) -> PagedKVMetadata:
    """The step's metadata from vLLM's tensors (decodes first): int32, contiguous, split once,
    so that no layer converts or checks them again (every layer of the group reuses them)."""
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    nd = num_decodes
    prefill_qsl = query_start_loc[nd:]
    prefill_qsl = (prefill_qsl - prefill_qsl[0]).to(torch.int32).contiguous()
    return PagedKVMetadata(
        num_actual_tokens=num_actual_tokens, num_decodes=nd,
        decode_block_tables=tables[:nd], decode_seq_lens=lens[:nd],
        prefill_block_tables=tables[nd:], prefill_seq_lens=lens[nd:],
        prefill_query_start=prefill_qsl,
    )


class PagedKVBackend(AttentionBackend):
    """pagedkv pages and ops inside vLLM (the per-format subclasses set `kv_format`)."""

    kv_format: ClassVar[Optional[str]] = None
    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"  # must name an AttentionBackendEnum member

    @staticmethod
    def get_impl_cls():
        from .impl import PagedKVImpl

        return PagedKVImpl

    @staticmethod
    def get_builder_cls():
        return PagedKVMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None):
        return [MultipleOf(1)]  # one vLLM block = one pagedkv block, any size

    @classmethod
    def supported_kv_cache_layouts(cls):
        return (KVCacheLayout.LBHNC, KVCacheLayout.BLHNC)  # block-contiguous pages

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        if cls.kv_format is None:
            raise ConfigError("pagedkv: a layer's KV cache was sized before its format was assigned "
                              "(the model did not run process_weights_after_loading)")
        fmt = parse_format(cls.kv_format)
        if spec.head_size_v != spec.head_size:
            raise ConfigError(f"pagedkv: different K and V head sizes ({spec.head_size}, {spec.head_size_v}) "
                              "are not supported")
        return dataclasses.replace(spec, dtype=torch.uint8, state_content_bytes=content_bytes(fmt, spec.head_size))


def backend_for(kv_format: str) -> type[PagedKVBackend]:
    """The PagedKVBackend subclass of one format (created once, importable by its name)."""
    name = "PagedKVBackend_" + "".join(ch if ch.isalnum() else "_" for ch in kv_format)
    module = sys.modules[__name__]
    cls = getattr(module, name, None)
    if cls is None:
        cls = type(name, (PagedKVBackend,), {"kv_format": kv_format, "__module__": __name__,
                                              "__qualname__": name})
        setattr(module, name, cls)
    return cls
