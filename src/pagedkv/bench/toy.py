"""A tiny deterministic transformer that drives a cache end to end (tests, bench, demos).

Not a language model: random weights from a seed, no RoPE. What it has is the data flow of one:
per layer, RMS-normalise x and project it to q, k, v; `store` k, v at the step's slots; attention
through the cache's pools; x += attention @ W_o; the greedy next token from the residual updates
(x minus the input embedding) @ E^T, so it depends on attention. Outputs feed the next layer
and the next token, so any difference in stored or read-back bytes shows in the tokens.

Works with a plain `PagedCache` (calls `pagedkv.ops` with the cache's own tables: the oracle of
the tier tests) and with one built with offload tiers (calls its attention methods, which read
swapped blocks back).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable, Sequence

import torch

from ..cache import PagedCache
from ..ops import api as ops
from ..ops.batch import AttentionParams


@dataclass
class ToyRun:
    seq_id: Hashable
    hit_tokens: int  # prompt tokens not recomputed (prefix hits, memory or tier)
    prefilled: int  # prompt tokens run through the model
    tokens: list  # generated token ids
    outputs: list  # per step: float32 [Hq, D] attention output of the last layer


class ToyLM:
    """Random-weight attention stack over a cache's layers.

    vocab, d_model: sizes; q heads = 2 x kv heads per layer (grouped-query attention).
    """

    def __init__(self, cache: PagedCache, vocab: int = 97, d_model: int = 64, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.cache = cache
        self.vocab = vocab
        self.emb = torch.randn(vocab, d_model, generator=g)
        self.w = []
        for pl in cache.layers:
            h, d = pl.num_kv_heads, pl.head_dim
            s = 1.0 / math.sqrt(d_model)
            self.w.append(tuple(torch.randn(a, b, generator=g) * sc for a, b, sc in (
                (d_model, 2 * h * d, s), (d_model, h * d, s), (d_model, h * d, s),
                (2 * h * d, d_model, 4.0 / math.sqrt(2 * h * d)))))
        self.params = [AttentionParams(scale=1.0 / math.sqrt(pl.head_dim), sliding_window=s.sliding_window)
                       for pl, s in zip(cache.layers, cache.config.layers)]

    def _attend(self, li: int, q: torch.Tensor, seq_ids: Sequence[Hashable],
                qsl: torch.Tensor | None) -> torch.Tensor:
        c = self.cache
        if c.tiers is not None or c.tails is not None:
            if qsl is None:
                return c.decode_attention(li, q, seq_ids, self.params[li])
            return c.prefill_attention(li, q, seq_ids, qsl, self.params[li])
        tables, lens = c.block_tables(seq_ids, li), c.seq_lens(seq_ids)
        if qsl is None:
            return ops.decode_attention(q, c.layers[li], tables, lens, self.params[li])
        return ops.prefill_attention(q, c.layers[li], tables, lens, qsl, self.params[li])

    def forward(self, tokens: Sequence[int], seq_ids: Sequence[Hashable], slots,
                qsl: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Run new tokens (packed, sequences in `seq_ids` order) through every layer.

        slots: the `NewSequence` / `StepBatch` that handed out their slots (every block group's),
        or an int64 [T] slot tensor (a cache with one group).
        qsl: int32 [B+1] query offsets for prefill, None for decode (one token per sequence).
        Returns (logits float32 [T, vocab], last layer's attention output [T, Hq, D])."""
        x = self.emb[torch.tensor(list(tokens), dtype=torch.long)]
        o = None
        for li, pl in enumerate(self.cache.layers):
            wq, wk, wv, wo = self.w[li]
            h, d = pl.num_kv_heads, pl.head_dim
            xn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)  # RMS norm: any depth
            q = (xn @ wq).view(-1, 2 * h, d)
            self.cache.store(li, (xn @ wk).view(-1, h, d), (xn @ wv).view(-1, h, d), slots)
            o = self._attend(li, q, seq_ids, qsl)
            x = x + o.reshape(x.shape[0], -1) @ wo
        return (x - self.emb[torch.tensor(list(tokens), dtype=torch.long)]) @ self.emb.T, o

    def generate(self, prompt: Sequence[int], steps: int, salt=None) -> ToyRun:
        """Prefill `prompt` (skipping prefix hits), then `steps` greedy decode steps."""
        c = self.cache
        new = c.add_sequence(list(prompt), salt=salt)
        sid, hit = new.seq_id, new.hit_tokens
        rest = list(prompt)[hit:]
        qsl = torch.tensor([0, len(rest)], dtype=torch.int32)
        logits, o = self.forward(rest, [sid], new, qsl)
        c.commit(sid)
        tok = int(logits[-1].argmax())
        out_tokens, outs = [tok], [o[-1].clone()]
        for _ in range(steps - 1):
            batch = c.step([sid], [[tok]])
            logits, o = self.forward([tok], [sid], batch, None)
            c.commit(sid)
            tok = int(logits[-1].argmax())
            out_tokens.append(tok)
            outs.append(o[-1].clone())
        return ToyRun(sid, hit, len(rest), out_tokens, outs)
