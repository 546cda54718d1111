"""The attention implementation vLLM calls per layer: store into pagedkv pages, attend on them.

Life of a layer (all at engine start unless said otherwise):
1. `__init__` (model construction): the settings are parsed and every case pagedkv cannot serve
   is refused with a ConfigError naming the value (ALiBi, encoder / cross attention, a KV cache
   dtype other than "auto", cross-layer KV sharing, an unknown format name, a head_dim the
   format's codecs cannot store).
2. `process_weights_after_loading`: the first layer assigns every pagedkv layer its format
   (pagedkv's CacheConfig: per-layer lists and the high-precision policy) and gives its module
   the per-format backend class, so vLLM sizes each layer's page by its own format.
3. The metadata builder's construction (`prepare_layers`): the statistics of every layer are
   fitted once on the fixed calibration text, or read from a file (`fit.py`).
4. Per step: `do_kv_cache_update` stores the new tokens (`pagedkv.ops.store`) at vLLM's slots;
   `forward` runs `decode_attention` on the decode rows and `prefill_attention` on the rest.
   The step's first layer validates the shared tensors (slots, tables, lengths) through the
   public ops; the other layers of its group call the backend that ran (`store_new`, `attend`).
   With a recent window (`tail.py`) every layer also stores the new tokens in its tail, at the
   tail group's slots, and attends with `ops.recent` through the tail group's tables.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from vllm.config import get_current_vllm_config
from vllm.v1.attention.backend import AttentionImpl, AttentionType

from ... import ops
from ...ops import validate
from ...errors import ConfigError
from ...ops.batch import AttentionParams
from ...cache.calibration import Calibration
from ...ops.dispatch import Op, select_backend
from . import plugin
from .backend import PagedKVMetadata, backend_for
from .fit import FitPlan, describe, fit, for_rank, load, rank_heads
from .layout import layer_formats, paged_layer, tail_layer
from .settings import VllmSettings
from .tail import TailMetadata

log = logging.getLogger("vllm.pagedkv")  # under vLLM's logger: its handlers print it
RECENT_DECODE = "recent_decode"  # `PagedKVMetadata.checked` key: (tail tables given, validated or None, tail_in_kernel)


def _refuse(what: str, value, accepted: str) -> None:
    raise ConfigError(f"pagedkv vLLM backend: {what} {value!r} is not supported; supported: {accepted}")


class PagedKVImpl(AttentionImpl):
    """One attention layer served from pagedkv pages (see the module docstring)."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: Optional[int] = None,
                 alibi_slopes=None, sliding_window: Optional[int] = None, kv_cache_dtype: str = "auto",
                 logits_soft_cap: Optional[float] = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: Optional[str] = None, sinks: Optional[torch.Tensor] = None,
                 **extra) -> None:
        cfg = get_current_vllm_config()
        settings = plugin.required_settings(cfg, "pagedkv vLLM backend selected")
        if alibi_slopes is not None:
            _refuse("ALiBi position bias (alibi_slopes)", "alibi", "RoPE / no position bias")
        if attn_type != AttentionType.DECODER:
            _refuse("attention type", str(getattr(attn_type, "value", attn_type)),
                    "decoder self-attention (no encoder, encoder-only or cross attention)")
        if kv_cache_dtype != "auto":
            _refuse("kv_cache_dtype", kv_cache_dtype, "'auto' (the pagedkv format sets the bytes)")
        if kv_sharing_target_layer_name is not None:
            _refuse("cross-layer KV sharing with", kv_sharing_target_layer_name, "one KV cache per layer")
        unknown = sorted(k for k, v in extra.items() if v is not None and v is not False)
        if unknown:
            _refuse("attention option(s)", ", ".join(unknown), "sliding_window, logits_soft_cap, sinks")
        self.settings: VllmSettings = settings
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.sliding_window = sliding_window
        self.sinks = sinks
        self.soft_cap = float(logits_soft_cap) if logits_soft_cap else None
        self.fmt = None  # KVFormat, assigned with the other layers (assign_formats)
        self.calibration: Optional[Calibration] = None
        self._vllm_config = cfg
        self._paged = None  # (kv_cache data_ptr, PagedLayer)
        self.tail = None  # tail.TailLayer with a recent window (assigned with the formats)
        self._tail_paged = None  # (tail kv_cache data_ptr, PagedLayer)
        self._params: Optional[AttentionParams] = None
        # every format named must store this head_dim (ConfigError now, not at first use)
        # (in a fixed order: the formats named first, then the high-precision one if any is used)
        for fmt in settings.named_formats():
            fmt.check_head_dim(head_size)

    # -- engine start -----------------------------------------------------------------------
    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        assign_formats(self._vllm_config)

    def _attention_params(self) -> AttentionParams:
        if self._params is None:
            sinks = None if self.sinks is None else self.sinks.detach().float().contiguous()
            self._params = self.settings.approx.apply(AttentionParams(
                scale=self.scale, sliding_window=self.sliding_window, soft_cap=self.soft_cap, sinks=sinks))
        return self._params

    def _layer(self, kv_cache: torch.Tensor):
        key = kv_cache.data_ptr()
        if self._paged is None or self._paged[0] != key:
            if self.fmt is None:
                raise ConfigError("pagedkv: a layer ran before the layers' formats were assigned")
            self._paged = (key, paged_layer(kv_cache, self.fmt, self.num_kv_heads, self.head_size, self.calibration))
        return self._paged[1]

    def _tail(self):
        """(tail PagedLayer, this step's TailMetadata) or None (no window, profiling run)."""
        tm = None if self.tail is None or self.tail.kv_cache.numel() == 0 else \
            _step_metadata(self.tail, TailMetadata)
        if tm is None:
            return None
        kv = self.tail.kv_cache
        if self._tail_paged is None or self._tail_paged[0] != kv.data_ptr():
            self._tail_paged = (kv.data_ptr(), tail_layer(kv, self.tail.recent.codec, self.num_kv_heads,
                                                          self.head_size, self.calibration))
        return self._tail_paged[1], tm

    # -- per step ---------------------------------------------------------------------------
    def do_kv_cache_update(self, layer, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        if kv_cache.numel() == 0:
            return
        store_new(self._layer(kv_cache), key, value, slot_mapping, _step_metadata(layer),
                  backend=self.settings.backend, checks=self.settings.checks)
        tail = self._tail()
        if tail is not None:
            store_new(tail[0], key, value, tail[1].slot_mapping, tail[1],
                      backend=self.settings.backend, checks=self.settings.checks)

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: Optional[PagedKVMetadata], output: torch.Tensor,
                output_scale=None, output_block_scale=None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("pagedkv vLLM backend: fused output quantization is not supported")
        if attn_metadata is None:  # profiling run
            return output
        q = query.view(-1, self.num_heads, self.head_size)
        out = output.view(-1, self.num_heads, self.head_size)
        tail = self._tail()
        if tail is not None:
            attend_recent(self._layer(kv_cache), tail[0], tail[1].block_tables, self.tail.recent,
                          self._attention_params(), q, out, attn_metadata, checks=self.settings.checks)
            return output
        attend(self._layer(kv_cache), self._attention_params(), q, out, attn_metadata,
               backend=self.settings.backend, checks=self.settings.checks)
        return output


def _step_metadata(layer, kind: type = PagedKVMetadata):
    """This step's metadata of the layer's attention group (vLLM's forward context) if a `kind`, else None."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    md = get_forward_context().attn_metadata
    m = md.get(getattr(layer, "layer_name", None)) if isinstance(md, dict) else md
    return m if isinstance(m, kind) else None


def store_new(paged, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
              m: Optional[PagedKVMetadata] = None, *, backend=None, checks: bool = False) -> None:
    """Store the step's new keys / values [>= T, H, D] at vLLM's T slots (one layer).

    Validated once per step, like `attend`: the first layer given this step's slot tensor runs
    the public op (slots checked against the page), the group's other layers, handed the same
    tensor, call the backend that ran. Without the step's metadata `m` every call validates."""
    t = slot_mapping.shape[0]
    slots = slot_mapping if slot_mapping.dtype == torch.int64 else slot_mapping.long()
    k, v = key[:t], value[:t]
    seen = None if (checks or m is None) else m.checked.get(Op.STORE)
    if seen is not None and seen[0] is slot_mapping:
        if paged.device.type == "cpu":  # as ops.store: NaN/Inf refused before any write
            validate.check_store_finite(k, v, slots)
        seen[1].store(paged, k, v, slots)
        return
    ops.store(paged, k, v, slots, backend=backend, checks=checks)
    if m is not None:
        m.checked[Op.STORE] = (slot_mapping, select_backend(Op.STORE, paged.device, paged, None, backend))


def attend(paged, params: AttentionParams, q: torch.Tensor, out: torch.Tensor, m: PagedKVMetadata, *,
           backend=None, checks: bool = False) -> None:
    """One layer's attention for the step: decode rows on the decode op, the rest on the varlen
    prefill op; q and out [>= num_actual_tokens, Hq, D], out written in place.

    The step's first layer goes through the public ops (which validate the tables, lengths and
    query offsets against the page) and records the backend that ran in `m.checked`; every
    other layer of the attention group shares those tensors and the page geometry (one format,
    one block count), so it calls that backend directly. With `checks` every layer validates."""
    n, nd = m.num_actual_tokens, m.num_decodes
    if nd:
        out[:nd] = _once(m, ops.decode_attention, Op.DECODE, backend, checks,
                         q[:nd], paged, m.decode_block_tables, m.decode_seq_lens, params)
    if n > nd:
        out[nd:n] = _once(m, ops.prefill_attention, Op.PREFILL, backend, checks, q[nd:n], paged,
                          m.prefill_block_tables, m.prefill_seq_lens, m.prefill_query_start, params)


def _once(m: PagedKVMetadata, public, op: Op, backend, checks: bool, *args) -> torch.Tensor:
    """`public(q, paged, ..., params)` (an attention op of `pagedkv.ops`: it validates) for the
    step's first layer, which records the backend that ran in `m.checked`; that backend's method
    of the same name for the others (every layer validates with `checks`)."""
    run = None if checks else m.checked.get(op)
    if run is not None:
        return getattr(run, public.__name__)(*args)
    res = public(*args, backend=backend, checks=checks)
    m.checked[op] = select_backend(op, args[1].device, args[1], args[-1], backend)
    return res


def attend_recent(paged, tail, tail_tables: torch.Tensor, recent, params: AttentionParams, q: torch.Tensor,
                  out: torch.Tensor, m: PagedKVMetadata, *, checks: bool = False) -> None:
    """`attend` with the recent window: keys p - R < j <= p read from the tail (through the tail
    group's tables, rows in the step's order: decodes first), older keys from the pages."""
    from ...ops.recent import prepare_split_decode, recent_decode_attention, recent_prefill_attention
    from ...ops.recent_decode import split_rows, tail_in_kernel

    n, nd = m.num_actual_tokens, m.num_decodes
    kw = dict(recent=recent.tokens, sinks=recent.sinks, checks=checks)
    if nd:
        # validated once per step, as `attend`: the step's first layer checks the tables and
        # records the tail tables it reads through (None: the split does not apply, the public op
        # runs); the group's other layers (the same tables, one format) reuse the record. With
        # `checks` every layer validates.
        q_dec, tables, lens = q[:nd], m.decode_block_tables, m.decode_seq_lens
        seen = None if checks else m.checked.get(RECENT_DECODE)
        if seen is None or seen[0] is not tail_tables:
            ready = prepare_split_decode(q_dec, paged, tail, tables, lens, params, tail_block_tables=tail_tables[:nd],
                                         **kw)
            seen = (tail_tables, ready, None if ready is None else tail_in_kernel(tail, params))
            m.checked[RECENT_DECODE] = seen
        if seen[1] is None:
            out[:nd] = recent_decode_attention(q_dec, paged, tail, tables, lens, params,
                                               tail_block_tables=tail_tables[:nd], **kw)
        else:
            out[:nd] = split_rows(q_dec, paged, tail, tables, lens, seen[1], params, recent.tokens, recent.sinks,
                                  seen[2])
    if n > nd:
        out[nd:n] = recent_prefill_attention(q[nd:n], paged, tail, m.prefill_block_tables, m.prefill_seq_lens,
                                             m.prefill_query_start, params, tail_block_tables=tail_tables[nd:],
                                             **kw)


def _pagedkv_layers(vllm_config) -> list[tuple[str, torch.nn.Module]]:
    """The (name, module) of every layer served by pagedkv, in model order."""
    from vllm.model_executor.models.utils import extract_layer_index

    ctx = vllm_config.compilation_config.static_forward_context
    found = [(name, mod) for name, mod in ctx.items() if isinstance(getattr(mod, "impl", None), PagedKVImpl)]
    return sorted(found, key=lambda item: (extract_layer_index(item[0]), item[0]))


def assign_formats(vllm_config) -> None:
    """Give every pagedkv layer its format and its module the per-format backend (once)."""
    layers = _pagedkv_layers(vllm_config)
    if not layers or all(mod.impl.fmt is not None for _, mod in layers):
        return
    s = layers[0][1].impl.settings
    dims = [(mod.impl.num_kv_heads, mod.impl.head_size) for _, mod in layers]
    formats = layer_formats(s.kv_format, s.high_precision_layers, s.hp_format, len(layers), dims)
    for (name, mod), fmt in zip(layers, formats):
        mod.impl.fmt = fmt
        mod.attn_backend = backend_for(fmt.name)
    if s.recent_window is not None:
        from .tail import add_tails

        for (_, mod), tail in zip(layers, add_tails(vllm_config, layers, s.recent_window)):
            mod.impl.tail = tail
    names = sorted({f.name for f in formats})
    log.info("pagedkv: %d attention layers in %s (formats: %s)", len(layers), s.label, ", ".join(names))


def prepare_layers(vllm_config) -> None:
    """Fix every pagedkv layer's statistics once: fitted on the calibration text (or read from
    the settings' file); called when vLLM builds the metadata builders, before any request."""
    assign_formats(vllm_config)
    layers = _pagedkv_layers(vllm_config)
    impls = [mod.impl for _, mod in layers]
    if not impls or all(i.calibration is not None for i in impls):
        return
    s = impls[0].settings
    has_sinks = [i.sinks is not None for i in impls]
    plan = FitPlan.build([i.fmt for i in impls], s.key_centring, s.value_centring, s.key_scaling, has_sinks)
    geometry = [(_whole_model_heads(vllm_config, i), i.head_size) for i in impls]  # the fit's, not a rank's
    if s.calibration is not None:
        cals = load(s.calibration, len(impls), geometry)
    elif plan.needed:
        cals = fit(vllm_config.model_config.model, plan, s.calibration_tokens, s.cache_dir, geometry)
    else:
        cals = [Calibration() for _ in impls]
    cals = _rank_statistics(vllm_config, cals)
    for impl, cal in zip(impls, cals):
        impl.calibration = cal
        impl._paged = impl._tail_paged = None
    log.info("pagedkv: statistics per layer %s", describe(cals))


def _whole_model_heads(vllm_config, impl) -> int:
    tp = vllm_config.parallel_config.tensor_parallel_size
    return impl.num_kv_heads if tp <= 1 else vllm_config.model_config.get_total_num_kv_heads()


def _rank_statistics(vllm_config, cals: list) -> list:
    """Under tensor parallelism each rank keeps the statistics of the KV heads it holds
    (`fit.rank_heads`: vLLM's split); the fit itself is the whole model's, as with one rank."""
    tp = vllm_config.parallel_config.tensor_parallel_size
    if tp <= 1:
        return cals
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    heads = rank_heads(vllm_config.model_config.get_total_num_kv_heads(), tp, get_tensor_model_parallel_rank())
    return [for_rank(c, heads) for c in cals]


def page_layers(vllm_config, kv_caches: dict) -> list:
    """Every pagedkv layer's PagedLayer over its vLLM page tensor in `kv_caches` (layer name ->
    tensor), in model order, with the engine's fitted statistics: what the KV connector
    (`connector.py`) reads and writes."""
    prepare_layers(vllm_config)
    return [mod.impl._layer(kv_caches[name]) for name, mod in _pagedkv_layers(vllm_config)]
