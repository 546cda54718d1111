"""`PagedKVConnector`: vLLM instances share pagedkv pages through pagedkv's prefix store.

    --kv-transfer-config '{"kv_connector": "PagedKVConnector",
        "kv_connector_module_path": "pagedkv.integrations.vllm.connector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"store": "disk", "path": "/srv/pagedkv-store"}}'

beside a pagedkv format (`--additional-config '{"pagedkv": {"kv_format": "turbo3"}}'`).
What it does, on vLLM's KV connector API (`vllm/distributed/kv_transfer/kv_connector/v1/base.py`):

- Scheduler: `get_num_new_matched_tokens` looks a new request's prompt up in the store, block
  by block after vLLM's own prefix-cache hit (`fleet.probe`: every rank's pages, intact), and
  offers that many tokens (whole blocks, never the prompt's last token); `update_state_after_alloc`
  records which of the request's new blocks they go to; `build_connector_meta` hands the
  worker this step's loads and the prompt blocks this step completes (to publish).
- Worker: `register_kv_caches` builds the rank's PagedLayers over vLLM's page tensors
  (`impl.page_layers`, the fitted statistics included) and its store keys (`fleet.rank_identity`:
  model, dtype, block size, TP rank); `start_load_kv` writes the stored pages straight into
  the blocks before the forward (synchronous: the step then computes only the rest);
  `wait_for_save` publishes the completed prompt blocks after the forward, as they are.
  A block that fails to load (gone, damaged, store down since the look-up) is reported by
  `get_block_ids_with_load_errors`, and vLLM recomputes from it (the connector sets
  `kv_load_failure_policy` to "recompute": the store is a cache, a fault costs hits only).
- Roles: kv_producer publishes only, kv_consumer loads only, kv_both does both (disaggregated
  prefill through the store: the producer prefills, the consumer loads and decodes).

Refused at engine start, naming what works: an engine without a pagedkv format, more than one
KV-cache group (a recent window's tail: serve the format without `recent_window` to share
pages), pipeline parallelism. Requests with multimodal inputs, LoRA adapters or prompt embeddings
neither look up nor publish (their pages depend on more than the token ids).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorHandshakeMetadata,
                                                               KVConnectorMetadata, KVConnectorRole, SupportsHMA)

from ...alloc.hashing import chain, root_hash
from ...errors import ConfigError
from . import plugin
from .fleet import CHAIN_NAMESPACE, ConnectorSettings, RankKeys, RankPages, model_identity, open_store, probe, rank_identity

log = logging.getLogger("vllm.pagedkv")


@dataclass
class PagedKVHandshake(KVConnectorHandshakeMetadata):
    """A worker rank's store identity and page layout, for the scheduler's look-ups."""

    keys: RankKeys


@dataclass
class PagedKVConnectorMeta(KVConnectorMetadata):
    """One step's work: loads [(block ids, chain keys)] and saves [(block id, chain key)]."""

    loads: list = field(default_factory=list)
    saves: list = field(default_factory=list)


@dataclass
class _Request:
    """Scheduler-side state of a request: its chain keys so far, blocks published so far."""

    request: Any
    chains: list = field(default_factory=list)
    published: Optional[int] = None  # blocks before this index are local hits, loaded or published


def _shareable(request) -> bool:
    return (request.prompt_token_ids is not None and not request.mm_features
            and request.lora_request is None and getattr(request, "prompt_embeds", None) is None)


class PagedKVConnector(KVConnectorBase_V1, SupportsHMA):
    """pagedkv pages in a shared prefix store (see the module docstring)."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = self._kv_transfer_config
        self.settings = ConnectorSettings.parse(cfg.kv_connector_extra_config)
        pk = plugin.required_settings(vllm_config, "pagedkv connector (it moves pagedkv pages)")
        if pk.recent_window is not None:
            raise ConfigError(f"pagedkv connector: the recent window ({pk.recent_window.name}) keeps a "
                              "second KV-cache group that the connector does not carry; share the "
                              "format's pages without the window (drop recent_window / the +r suffix), "
                              "or serve the window without the connector")
        groups = kv_cache_config.kv_cache_groups if kv_cache_config is not None else []
        if len(groups) != 1:
            raise ConfigError(f"pagedkv connector: {len(groups)} KV-cache groups; the connector carries "
                              "one (every layer full attention in a pagedkv format)")
        if vllm_config.parallel_config.pipeline_parallel_size != 1:
            raise ConfigError("pagedkv connector: pipeline_parallel_size "
                              f"{vllm_config.parallel_config.pipeline_parallel_size} is not supported; "
                              "supported: 1 (tensor parallel is: each rank shares its own heads' pages)")
        self.block_size = int(groups[0].kv_cache_spec.block_size)
        self.loads_on = cfg.is_kv_consumer
        self.saves_on = cfg.is_kv_producer
        mc = vllm_config.model_config
        self.model_id = self.settings.model_id or model_identity(mc.model, mc.revision)
        self.stats = {"lookups": 0, "hit_blocks": 0, "load_blocks": 0, "load_failed": 0,
                      "published": 0, "publish_skipped": 0}
        self._warned: set[str] = set()
        if role == KVConnectorRole.SCHEDULER:
            if cfg.kv_load_failure_policy != "recompute":
                log.info("pagedkv connector: kv_load_failure_policy %r -> 'recompute' (the store is a "
                         "cache: a page that cannot be read back is recomputed)", cfg.kv_load_failure_policy)
                cfg.kv_load_failure_policy = "recompute"
            self._ranks: list = []  # (PrefixStore, BlockLayout) per TP rank
            self._requests: dict[str, _Request] = {}
            self._probes: dict[str, tuple] = {}
            self._loads: list = []
        else:
            self._rank: Optional[RankPages] = None
            self._invalid: set[int] = set()
        log.info("pagedkv connector (%s, %s): store %s, model %s", role.name.lower(), cfg.kv_role,
                 self.settings.where, self.model_id)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a later miss

    def _warn_once(self, kind: str, msg: str, *args) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning("pagedkv connector: " + msg, *args)

    # ---- worker ---------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches) -> None:
        from vllm.distributed.parallel_state import (get_tensor_model_parallel_rank,
                                                     get_tensor_model_parallel_world_size)

        from .impl import page_layers

        layers = page_layers(self._vllm_config, kv_caches)
        rank, size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        ident = rank_identity(self.model_id, str(self._vllm_config.model_config.dtype), self.block_size,
                              rank, size)
        self._rank = RankPages(layers, open_store(self.settings, ident), ident)
        log.info("pagedkv connector: rank %d/%d shares %d layers' pages, %d bytes per block (%.1f per token)",
                 rank, size, len(layers), self._rank.page_bytes, self._rank.page_bytes / self.block_size)

    def get_handshake_metadata(self) -> Optional[KVConnectorHandshakeMetadata]:
        return None if self._rank is None else PagedKVHandshake(self._rank.keys)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if self._rank is None or not isinstance(meta, PagedKVConnectorMeta):
            return
        for block_ids, chains in meta.loads:
            try:
                done = self._rank.load(block_ids, chains)
            except Exception as exc:  # never the engine's failure: those blocks are recomputed
                self._warn_once("load", "loading pages failed (%s); recomputing them", exc)
                done = 0
            self.stats["load_blocks"] += done
            if done < len(block_ids):
                self.stats["load_failed"] += len(block_ids) - done
                self._invalid.update(int(b) for b in block_ids[done:])
                self._warn_once("miss", "%d of %d looked-up blocks could not be read back; vLLM "
                                "recomputes them", len(block_ids) - done, len(block_ids))

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are synchronous, before the forward

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return  # whole blocks are published after the forward (wait_for_save)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if self._rank is None or not isinstance(meta, PagedKVConnectorMeta) or not meta.saves:
            return
        try:
            n = self._rank.publish(meta.saves)
        except Exception as exc:  # a full disk, a dead server: later misses, never a failed step
            self._warn_once("save", "publishing pages failed (%s); they stay unshared", exc)
            n = 0
        self.stats["published"] += n
        self.stats["publish_skipped"] += len(meta.saves) - n

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._invalid = self._invalid, set()
        return out

    # ---- scheduler ------------------------------------------------------------------------
    def set_xfer_handshake_metadata(self, metadata: dict) -> None:
        self._ranks = [(open_store(self.settings, m.keys.identity), m.keys.layout)
                       for _, m in sorted(metadata.items()) if isinstance(m, PagedKVHandshake)]

    def _chains(self, state: _Request, n: int) -> list:
        """The request's first n chain keys (extended as its prompt's blocks are needed)."""
        have = state.chains
        if n > len(have):  # `hashing.chain`, the one walk of the chain, from the last key on
            have += chain(root_hash(CHAIN_NAMESPACE, state.request.cache_salt), state.request.prompt_token_ids,
                          self.block_size, have[-1] if have else None, len(have), n)
        return have[:n]

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[Optional[int], bool]:
        bs = self.block_size
        if not self.loads_on or not self._ranks or not _shareable(request) or num_computed_tokens % bs:
            return 0, False
        start, end = num_computed_tokens // bs, (len(request.prompt_token_ids) - 1) // bs
        if end <= start:
            return 0, False
        known = self._probes.get(request.request_id)
        if known is None or known[0] != (start, end):
            state = self._requests.setdefault(request.request_id, _Request(request))
            chains = self._chains(state, end)
            self.stats["lookups"] += 1
            hits = probe(self._ranks, chains[start:end])
            self.stats["hit_blocks"] += hits
            known = ((start, end), hits)
            self._probes[request.request_id] = known
        return known[1] * bs, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        known = self._probes.pop(request.request_id, None)
        state = self._requests.setdefault(request.request_id, _Request(request))
        state.request = request
        if num_external_tokens <= 0 or known is None:
            return
        (start, _), _ = known
        n = num_external_tokens // self.block_size
        ids = blocks.get_block_ids()[0][start:start + n]
        self._loads.append((list(ids), self._chains(state, start + n)[start:]))
        state.published = start + n

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = PagedKVConnectorMeta(loads=self._loads)
        self._loads = []
        if not self.saves_on:
            return meta
        done = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        done.update(zip(cached.req_ids, cached.num_computed_tokens))
        bs = self.block_size
        for rid, computed in done.items():
            state = self._requests.get(rid)
            if state is None or not _shareable(state.request):
                continue
            if state.published is None:
                state.published = computed // bs  # vLLM's own prefix-cache hit: already shared
            full = min(computed + scheduler_output.num_scheduled_tokens.get(rid, 0),
                       len(state.request.prompt_token_ids)) // bs
            if full <= state.published:
                continue
            ids = self._kv_cache_manager.get_block_ids(rid)[0]
            chains = self._chains(state, full)
            meta.saves += [(ids[i], chains[i]) for i in range(state.published, full)]
            state.published = full
        return meta

    def request_finished(self, request, block_ids) -> tuple[bool, Optional[dict]]:
        self._requests.pop(request.request_id, None)
        self._probes.pop(request.request_id, None)
        return False, None

    def request_finished_all_groups(self, request, block_ids) -> tuple[bool, Optional[dict]]:
        return self.request_finished(request, block_ids[0] if block_ids else [])
