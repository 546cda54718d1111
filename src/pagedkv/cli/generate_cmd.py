"""`pagedkv generate "prompt"`: stream a reply from a model whose KV cache is paged and compressed."""

from __future__ import annotations

import argparse
import os
import sys
import time


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("generate", help="generate text with a compressed KV cache", description=__doc__)
    p.add_argument("prompt", help="the user message (the chat template is applied when the model has one)")
    p.add_argument("--model", default=None, help="local HF model folder or .gguf (default: embedded SmolLM2)")
    p.add_argument("--kv-format", default="turbo3", help="KV format (default turbo3); NAME+hp for "
                   "the automatic high-precision first/last layers")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--no-chat-template", action="store_true", help="feed the prompt as raw text")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (default cpu)")
    p.add_argument("--threads", type=int, default=None)
    return p


def run(args) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import TextStreamer

    from ..errors import ConfigError
    from ..eval.model import load_model, resolve_model_source
    from ..eval.runner import cache_for, parse_choice

    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    choice = parse_choice(args.kv_format)
    if args.threads:
        torch.set_num_threads(args.threads)
    source = resolve_model_source(args.model)
    print(f"loading {source.label} ...", file=sys.stderr)
    lm = load_model(source, attn_implementation="pagedkv", device=args.device)
    tok = lm.tokenizer
    if tok.chat_template and not args.no_chat_template:
        ids = tok.apply_chat_template([{"role": "user", "content": args.prompt}],
                                      add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    else:
        ids = tok(args.prompt, return_tensors="pt")["input_ids"]
    cache = cache_for(lm.model, choice)
    streamer = TextStreamer(tok, skip_prompt=True, skip_special_tokens=True)
    t0 = time.perf_counter()
    with torch.inference_mode():
        ids = ids.to(lm.model.device)
        out = lm.model.generate(ids, cache=cache, max_new_tokens=args.max_new_tokens, do_sample=False,
                                streamer=streamer, pad_token_id=tok.pad_token_id or tok.eos_token_id)
    dt = time.perf_counter() - t0
    new = int(out.shape[1] - ids.shape[1])
    print(file=sys.stderr)
    print(f"[{choice.label}] {new} tokens in {dt:.2f} s ({new / dt:.1f} tok/s, prompt {ids.shape[1]} tokens); "
          f"KV cache {cache.used_bytes() / 2**20:.2f} MiB in use for {cache.get_seq_length()} tokens "
          f"({cache.bytes_per_token():.0f} B/token; bf16 would be "
          f"{_bf16_bytes_per_token(cache) * cache.get_seq_length() / 2**20:.2f} MiB)", file=sys.stderr)
    return 0


def _bf16_bytes_per_token(cache) -> int:
    return sum(2 * (s.latent.elements if getattr(s, "latent", None) is not None  # MLA: one latent
                    else 2 * s.num_kv_heads * s.head_dim) for s in cache.config.layers)
