"""`pagedkv generate "prompt"`: stream a reply from a model whose KV cache is paged and compressed.

The reply streams to stdout, the summary goes to stderr (with --json: one JSON object on stdout,
nothing streamed). KV sizes count whole blocks, the same way for the format and for the bf16
cache it is compared with."""

from __future__ import annotations

import argparse
import os
import sys
import time

from ..options import add_option_arguments, options_from_args
from .edge import add_compute_arguments, compute_from_args
from .output import print_json

# the cache options (`pagedkv.options.CacheOptions`) with a flag here; the recent window is
# named in --kv-format (turbo3+r64s16q8_0)
OPTION_FLAGS = ("block_size", "hp_format", "key_centring", "value_centring", "key_scaling", "reclaim_sliding",
                "keep_window_prefixes", "approx", "backend", "checks")


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("generate", help="generate text with a compressed KV cache", description=__doc__)
    p.add_argument("prompt", help="the user message (the chat template is applied when the model has one)")
    p.add_argument("--model", default=None, help="local HF model folder or .gguf (default: embedded SmolLM2)")
    p.add_argument("--kv-format", default="turbo3", help="KV format spec (default turbo3): NAME+hp for "
                   "the automatic high-precision first/last layers, a last +rR[sS][codec] recent window, "
                   "or a plan file (.json, `pagedkv tune`)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="default 128")
    p.add_argument("--no-chat-template", action="store_true", help="feed the prompt as raw text")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (default cpu)")
    add_compute_arguments(p)
    add_option_arguments(p, OPTION_FLAGS)
    p.add_argument("--json", action="store_true", help="print one JSON object (reply, sizes, speed)")
    return p


def run(args) -> int:
    from ..errors import ConfigError

    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if not args.prompt.strip():
        raise ConfigError("the prompt is empty; pass some text to reply to")
    try:  # bytes that are not UTF-8 reach Python as lone surrogates ($'\xff\xfe hello')
        args.prompt.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ConfigError(f"the prompt is not valid UTF-8 (a byte 0x{ord(exc.object[exc.start]) & 0xff:02x} "
                          f"at character {exc.start}); pass UTF-8 text") from None
    compute = compute_from_args(args)
    options = options_from_args(args, OPTION_FLAGS)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from ..eval.model import load_model, load_tokenizer, resolve_device, resolve_model_source
    from ..eval.runner import cache_for, parse_choice
    from ..integrations.hf_compat import with_cache

    choice = parse_choice(args.kv_format)
    source = resolve_model_source(args.model)
    resolve_device(args.device)
    compute.apply()
    import torch
    from transformers import TextStreamer

    tok = load_tokenizer(source)
    print(f"loading {source.label} ...", file=sys.stderr)
    lm = load_model(source, attn_implementation="pagedkv", device=args.device, tokenizer=tok)
    if tok.chat_template and not args.no_chat_template:
        ids = tok.apply_chat_template([{"role": "user", "content": args.prompt}],
                                      add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    else:
        ids = tok(args.prompt, return_tensors="pt")["input_ids"]
    cache = cache_for(lm.model, choice, options=options)
    streamer = None if args.json else TextStreamer(tok, skip_prompt=True, skip_special_tokens=True)
    t0 = time.perf_counter()
    with torch.inference_mode():
        ids = ids.to(lm.model.device)
        out = lm.model.generate(ids, **with_cache(lm.model, cache), max_new_tokens=args.max_new_tokens, do_sample=False,
                                streamer=streamer, pad_token_id=tok.pad_token_id or tok.eos_token_id)
    dt = time.perf_counter() - t0
    new = int(out.shape[1] - ids.shape[1])
    used = cache.used_bytes()
    bf16_used = used * _bf16_bytes_per_token(cache) / cache.bytes_per_token()  # same blocks, in bf16
    row = {"format": choice.label, "approx": options.approx.name, "prompt_tokens": int(ids.shape[1]), "new_tokens": new,
           "text": tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True), "seconds": dt,
           "tok_s": new / dt, "tokens_in_cache": cache.get_seq_length(), "kv_bytes_in_use": used,
           "kv_bytes_per_token": cache.bytes_per_token(), "bf16_bytes_in_use": bf16_used,
           "threads": compute.threads}
    if args.json:
        print_json(row)
        return 0
    print(file=sys.stderr)
    print(f"[{choice.label}] {new} tokens in {dt:.2f} s ({new / dt:.1f} tok/s wall, {compute.describe()}; "
          f"prompt {ids.shape[1]} tokens); KV cache {used / 2**20:.2f} MiB for {cache.get_seq_length()} tokens "
          f"in whole blocks ({cache.bytes_per_token():.0f} B/token; the same blocks in bf16: "
          f"{bf16_used / 2**20:.2f} MiB)", file=sys.stderr)
    return 0


def _bf16_bytes_per_token(cache) -> int:
    return sum(2 * (s.latent.elements if getattr(s, "latent", None) is not None  # MLA: one latent
                    else 2 * s.num_kv_heads * s.head_dim) for s in cache.config.layers)
