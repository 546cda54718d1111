"""A model whose KV heads split over two tensor-parallel ranks, cut from the embedded SmolLM2.

SmolLM2-135M has 9 query heads over 3 KV heads, which vLLM cannot split over 2 ranks. Keeping
KV heads 0 and 1 with their 6 query heads (and the output projection's matching columns) gives
a real model (trained weights, peaked predictions) of 2 KV heads and 6 query heads of 64,
which splits as vLLM splits any model: each rank one KV head and its 3 query heads.
"""

from __future__ import annotations

import os
import shutil

KV_HEADS, Q_HEADS, HEAD_DIM = 2, 6, 64


def write_tp_model(src: str, dst: str) -> str:
    """Write the cut model to `dst` (a Hugging Face folder, tokenizer included); returns dst."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if os.path.isfile(os.path.join(dst, "config.json")):
        return dst
    cfg = AutoConfig.from_pretrained(src)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    q, kv = Q_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    with torch.no_grad():
        for layer in model.model.layers:
            att = layer.self_attn
            for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
                lin = getattr(att, name)
                new = torch.nn.Linear(lin.in_features, rows, bias=lin.bias is not None)
                new.weight.copy_(lin.weight[:rows])
                if lin.bias is not None:
                    new.bias.copy_(lin.bias[:rows])
                setattr(att, name, new)
            o = att.o_proj
            new = torch.nn.Linear(q, o.out_features, bias=o.bias is not None)
            new.weight.copy_(o.weight[:, :q])
            if o.bias is not None:
                new.bias.copy_(o.bias)
            att.o_proj = new
    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = Q_HEADS, KV_HEADS, HEAD_DIM
    model.config = cfg
    tmp = dst + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    for name in os.listdir(src):
        if name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "generation_config")):
            shutil.copy(os.path.join(src, name), os.path.join(tmp, name))
    os.replace(tmp, dst)
    return dst
