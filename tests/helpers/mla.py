"""A tiny random-weight DeepSeek-V3 (MLA) model for the latent-cache tests, built offline."""

from __future__ import annotations

import torch
from transformers import DeepseekV3Config, DynamicCache

LAT, ROPE, LAYERS = 64, 32, 3


def mla_config(**kw) -> DeepseekV3Config:
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=4,
                kv_lora_rank=LAT, q_lora_rank=32, qk_rope_head_dim=ROPE, qk_nope_head_dim=16,
                v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                first_k_dense_replace=1, n_group=1, topk_group=1, max_position_embeddings=256,
                initializer_range=0.2, attn_implementation="eager")
    base.update(kw)
    return DeepseekV3Config(**base)


class RoundingCache(DynamicCache):
    """transformers' cache, storing the latent and rope key rounded to bf16 (what ours stores)."""

    def update(self, k, v, layer_idx, *args, **kwargs):
        return super().update(k.to(torch.bfloat16).float(), v.to(torch.bfloat16).float(), layer_idx,
                              *args, **kwargs)


def random_ids(seed=1, batch=2, n=12) -> torch.Tensor:
    return torch.randint(0, 256, (batch, n), generator=torch.Generator().manual_seed(seed))


def enabled_model():
    """For a module fixture (`model = pytest.fixture(scope="module")(enabled_model)`): the tiny
    model (seed 0) with the absorbed MLA forward (`deepseek.enable`), disabled afterwards."""
    from transformers import DeepseekV3ForCausalLM

    from pagedkv.integrations.deepseek import disable, enable

    torch.manual_seed(0)
    m = DeepseekV3ForCausalLM(mla_config()).eval()
    enable(m)
    yield m
    disable(m)
