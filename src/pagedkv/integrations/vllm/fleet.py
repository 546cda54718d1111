"""pagedkv pages shared by vLLM instances through pagedkv's prefix store (no vLLM import here).

`connector.py` is the vLLM side (the KV connector API); this module is what it does with pages:

- `ConnectorSettings`: the connector's `kv_connector_extra_config`, parsed once (keys below).
- `rank_identity`: what a store key binds beyond the page layout: the model identity
  (`model_identity`: config.json and a sample of every weight file, or the operator's
  `model_id`), the activation dtype, the block size and the tensor-parallel rank and size (a
  rank's pages hold its own KV heads). The page layout (`record.BlockLayout`: every layer's
  codecs, codebooks, dims, fp8 scales and fitted statistics) and the namespace are bound by
  `StoreKeys` itself, so instances whose format, plan or statistics differ never share a key.
- `RankPages`: one worker rank's pages (PagedLayers over vLLM's page tensors) and its store:
  `load` writes stored pages straight into vLLM blocks, `publish` stores full blocks as they
  are (the record carries the page bytes unchanged: no re-encoding).
- `probe`: the scheduler's look-up, how many leading blocks of a prompt every rank finds.

Settings (`kv_connector_extra_config`):
    store: "disk" (default) or "redis"
    path: the disk store's directory (required for disk; every instance names the same one)
    redis_url: e.g. "redis://127.0.0.1:6379/0" (required for redis)
    store_secret_file: a file holding the operator's secret (>= 16 bytes; required for redis,
        a disk store without one uses the directory's generated `.secret`)
    namespace: key namespace, [0-9A-Za-z_-] (a tenant; a subfolder / a Redis key prefix)
    model_id: pins the model identity by name (default: derived from the model's files)
    limit_bytes: the disk store's size (LRU), default 4 GiB
    redis_timeout_s, redis_retry_after_s, redis_ttl_s: the Redis tier's (see offload.config)
The trust model is the prefix store's (`offload/keys.py`): keyed store keys and sealed records;
a damaged, truncated or forged entry is a miss and is deleted so the next publish replaces it.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from ...errors import ConfigError
from ...offload import OffloadConfig, PrefixStore, StoreKeys
from ...offload.config import redact_url
from ...offload.record import BlockLayout, write_block
from ...offload.store import make_prefix_tier, store_secret
from ...ops.batch import PagedLayer

CHAIN_NAMESPACE = b"pagedkv-vllm-connector-v1"
_KEYS = ("store", "path", "redis_url", "store_secret_file", "namespace", "model_id", "limit_bytes",
         "redis_timeout_s", "redis_retry_after_s", "redis_ttl_s")
SAMPLES_PER_FILE = 16
SAMPLE_BYTES = 4096


@dataclass(frozen=True)
class ConnectorSettings:
    """The connector's store, parsed from `kv_connector_extra_config` (see the module docstring)."""

    offload: OffloadConfig
    model_id: Optional[str] = None

    @staticmethod
    def parse(extra: Optional[Mapping]) -> "ConnectorSettings":
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(_KEYS))
        if unknown:
            raise ConfigError(f"pagedkv connector: unknown kv_connector_extra_config key(s) "
                              f"{', '.join(unknown)}; accepted: {', '.join(_KEYS)}")
        kind = extra.get("store", "disk")
        if kind not in ("disk", "redis"):
            raise ConfigError(f"pagedkv connector: store must be 'disk' or 'redis', got {kind!r}")
        if kind == "disk" and not extra.get("path"):
            raise ConfigError("pagedkv connector: a disk store needs \"path\": the directory every "
                              "instance sharing the store names")
        if kind == "redis" and not extra.get("redis_url"):
            raise ConfigError("pagedkv connector: a redis store needs \"redis_url\" "
                              "(e.g. redis://127.0.0.1:6379/0)")
        secret = None
        if extra.get("store_secret_file"):
            path = str(extra["store_secret_file"])
            try:
                with open(path, "rb") as f:
                    secret = f.read().strip()
            except OSError as exc:
                raise ConfigError(f"pagedkv connector: store_secret_file {path!r} cannot be read "
                                  f"({exc})") from None
        elif kind == "redis":
            raise ConfigError("pagedkv connector: a redis store needs \"store_secret_file\": a file "
                              "with a secret of at least 16 bytes that every instance reads "
                              "(e.g. python -c 'import secrets; print(secrets.token_hex(32))' > F)")
        model_id = extra.get("model_id")
        if model_id is not None and (not isinstance(model_id, str) or not model_id):
            raise ConfigError(f"pagedkv connector: model_id must be a non-empty string, got {model_id!r}")
        kw = {k: extra[k] for k in ("redis_url", "redis_timeout_s", "redis_retry_after_s", "redis_ttl_s")
              if k in extra}
        offload = OffloadConfig(prefix_store=kind, prefix_dir=extra.get("path"), store_secret=secret,
                                store_namespace=extra.get("namespace", ""),
                                prefix_limit_bytes=extra.get("limit_bytes", 4 << 30), **kw)
        return ConnectorSettings(offload, model_id)

    @property
    def where(self) -> str:
        o = self.offload
        return f"redis {redact_url(o.redis_url)}" if o.prefix_store == "redis" else f"disk {o.prefix_path()}"


def model_identity(model: str, revision: Optional[str] = None) -> str:
    """A name for the exact weights: for a model folder, a hash of config.json and of every
    weight file's name, size and SAMPLES_PER_FILE evenly spaced samples (wherever the folder
    lives: two machines with the same files agree); else the model's name and revision."""
    if not os.path.isdir(model):
        return f"name:{model}@{revision or 'default'}"
    h = hashlib.blake2b(digest_size=16, person=b"pagedkv-modelid")
    for name in sorted(os.listdir(model)):
        path = os.path.join(model, name)
        if name == "config.json":
            with open(path, "rb") as f:
                h.update(b"config|" + f.read())
        elif name.endswith((".safetensors", ".bin", ".pt", ".gguf")):
            size = os.path.getsize(path)
            h.update(f"|{name}|{size}|".encode())
            with open(path, "rb") as f:
                for i in range(SAMPLES_PER_FILE):
                    f.seek(max(0, size - SAMPLE_BYTES) * i // max(1, SAMPLES_PER_FILE - 1))
                    h.update(f.read(SAMPLE_BYTES))
    return "files:" + h.hexdigest()


def rank_identity(model_id: str, dtype: str, block_size: int, tp_rank: int, tp_size: int) -> bytes:
    """16 bytes every store key of one worker rank binds (besides its page layout)."""
    h = hashlib.blake2b(digest_size=16, person=b"pagedkv-vllmrank")
    h.update(f"{model_id}|{dtype}|{block_size}|tp{tp_rank}/{tp_size}".encode())
    return h.digest()


@dataclass(frozen=True)
class RankKeys:
    """What the scheduler needs of one rank to look its pages up (the handshake's content)."""

    identity: bytes
    layout: BlockLayout


def open_store(settings: ConnectorSettings, identity: bytes) -> PrefixStore:
    """The prefix store of one rank: the tier the settings name, keys from the secret, the
    rank's identity and the namespace."""
    tier = make_prefix_tier(settings.offload)
    keys = StoreKeys(store_secret(settings.offload, tier), identity, settings.offload.store_namespace)
    return PrefixStore(tier, keys)


def probe(stores: Sequence[tuple[PrefixStore, BlockLayout]], chains: Sequence[bytes]) -> int:
    """How many leading blocks of `chains` every rank's store holds intact (a damaged entry
    ends the hit and is deleted). Never raises for tier faults."""
    n = len(chains)
    for store, layout in stores:
        found = 0
        for sections in store.fetch(layout, list(chains[:n])):
            if sections is None:
                break
            found += 1
        n = min(n, found)
        if n == 0:
            break
    return n


class RankPages:
    """One worker rank's pages (every pagedkv layer, in model order) and its store."""

    def __init__(self, layers: Sequence[PagedLayer], store: PrefixStore, identity: bytes):
        self.layers = list(layers)
        self.layout = BlockLayout.from_layers(self.layers)
        self.store = store
        self.keys = RankKeys(identity, self.layout)

    @property
    def page_bytes(self) -> int:
        """Bytes of one block over every layer, K and V: what a record carries."""
        return self.layout.block_bytes

    def load(self, block_ids: Sequence[int], chains: Sequence[bytes]) -> int:
        """Write the stored pages of `chains` into vLLM blocks `block_ids` (in order) until the
        first miss; returns how many blocks were written."""
        done = 0
        for block, sections in zip(block_ids, self.store.fetch(self.layout, list(chains))):
            if sections is None:
                break
            write_block(self.layers, int(block), sections)
            done += 1
        return done

    def publish(self, blocks: Sequence[tuple[int, bytes]]) -> int:
        """Store (vLLM block id, chain key) pairs not stored yet; returns how many were stored."""
        return self.store.publish_many(self.layers, self.layout, [(int(b), c) for b, c in blocks])
