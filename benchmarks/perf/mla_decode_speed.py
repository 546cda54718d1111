"""Decode speed of latent (MLA) attention per layout and path: automatic (fused kernel for one-codec
rows), chunked torch, reference. 1 thread, medians of 5.

    .venv/bin/python benchmarks/perf/mla_decode_speed.py
"""
import torch, time, statistics
torch.set_num_threads(1)
from pagedkv.codecs import get_codec
from pagedkv.ops.latent import *
from pagedkv.ops import AttentionParams
def bench(f, reps=5):
    f(); ts=[]
    for _ in range(reps):
        t=time.perf_counter(); f(); ts.append(time.perf_counter()-t)
    return statistics.median(ts)
n, hq, B = 4096, 16, 1
for lat, rp in [("bf16","bf16"),("fp8","fp8"),("fp8","q8_0"),("turbo3","turbo3"),("turbo3","bf16")]:
    spec = LatentSpec(512, 64, get_codec(lat), get_codec(rp))
    layer = make_latent_layer(spec, n//16+1, 16)
    bt = torch.arange(n//16, dtype=torch.int32)[None]
    latent_store(layer, torch.randn(n,512), torch.randn(n,64), torch.arange(n))
    sl = torch.tensor([n], dtype=torch.int32)
    ql, qr = torch.randn(1, hq, 512), torch.randn(1, hq, 64)
    p = AttentionParams(scale=0.05)
    r = {}
    for be in ([None, "chunked", "reference"]):
        r[be] = bench(lambda: latent_decode_attention(ql, qr, layer, bt, sl, p, backend=be, checks=False))
    print(f"{spec.name:16s} decode {n} tok x {hq} heads: auto {r[None]*1e3:.2f} ms, chunked {r['chunked']*1e3:.2f} ms, reference {r['reference']*1e3:.2f} ms")
