"""A tiny random Llama with peaked attention, for the approx, eval and tune tests (one copy)."""

from __future__ import annotations

import pytest
import torch


def peaked_llama(*, pagedkv_attention: bool = True, **config):
    """A seeded random LlamaForCausalLM (the same weights on every call): by default 2 layers,
    6 query / 2 KV heads of 64, vocabulary 96; `config` overrides LlamaConfig fields. q and k
    projections are scaled x4 so that attention is peaked (a random init attends almost
    uniformly, which hides score errors). pagedkv_attention: registered and selected as the
    attention implementation. Skips the test without transformers."""
    transformers = pytest.importorskip("transformers")
    from pagedkv.integrations.transformers import register

    register()
    torch.manual_seed(0)
    fields = dict(vocab_size=96, hidden_size=192, intermediate_size=192, num_hidden_layers=2,
                  num_attention_heads=6, num_key_value_heads=2, head_dim=64, max_position_embeddings=256)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**fields, **config})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(4.0)
    if pagedkv_attention:
        model.set_attn_implementation("pagedkv")
    return model


def approx_model(head_dim: int = 64):
    """The approx and decode-tail tests' model: peaked_llama's defaults, on pagedkv attention."""
    return peaked_llama(head_dim=head_dim)
