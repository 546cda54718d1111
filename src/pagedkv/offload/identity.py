"""What a shared prefix store must know about the model: an identity, and every K/V setting.

Two caches may only share stored blocks when the blocks mean the same thing: same model weights,
same block size, formats, dims, key centring, sliding windows. `CacheConfig.fingerprint` covers
the cache's own settings and `model_id`; a store refuses to start with the default empty
`model_id` (two different models with the same dims would otherwise load each other's K/V), and
`store_identity` adds what the fingerprint leaves out (the sliding window of each layer).
`weights_identity(model)` derives an identity from the weights when there is no better name.
"""

from __future__ import annotations

from hashlib import blake2b
from typing import Protocol, Sequence

import torch

from ..errors import ConfigError


class CacheIdentity(Protocol):
    """What the tiers read of a cache's configuration (`pagedkv.cache.CacheConfig` is one; the
    tiers never import the cache)."""

    model_id: str
    fingerprint: bytes
    layers: Sequence  # each with .sliding_window (None or W)

SAMPLE_BYTES = 1 << 16  # bytes hashed per tensor beyond its name, dtype and shape


def require_model_id(config: CacheIdentity) -> str:
    """`config.model_id`, or ConfigError naming what to pass when it is empty."""
    if not config.model_id:
        raise ConfigError(
            "a shared prefix store needs a model identity: pass CacheConfig(model_id=...) with a "
            "name that pins the exact weights (e.g. 'HuggingFaceTB/SmolLM2-135M@<revision>') or "
            "one derived from them, pagedkv.offload.weights_identity(model); with "
            "model_id='' two models of the same dims and format would load each other's K/V"
        )
    return config.model_id


def store_identity(config: CacheIdentity) -> bytes:
    """16 bytes: the cache fingerprint (model id, block size, dims, formats, key centring) and
    every layer's sliding window. Mixed into every store key."""
    require_model_id(config)
    h = blake2b(digest_size=16, person=b"pagedkv-ident")
    h.update(config.fingerprint)
    h.update(("|".join(str(s.sliding_window) for s in config.layers)).encode())
    return h.digest()


def weights_identity(model, sample_bytes: int = SAMPLE_BYTES) -> str:
    """`"weights:<hex>"`, a hash of a model's parameters and buffers (a `torch.nn.Module` or a
    state dict): every name, dtype and shape, and up to `sample_bytes` of each tensor's values
    (evenly strided; the whole tensor when smaller), so two checkpoints of one architecture get
    different identities. Costs one pass over a small sample, not over the weights."""
    if isinstance(model, torch.nn.Module):
        items = list(model.state_dict(keep_vars=False).items())
    elif isinstance(model, dict):
        items = list(model.items())
    else:
        raise ConfigError(f"weights_identity needs a torch.nn.Module or a state dict, got "
                          f"{type(model).__name__}")
    if not items:
        raise ConfigError("weights_identity: the model has no parameters or buffers")
    h = blake2b(digest_size=16, person=b"pagedkv-weights")
    for name, t in sorted(items, key=lambda kv: kv[0]):
        if not isinstance(t, torch.Tensor):
            continue
        t = t.detach()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        flat = t.reshape(-1)
        n = max(1, sample_bytes // max(1, t.element_size()))
        if flat.numel() > n:
            # evenly strided in integers (a float32 linspace rounds past the end above 2**24)
            idx = torch.arange(n, device=flat.device, dtype=torch.int64) * (flat.numel() - 1) \
                // max(1, n - 1)
            flat = flat[idx]
        h.update(flat.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return "weights:" + h.hexdigest()
