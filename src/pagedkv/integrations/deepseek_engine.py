"""A DeepSeek-style (MLA) transformers model run by an engine loop on `pagedkv.cache.PagedCache`.

The engine owns the sequences (`add_sequence` with prefix hits, `step`, `commit`, `fork`, `pop`,
`free`, the offload tiers); this module only runs the model on one step's new tokens, packed
(varlen: sequences of different lengths in one forward, no padding):

    from pagedkv.cache import CacheConfig, PagedCache
    from pagedkv.cache.latent import LatentLayout
    from pagedkv.integrations.deepseek import enable, mla_dims
    from pagedkv.integrations.deepseek_engine import latent_config, engine_forward

    enable(model)                                     # the absorbed MLA forward
    cache = PagedCache(latent_config(model, "turbo4", num_blocks=256))
    new = cache.add_sequence(prompt)                  # hit_tokens already stored
    logits = engine_forward(model, cache, [new.seq_id], [prompt[new.hit_tokens:]], new)
    cache.commit(new.seq_id)
    step = cache.step([new.seq_id], [[next_token]])   # decode: one token per sequence
    logits = engine_forward(model, cache, [new.seq_id], [[next_token]], step)
    cache.commit(new.seq_id)

Each attention module stores its layer's rows with `PagedCache.store_latent` and attends with
`latent_prefill_attention` (or `latent_decode_attention` when every sequence runs one token),
the same ops the drop-in `PagedLatentCache` calls (`deepseek.AbsorbedCache`).
"""

from __future__ import annotations

from typing import Hashable, Optional, Sequence, Union

import torch

from ..cache.tables import GroupSlots
from .deepseek import AbsorbedCache, latent_config, patched_modules  # noqa: F401 (latent_config: re-exported)
from ..errors import ConfigError, InvalidInput


class EngineStep(AbsorbedCache):
    """One forward over `seq_ids` of `cache`: the packed new tokens (counts[b] for sequence b,
    whose slots the StepBatch / NewSequence `slots` handed out, or one per sequence)."""

    def __init__(self, cache, seq_ids: Sequence[Hashable], counts: Sequence[int],
                 slots: Union[GroupSlots, Sequence[GroupSlots]], op_kwargs: dict):
        self.cache, self.seq_ids, self.op_kwargs = cache, list(seq_ids), op_kwargs
        self.slots = [slots] if isinstance(slots, GroupSlots) else list(slots)
        starts = [0]
        for n in counts:
            starts.append(starts[-1] + n)
        self.query_start_loc = torch.tensor(starts, dtype=torch.int32, device=cache.device)
        self.decode = all(n == 1 for n in counts)

    def mla_store(self, layer_idx, latent, rope, attention_mask) -> None:
        parts = [s.layer_slots(layer_idx) for s in self.slots]
        slots = parts[0] if len(parts) == 1 else torch.cat(parts)
        self.cache.store_latent(layer_idx, latent[0], rope[0], slots, **self.op_kwargs)

    def mla_window(self, layer_idx: int) -> Optional[int]:
        return self.cache.config.layers[layer_idx].sliding_window

    def mla_attend(self, layer_idx, q_lat, q_rope, params) -> torch.Tensor:
        c = self.cache
        if self.decode:
            o = c.latent_decode_attention(layer_idx, q_lat[0].contiguous(), q_rope[0].contiguous(),
                                          self.seq_ids, params, **self.op_kwargs)
        else:
            o = c.latent_prefill_attention(layer_idx, q_lat[0].contiguous(), q_rope[0].contiguous(),
                                           self.seq_ids, self.query_start_loc, params,
                                           **self.op_kwargs)
        return o[None]


@torch.no_grad()
def engine_forward(model, cache, seq_ids: Sequence[Hashable], tokens: Sequence[Sequence[int]],
                   slots: Union[GroupSlots, Sequence[GroupSlots]], *, backend=None,
                   checks: bool = True) -> torch.Tensor:
    """Run `model` (patched by `deepseek.enable`) on the new tokens of several sequences of the
    latent `PagedCache` `cache`, whose slots were allocated (`add_sequence` / `step`: `slots`
    is what they returned, one or one per sequence, in order); tokens[b]: sequence b's new
    token ids, at its last len(tokens[b]) positions. Stores every layer's rows, attends, and
    returns the logits float [sum of lengths, vocab], packed in sequence order. The caller
    commits afterwards."""
    if not patched_modules(model):
        raise ConfigError(f"{type(model).__name__} runs transformers' own attention: call "
                          "pagedkv.integrations.deepseek.enable(model) first")
    counts = [len(t) for t in tokens]
    if len(counts) != len(seq_ids) or not all(counts):
        raise InvalidInput(f"engine_forward needs one non-empty token list per sequence, got "
                           f"{counts} for {len(seq_ids)} sequences")
    lens = [cache.seq_len(s) for s in seq_ids]
    if any(n > m for n, m in zip(counts, lens)):
        raise InvalidInput(f"sequences of {lens} tokens cannot hold {counts} new ones: allocate "
                           "them first (add_sequence / step)")
    dev = cache.device
    ids = torch.tensor([t for row in tokens for t in row], dtype=torch.long, device=dev)[None]
    pos = torch.cat([torch.arange(m - n, m, device=dev) for n, m in zip(counts, lens)])[None]
    total = ids.shape[1]
    # a prepared 4D mask: transformers builds none; the ops apply causality per sequence
    mask = torch.zeros(1, 1, total, total, device=dev)
    step = EngineStep(cache, seq_ids, counts, slots, dict(backend=backend, checks=checks))
    out = model(input_ids=ids, position_ids=pos, attention_mask=mask, cache=step, use_cache=False)
    return out.logits[0]
