"""One decode step of a whole model through the transformers drop-in on a CUDA GPU, side by side
with transformers' own DynamicCache (SDPA) in one process.

    PYTHONPATH=src python benchmarks/perf/cuda_dropin_step.py [--contexts 1k,8k] [--batches 1,16]
        [--formats bf16,turbo3,turbo4+r32s16q8_0] [--steps 20] [--json]

A random-weight Llama with SmolLM2-135M's shape (30 layers, 9 query / 3 KV heads of 64, bf16
weights): the weights do not change the time. Per (context, batch), each cache is prefilled with
the same random prompt, then `--steps` single-token forward passes are timed one by one (CUDA
synchronised around each); the median step in ms, and its ratio to DynamicCache's. The pagedkv
caches run the Triton kernels (automatic dispatch for CUDA tensors). A small model at small batch
is launch-bound: the ratio then measures per-step overhead (Python, kernel launches), not bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "src"))


def smollm2_shaped(device):
    import transformers

    from pagedkv.integrations.transformers import register

    register()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                   num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                   head_dim=64, max_position_embeddings=32768, tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(cfg).to(device=device, dtype=torch.bfloat16).eval()


def step_ms(model, cache, prompt, steps: int) -> float:
    """Median ms of one single-token forward pass after a prefill of `prompt`."""
    from pagedkv.integrations.hf_compat import with_cache

    kw = with_cache(model, cache)  # cache= or past_key_values=, whichever this transformers takes
    with torch.no_grad():
        model(prompt, **kw, use_cache=True)
        tok = prompt[:, -1:]
        times = []
        for _ in range(steps + 2):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model(tok, **kw, use_cache=True)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[2:])  # two warm-up steps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default="1k,8k")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--formats", default="bf16,turbo3,turbo4+r32s16q8_0")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("cuda_dropin_step: needs a CUDA GPU (none is visible)", file=sys.stderr)
        return 2
    from transformers import DynamicCache

    from pagedkv.cli.sizes import parse_counts
    from pagedkv.integrations.transformers import PagedKVCache

    dev = torch.device("cuda")
    model = smollm2_shaped(dev)
    rows = []
    for ctx in parse_counts(args.contexts, "--contexts"):
        for batch in parse_counts(args.batches, "--batches"):
            prompt = torch.randint(3, 49152, (batch, ctx), generator=torch.Generator().manual_seed(ctx)).to(dev)
            model.set_attn_implementation("sdpa")
            base = step_ms(model, DynamicCache(config=model.config), prompt, args.steps)
            rows.append(dict(context=ctx, batch=batch, cache="DynamicCache (sdpa)", ms=base, ratio=1.0))
            model.set_attn_implementation("pagedkv")
            for fmt in args.formats.split(","):
                cache = PagedKVCache(model, fmt, high_precision_layers=0)
                ms = step_ms(model, cache, prompt, args.steps)
                rows.append(dict(context=ctx, batch=batch, cache=f"PagedKVCache {fmt}", ms=ms, ratio=ms / base))
                del cache
                torch.cuda.empty_cache()
            for r in rows[-1 - len(args.formats.split(",")):]:
                if not args.json:
                    print(f"context {r['context']:>6} batch {r['batch']:>3} {r['cache']:<36} "
                          f"{r['ms']:8.2f} ms/step  x{r['ratio']:.2f}", flush=True)
    if args.json:
        print(json.dumps(dict(device=torch.cuda.get_device_name(dev), torch=torch.__version__, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
