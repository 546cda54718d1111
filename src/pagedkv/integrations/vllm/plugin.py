"""The vLLM plugin: registered by the `vllm.general_plugins` entry point, run in every vLLM process.

`register()` is idempotent and changes nothing vLLM does unless an engine names a pagedkv format
(`additional_config["pagedkv"]`, or the environment variable `PAGEDKV_VLLM`, read here once):
- CUDA (and other GPU platforms): registers `PagedKVBackend` as `AttentionBackendEnum.CUSTOM`,
  which vLLM uses only when asked (`--attention-backend CUSTOM`); the backend then needs the
  pagedkv settings and refuses to start without them.
- Every platform: the platform's `register_custom_kv_cache_specs` also registers pagedkv's
  tail spec (`tail.SinkWindowSpec`, used only by a recent window with sinks).
- CPU: vLLM's CPU platform always resolves CPU_ATTN (it ignores `--attention-backend`), so the
  plugin wraps the platform's `get_attn_backend_cls`: for an engine whose config names a pagedkv
  format it overrides CPU_ATTN with `PagedKVBackend` (and refuses MLA / sparse attention, which
  pagedkv's vLLM backend does not serve); for any other engine it removes that override and
  answers exactly as vLLM would.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

from ...errors import ConfigError
from .settings import ENV_VAR, VllmSettings, settings_from

BACKEND_PATH = "pagedkv.integrations.vllm.backend.PagedKVBackend"
log = logging.getLogger("vllm.pagedkv")  # under vLLM's logger: its handlers print it

_state = {"registered": False, "env": None}


def env_value() -> Optional[str]:
    """The value of PAGEDKV_VLLM as read when the plugin was registered (None if unset)."""
    return _state["env"]


def register() -> None:
    """Entry point of `vllm.general_plugins` (see the module docstring). Safe to call again."""
    if _state["registered"]:
        return
    _state["registered"] = True
    _state["env"] = os.environ.get(ENV_VAR) or None
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)
    _wrap_spec_registration(type(current_platform))
    if current_platform.is_cpu():
        _wrap_cpu_selection(type(current_platform), AttentionBackendEnum, register_backend)


def engine_settings():
    """The pagedkv settings of the engine being built in this process, or None."""
    from vllm.config import get_current_vllm_config_or_none

    cfg = get_current_vllm_config_or_none()
    return settings_from(getattr(cfg, "additional_config", None), env_value())


def required_settings(cfg, who: str) -> VllmSettings:
    """The pagedkv settings of the engine config `cfg`; ConfigError from `who` when it names none."""
    settings = settings_from(getattr(cfg, "additional_config", None), env_value())
    if settings is None:
        raise ConfigError(f"{who}: the engine names no pagedkv format; pass --additional-config "
                          f"'{{\"pagedkv\": {{\"kv_format\": \"turbo3\"}}}}' or set {ENV_VAR}")
    return settings


def _wrap_spec_registration(platform_cls) -> None:
    """Add pagedkv's KV-cache spec (the recent window's tail with sinks, `tail.SinkWindowSpec`)
    to vLLM's spec registry whenever vLLM registers its own (the platform's hook); a spec class
    only pagedkv's tail layers use, so nothing else changes."""
    original = platform_cls.register_custom_kv_cache_specs  # bound classmethod
    if getattr(original, "_pagedkv", False):
        return

    def register_custom_kv_cache_specs(cls, vllm_config) -> None:
        original(vllm_config)
        from .tail import register_specs

        register_specs()

    register_custom_kv_cache_specs._pagedkv = True
    platform_cls.register_custom_kv_cache_specs = classmethod(register_custom_kv_cache_specs)


def _wrap_cpu_selection(platform_cls, enum, register_backend) -> None:
    original = platform_cls.get_attn_backend_cls  # bound classmethod
    if getattr(original, "_pagedkv", False):
        return

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        settings = engine_settings()
        if settings is None:
            if enum.CPU_ATTN.is_overridden() and enum.CPU_ATTN.get_path() == BACKEND_PATH:
                enum.CPU_ATTN.clear_override()
            return original(selected_backend, attn_selector_config, num_heads)
        if attn_selector_config.use_mla or attn_selector_config.use_sparse:
            raise ConfigError("pagedkv vLLM backend: MLA / sparse attention layers are not supported; "
                              "supported: multi-head / grouped-query attention (drop the pagedkv setting)")
        register_backend(enum.CPU_ATTN, BACKEND_PATH)
        log.info("pagedkv: serving attention with pagedkv pages, %s", settings.label)
        return original(selected_backend, attn_selector_config, num_heads)

    get_attn_backend_cls._pagedkv = True
    platform_cls.get_attn_backend_cls = classmethod(get_attn_backend_cls)
