"""Capacity planning: tokens and sequences that fit a KV memory budget, per format.

Exact: block bytes come from the codec catalogue (`CacheConfig.bytes_per_block`, every layer's K
and V block, high-precision layers included), capacity is whole blocks, and a sequence of L
tokens takes ceil(L / block_size) blocks in the global (full-attention) layers.

Sliding-window layers (window W) keep their own blocks and release those no query can see any
more (`integrations.transformers.PagedKVCache`, one block group per distinct W): while decoding,
a sequence holds at most ceil((W - 1) / block_size) + 1 blocks there (the last W tokens, rounded
out to whole blocks at both ends), so a sequence of L tokens is counted at
min(ceil(L / bs), ceil((W - 1) / bs) + 1) blocks in them. A prefill chunk of C tokens holds up to
ceil(C / bs) more sliding blocks while it is stored and attended (prefill long prompts in chunks
to keep that small).

Columns: `bytes_per_token` is what a token costs in every layer (inside every window);
`global_bytes_per_token` what it costs once it left the windows; `sequences` how many sequences
of `seq_len` fit (global + sliding blocks per sequence); `tokens` the longest single sequence that
fits (every sliding layer holding a full window; with no global layer, where one sequence never
outgrows its windows, the tokens of `sequences` sequences of `seq_len`); `blocks` the budget in
blocks spanning every layer (the old every-layer-keeps-every-token capacity).
"""

from __future__ import annotations

from typing import Optional, Sequence

from ..cache.config import CacheConfig
from ..defaults import BLOCK_SIZE
from ..errors import ConfigError
from ..integrations.model_config import text_config, trained_context
from .runner import parse_choice

DEFAULT_PLAN_FORMATS = ("bf16", "fp8", "q8_0", "turbo8", "q4_0", "turbo4", "fp8k_turbo3v", "turbo3",
                        "turbo3+hp", "turbo2")


def layer_layout(config) -> tuple[list[int], list[int], list[Optional[int]]]:
    """Per attention layer: num_kv_heads, head_dim, sliding window (from a HF config)."""
    from ..integrations.hf_common import _layer_layout

    _, windows, kv, hd = _layer_layout(config)
    return kv, hd, windows


def plan(config, memory_bytes: int, formats: Sequence[str], *, seq_len: Optional[int] = None,
         block_size: int = BLOCK_SIZE) -> list[dict]:
    """One dict per format: bits/element, bytes/token, tokens and sequences of `seq_len` that fit.

    Latent (MLA) models (DeepSeek-V2/V3: kv_lora_rank + qk_rope_head_dim) store one
    [latent | rope] vector per token and layer, not per head (`pagedkv.cache.latent`)."""
    from ..integrations.deepseek import mla_dims

    latent = mla_dims(config)
    if latent is not None:
        from ..cache.latent import LatentLayout

        n_layers = int(text_config(config).num_hidden_layers)
        kv, hd, windows = [1] * n_layers, [sum(latent)] * n_layers, [None] * n_layers
        latent = LatentLayout(*latent)
    else:
        kv, hd, windows = layer_layout(config)
    if seq_len is None:
        seq_len = trained_context(config) or 4096
    if seq_len <= 0:
        raise ConfigError(f"--seq-len must be positive, got {seq_len}")
    def sizes(choice):
        return CacheConfig(num_layers=len(kv), num_kv_heads=kv[0], head_dim=hd[0],
                           layer_dims=list(zip(kv, hd)), kv_format=choice.kv_format,
                           high_precision_layers=choice.high_precision_layers,
                           block_size=block_size, num_blocks=1, sliding_window=windows, latent=latent)

    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ConfigError(f"--block-size must be a positive integer, got {block_size!r}")
    choices = [parse_choice(f) for f in formats]  # all names checked before any work
    seq_blocks = -(-seq_len // block_size)

    def capacity(cfg):
        """(bytes one sequence of seq_len holds, tokens that fit, global bytes per block)."""
        per_window: dict = {}
        for s in cfg.layers:
            per_window[s.sliding_window] = per_window.get(s.sliding_window, 0) + s.k_block_bytes + s.v_block_bytes
        glob = per_window.pop(None, 0)
        window_blocks = {w: -(-(w - 1) // block_size) + 1 for w in per_window}
        seq_bytes = glob * seq_blocks + sum(b * min(seq_blocks, window_blocks[w]) for w, b in per_window.items())
        sequences = memory_bytes // seq_bytes
        if glob:
            held = sum(b * window_blocks[w] for w, b in per_window.items())
            tokens = max(0, memory_bytes - held) // glob * block_size
        else:
            tokens = sequences * seq_len
        return seq_bytes, sequences, tokens, glob

    bf16_tokens = capacity(sizes(parse_choice("bf16")))[2]
    rows = []
    for choice in choices:
        cfg = sizes(choice)
        blocks = memory_bytes // cfg.bytes_per_block
        seq_bytes, sequences, tokens, glob = capacity(cfg)
        elems = sum(s.latent.elements if s.latent is not None else 2 * s.num_kv_heads * s.head_dim
                    for s in cfg.layers)
        rows.append({
            "format": choice.label, "layers": len(kv),
            "bits_per_element": 8 * cfg.bytes_per_block / block_size / elems,
            "bytes_per_token": cfg.bytes_per_block / block_size, "bytes_per_block": cfg.bytes_per_block,
            "global_bytes_per_token": glob / block_size,
            "sliding_layers": sum(s.sliding_window is not None for s in cfg.layers),
            "blocks": blocks, "tokens": tokens, "seq_len": seq_len, "sequences": sequences,
            "seq_bytes": seq_bytes,
            "high_precision_layers": cfg.num_high_precision_layers,
            "vs_bf16": tokens / bf16_tokens if bf16_tokens else float("inf"),
        })
    return rows
