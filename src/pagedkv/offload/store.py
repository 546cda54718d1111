"""Opening a shared prefix store from the configs: the tier, its secret, identity and namespace.

`open_prefix_store(cache_config, offload, tier=None)` is what a cache calls once: it refuses to
start without a model identity (`identity.require_model_id`), builds the tier `offload` names
(a disk directory, `<prefix_dir>/<namespace>`, or a Redis server with keys under
`redis_prefix + namespace + ":"`) unless `tier` is given, and derives the store keys from the
operator's secret (`keys.py`): `store_secret`, else for a disk store the directory's generated
secret file, else (a tier only this process reaches) a per-process secret. A remote tier without
`store_secret` is a ConfigError: its keys would be computable by anyone who reads the server.
"""

from __future__ import annotations

from typing import Optional

from ..errors import ConfigError
from .config import OffloadConfig, redact_url
from .disk import DiskTier
from .identity import CacheIdentity, store_identity
from .keys import StoreKeys, disk_secret, process_secret, secret_bytes
from .prefix import PrefixStore
from .tiers import Tier


def make_prefix_tier(offload: OffloadConfig) -> Optional[Tier]:
    """The tier `offload.prefix_store` names (None for "none")."""
    if offload.prefix_store == "disk":
        return DiskTier(offload.prefix_path(), offload.prefix_limit_bytes, evict=True)
    if offload.prefix_store == "redis":
        from .redis_tier import RedisTier

        ns = f"{offload.store_namespace}:" if offload.store_namespace else ""
        return RedisTier(offload.redis_url, prefix=offload.redis_prefix + ns,
                         timeout_s=offload.redis_timeout_s,
                         retry_after_s=offload.redis_retry_after_s, ttl_s=offload.redis_ttl_s)
    return None


def store_secret(offload: OffloadConfig, tier: Tier) -> bytes:
    """The secret store keys of `tier` derive from (see module doc)."""
    if offload.store_secret is not None:
        return secret_bytes(offload.store_secret)
    if isinstance(tier, DiskTier):
        return disk_secret(tier.root)
    if tier.remote:
        raise _needs_secret(tier.name)
    return process_secret()


def _needs_secret(where: str) -> ConfigError:
    return ConfigError(
        f"a prefix store on {where} needs OffloadConfig(store_secret=...): a secret of at least "
        "16 bytes (e.g. secrets.token_hex(32)) that every process sharing the store passes; "
        "store keys and record MACs derive from it, so a reader of the server without it can "
        "neither find a prompt's blocks nor forge them"
    )


def open_prefix_store(config: CacheIdentity, offload: OffloadConfig,
                      tier: Optional[Tier] = None) -> Optional[PrefixStore]:
    """The prefix store of a cache (None when `offload` has none and no `tier` is given).
    Raises ConfigError, before opening anything, when `config.model_id` is empty."""
    if tier is None and offload.prefix_store == "none":
        return None
    identity = store_identity(config)  # ConfigError without a model identity
    if offload.prefix_store == "redis" and tier is None and offload.store_secret is None:
        raise _needs_secret(f"redis tier {redact_url(offload.redis_url)}")
    if tier is None:
        tier = make_prefix_tier(offload)
    assert tier is not None
    keys = StoreKeys(store_secret(offload, tier), identity, offload.store_namespace)
    return PrefixStore(tier, keys)
