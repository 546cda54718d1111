"""Used KV bytes of a Gemma3-like layer layout (5 sliding W=1024 : 1 global, 12 layers, random weights)
context, with and without reclaiming sliding blocks; decode step medians."""
import statistics, sys, time
import torch
import transformers
from pagedkv.integrations.transformers import PagedKVCache, enable

torch.set_num_threads(1)
torch.manual_seed(0)
cfg = transformers.Gemma3TextConfig(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=12,
                                    num_attention_heads=1, num_key_value_heads=1, head_dim=32,
                                    sliding_window=1024, max_position_embeddings=40000, query_pre_attn_scalar=32)
model = transformers.Gemma3ForCausalLM(cfg).eval()
enable(model)
fmt = sys.argv[1] if len(sys.argv) > 1 else "turbo3"
for ctx in (8192, 32768):
    ids = torch.randint(3, 256, (1, ctx + 40))
    res = {}
    for reclaim in (False, True):
        cache = PagedKVCache(model, fmt, block_size=16, reclaim_sliding=reclaim)
        t0 = time.perf_counter()
        with torch.no_grad():
            for a in range(0, ctx, 2048):
                model(ids[:, a:a + 2048], cache=cache, use_cache=True)
            prefill = time.perf_counter() - t0
            steps = []
            for t in range(ctx, ctx + 40):
                s = time.perf_counter()
                model(ids[:, t:t + 1], cache=cache, use_cache=True)
                steps.append(time.perf_counter() - s)
        res[reclaim] = (cache.used_bytes(), cache.pool_bytes(), statistics.median(steps), prefill)
        print(f"{fmt} ctx={ctx} reclaim={reclaim}: used {cache.used_bytes()/2**20:.2f} MiB, pools "
              f"{cache.pool_bytes()/2**20:.2f} MiB, decode step median {1e3*statistics.median(steps):.1f} ms, "
              f"prefill {prefill:.1f} s", flush=True)
    print(f"  used ratio after/before {res[True][0]/res[False][0]:.3f}, pools {res[True][1]/res[False][1]:.3f}")
