"""Which implementation runs an op: a tiny registry of backends keyed by device type.

A backend is a frozen bundle of the three op implementations (same signatures as
`pagedkv.ops.reference`) plus a `supports(op, layer, params)` predicate saying whether it handles
a case (codec pair, head_dim, settings). Backends register themselves on import:

    from pagedkv.ops.dispatch import Backend, register_backend
    register_backend(Backend(name="cpu", device_types=("cpu",), store=..., decode_attention=...,
                             prefill_attention=..., supports=...))

Fast backends live in modules that are imported lazily, on the first op for their device type
(`LAZY_BACKEND_MODULES`), so that importing pagedkv never compiles a kernel. A module that fails
to import (no compiler, no Triton) is logged once and the reference backend is used.

Each backend also states which codecs it implements, in derived codec traits (`support.py`):
`Backend.codecs`, or for a backend whose `Backend(...)` is built by a module that does not say,
a declaration made with `declare_codecs(name, support)` by the module that knows its kernels
(the CPU attention wrapper declares the C kernel's). The dispatcher checks it for both codecs of
the layer before `supports`, so a catalogue row no kernel of a backend implements (a new code
width, a new decode kind) is never handed to that backend.

Selection for a call (`select_backend`): the backend the caller named (typed argument
`backend=`; ConfigError if unknown, InvalidInput if it cannot run on the tensors' device, does
not implement a codec or does not support the case), else the highest-priority registered
backend for the device type that implements both codecs and whose `supports` accepts the case,
else the reference backend (every row `codecs.derive` describes, any device). An automatic
choice that passes over a backend for the device type (a codec it does not implement, a case its
`supports` declines) is logged once per op, backend and reason (`log_fallback_once`), so a slow
path is never silent.
"""

from __future__ import annotations

import enum
import functools
import importlib
import logging
import threading
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch

from ..errors import ConfigError, InvalidInput
from .batch import AttentionParams, PagedLayer
from .support import ANY, CodecSupport

log = logging.getLogger(__name__)


class Op(enum.Enum):
    """The ops a backend implements."""

    STORE = "store"
    DECODE = "decode_attention"
    PREFILL = "prefill_attention"


@dataclass(frozen=True)
class Backend:
    """One implementation of the ops.

    name: unique name, what `backend=` selects. device_types: torch device types it runs on
    ("cpu", "cuda"; empty tuple = any). priority: higher wins among backends of a device type.
    store / decode_attention / prefill_attention: callables with the reference signatures
    (`pagedkv.ops.reference`), receiving inputs already validated by `pagedkv.ops.api`.
    supports(op, layer, params): False to decline a case (params is None for STORE); the
    dispatcher then falls back to the next backend, finally the reference.
    store_k_fused: optional fused RMSNorm -> RoPE -> store K kernel with the signature of
    `pagedkv.ops.fused.store_k_fused` (less backend/checks); None = the fused path composes
    fp32 torch norm/RoPE with this backend's store.
    codecs: the codec traits it implements (`support.CodecSupport`); None = what was declared
    for its name with `declare_codecs`, else every row (the reference).
    """

    name: str
    device_types: tuple[str, ...]
    store: Callable
    decode_attention: Callable
    prefill_attention: Callable
    supports: Callable[[Op, PagedLayer, Optional[AttentionParams]], bool] = lambda op, layer, params: True
    priority: int = 0
    store_k_fused: Optional[Callable] = None
    codecs: Optional[CodecSupport] = None

    def runs_on(self, device_type: str) -> bool:
        return not self.device_types or device_type in self.device_types

    def impl(self, op: Op) -> Callable:
        return {Op.STORE: self.store, Op.DECODE: self.decode_attention, Op.PREFILL: self.prefill_attention}[op]


# Modules imported on the first op for a device type; each registers its backend(s) on import.
LAZY_BACKEND_MODULES: dict[str, tuple[str, ...]] = {
    "cpu": ("pagedkv.ops.cpu",),
    "cuda": ("pagedkv.ops.triton",),
}

_registry: dict[str, Backend] = {}
_declared: dict[str, CodecSupport] = {}
_loaded_device_types: set[str] = set()
_lock = threading.Lock()


def register_backend(backend: Backend) -> None:
    """Add (or replace, by name) a backend. Called by backend modules on import."""
    with _lock:
        _registry[backend.name] = backend


def declare_codecs(name: str, support: CodecSupport) -> None:
    """State which codecs the backend called `name` implements (for a Backend built without
    `codecs=`); the dispatcher enforces it from then on."""
    with _lock:
        _declared[name] = support


def codec_support(backend: Backend) -> CodecSupport:
    """The codecs `backend` implements: its own `codecs`, else its name's declaration, else ANY."""
    if backend.codecs is not None:
        return backend.codecs
    return _declared.get(backend.name, ANY)


def codec_refusal(backend: Backend, op: Op, layer: PagedLayer) -> Optional[str]:
    """None when `backend` implements both codecs of `layer` for `op`, else why not."""
    support = codec_support(backend)
    for side, codec in (("k", layer.k_codec), ("v", layer.v_codec)):
        why = support.refusal(codec, store=op is Op.STORE)
        if why is not None:
            return f"{side} codec {codec.name!r}: {why}"
    return None


@functools.lru_cache(maxsize=4096)
def log_fallback_once(what: str, reason: str, runs_on: str) -> None:
    """Log (once per distinct arguments: the cache is the memory) that `what` runs on the slower
    `runs_on` because of `reason`; `reason` names the codec. Used by the dispatcher and by a
    backend handing one call of its own to the reference ops."""
    log.warning("pagedkv: %s runs on the %s: %s", what, runs_on, reason)


def unregister_backend(name: str) -> None:
    """Remove a backend by name (tests); the reference backend cannot be removed."""
    if name == "reference":
        raise ConfigError("the reference backend cannot be unregistered")
    with _lock:
        _registry.pop(name, None)


def _load_lazy(device_type: str) -> None:
    if device_type in _loaded_device_types:
        return
    with _lock:
        if device_type in _loaded_device_types:
            return
        _loaded_device_types.add(device_type)
    for module in LAZY_BACKEND_MODULES.get(device_type, ()):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:  # the backend exists but a dependency of it is missing
                log.warning("pagedkv: fast backend %s unavailable (%s); using the reference ops",
                            module, exc)
        except Exception as exc:  # optional fast path: missing compiler, Triton, ...
            log.warning("pagedkv: fast backend %s unavailable (%s: %s); using the reference ops",
                        module, type(exc).__name__, exc)


def backends(device_type: Optional[str] = None) -> list[Backend]:
    """Registered backends (loading the lazy ones for `device_type`), best first."""
    if device_type is not None:
        _load_lazy(device_type)
    found = [b for b in _registry.values() if device_type is None or b.runs_on(device_type)]
    return sorted(found, key=lambda b: -b.priority)


def get_backend(name: str) -> Backend:
    """The registered backend called `name`; ConfigError listing the registered names."""
    for device_type in LAZY_BACKEND_MODULES:
        if name not in _registry:
            _load_lazy(device_type)
    try:
        return _registry[name]
    except KeyError:
        raise ConfigError(
            f"unknown ops backend {name!r}; registered backends: {', '.join(sorted(_registry))}"
        ) from None


BackendChoice = Union[None, str, Backend]


def select_backend(op: Op, device: torch.device, layer: PagedLayer,
                   params: Optional[AttentionParams], backend: BackendChoice = None) -> Backend:
    """The backend that runs `op` for tensors on `device` (see the module docstring)."""
    device_type = torch.device(device).type
    if backend is not None:
        chosen = backend if isinstance(backend, Backend) else get_backend(backend)
        if not chosen.runs_on(device_type):
            raise InvalidInput(
                f"backend {chosen.name!r} runs on {', '.join(chosen.device_types)}, "
                f"not on the inputs' device {device_type!r}"
            )
        why = codec_refusal(chosen, op, layer)
        if why is not None:
            raise InvalidInput(f"backend {chosen.name!r} does not implement {op.value} for {why}")
        if not chosen.supports(op, layer, params):
            raise InvalidInput(
                f"backend {chosen.name!r} does not support {op.value} for "
                f"k={layer.k_codec.name}, v={layer.v_codec.name}, head_dim={layer.head_dim}"
            )
        return chosen
    passed = []  # (backend, why) of the better backends passed over
    for candidate in backends(device_type):
        why = codec_refusal(candidate, op, layer)
        if why is None:
            if candidate.supports(op, layer, params):
                for name, reason in passed:
                    log_fallback_once(f"{op.value} on {device_type}", f"backend {name!r}: {reason}",
                                      f"{candidate.name} ops")
                return candidate
            why = (f"its supports() declines k={layer.k_codec.name}, v={layer.v_codec.name}, "
                   f"head_dim={layer.head_dim}")
        passed.append((candidate.name, why))
    reference = _registry["reference"]
    why = codec_refusal(reference, op, layer)  # raises ConfigError for a row with no derivation
    assert why is None, why
    return reference
