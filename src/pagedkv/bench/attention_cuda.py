"""GPU benchmark of the Triton ops against torch SDPA (and flash-attn if installed) over a
contiguous bf16 cache of the same shapes, in one process.

Decode (headline: batch 32, 32k context, Llama-3-8B heads: 32 q / 8 kv, head_dim 128): time per
call, the baseline's time over ours, and the bandwidth achieved on the bytes each reads (codes +
scales for ours, the bf16 cache for the baseline) as a fraction of the device's peak.
Prefill: a chunk of new tokens at the end of a long context (chunked prefill), time and TFLOP/s.
Store: time to encode + scatter the chunk's K and V, next to the prefill time of the same chunk
(store must not limit prefill).

`run_cuda_bench(BenchConfig(...)) -> dict` is what `pagedkv bench attention --device cuda`
calls; `format_table(result)` renders it. `BenchConfig(dry_run=True)` runs the same logic on
tiny shapes on the CPU under Triton's interpreter (TRITON_INTERPRET=1 must have been set
before Triton was imported), to check the script without a GPU; its times mean nothing.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict
from typing import Callable, Optional

import torch

from ..errors import ConfigError
from ..formats import parse_format
from ..ops.batch import AttentionParams, make_layer
from .config import BenchConfig

# Peak DRAM bandwidth (bytes/s) by device-name substring, most specific first (vendor specs).
PEAK_BANDWIDTH = (
    ("H200", 4.8e12), ("H100 NVL", 3.9e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12),
    ("H800", 3.35e12), ("GH200", 4.0e12), ("B200", 8.0e12), ("A100-SXM4-80GB", 2.039e12),
    ("A100 80GB PCIe", 1.935e12), ("A100", 1.555e12), ("L40S", 0.864e12), ("L4", 0.3e12),
    ("A10G", 0.6e12), ("RTX 4090", 1.008e12), ("RTX 3090", 0.936e12),
)


def peak_bandwidth(device: torch.device) -> Optional[float]:
    """The spec DRAM bandwidth of a CUDA device from its name (None when unknown)."""
    name = torch.cuda.get_device_name(device)
    for key, bw in PEAK_BANDWIDTH:
        if key in name:
            return bw
    return None


def _timer(device: torch.device, dry_run: bool) -> Callable[[Callable], float]:
    """Median milliseconds of fn()."""
    if device.type == "cuda" and not dry_run:
        import triton.testing

        return lambda fn: float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))

    def cpu_time(fn):
        fn()
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    return cpu_time


def measured_copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes/s of a device-to-device copy (read + write), a practical ceiling."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    import triton.testing

    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=5, rep=30, return_mode="median")
    del src, dst
    return 2 * nbytes / (ms * 1e-3)


def _sdpa_decode(q, k, v, scale):
    import torch.nn.functional as F

    return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)


def _flash():
    try:
        from flash_attn import flash_attn_with_kvcache  # noqa: F401

        return flash_attn_with_kvcache
    except Exception:
        return None


def run_cuda_bench(cfg: BenchConfig, log: Callable[[str], None] = lambda s: None) -> dict:
    """Run the benchmark; returns {"device", "config", "peak_bandwidth", "copy_bandwidth", "rows"}.

    Each row: op ("decode" | "prefill" | "store"), impl ("ours" | "sdpa" | "flash-attn"), format,
    precision, ms, and where meaningful bytes, gbps, frac_peak, tflops, speedup_vs_sdpa,
    rel_err_vs_sdpa (|ours - sdpa| / |sdpa| over the decode outputs: ~1e-3 for bf16 pages, the
    codec's error otherwise; a sanity check that the timed kernel computes attention).
    """
    from ..ops import api
    from ..ops.triton import decode_attention, prefill_attention  # Triton imported here, not at module import

    cfg.check()
    if cfg.dry_run:
        device = torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            raise ConfigError("pagedkv bench attention --device cuda needs a CUDA GPU (none is visible); "
                              "use --dry-run to check the script on the CPU")
        device = torch.device("cuda")
    timer = _timer(device, cfg.dry_run)
    gen = torch.Generator(device="cpu").manual_seed(cfg.seed)  # block tables
    dgen = torch.Generator(device=device).manual_seed(cfg.seed)  # data, generated where it lives
    b, s, hq, h, d, bs = cfg.batch, cfg.context, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim, cfg.block_size
    scale = d ** -0.5
    peak = None if cfg.dry_run else peak_bandwidth(device)
    copy_bw = None if cfg.dry_run else measured_copy_bandwidth(device)
    rows: list = []

    # ---- the contiguous bf16 cache (baseline layout [B, H, S, D]) and the queries ----------------
    log(f"building a bf16 cache: batch {b} x {s} tokens x {h} kv heads x {d}")
    k_c = torch.randn(b, h, s, d, generator=dgen, device=device, dtype=torch.bfloat16)
    v_c = torch.randn(b, h, s, d, generator=dgen, device=device, dtype=torch.bfloat16)
    q_dec = torch.randn(b, hq, d, generator=dgen, device=device, dtype=torch.bfloat16)
    bf16_bytes = 2 * b * h * s * d * 2

    def add(**row):
        if row.get("bytes") and row.get("ms"):
            row["gbps"] = row["bytes"] / (row["ms"] * 1e-3) / 1e9
            if peak:
                row["frac_peak"] = row["gbps"] * 1e9 / peak
        rows.append(row)
        log("  " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))

    sdpa_ms = timer(lambda: _sdpa_decode(q_dec[:, :, None, :], k_c, v_c, scale))
    sdpa_out = _sdpa_decode(q_dec[:, :, None, :], k_c, v_c, scale)[:, :, 0].float()
    add(op="decode", impl="sdpa", format="bf16 contiguous", precision="bf16", ms=sdpa_ms, bytes=bf16_bytes)
    flash = _flash()
    if flash is not None and device.type == "cuda":
        k_n, v_n = k_c.transpose(1, 2).contiguous(), v_c.transpose(1, 2).contiguous()
        seqlens = torch.full((b,), s, dtype=torch.int32, device=device)
        ms = timer(lambda: flash(q_dec[:, None], k_n, v_n, cache_seqlens=seqlens, softmax_scale=scale))
        add(op="decode", impl="flash-attn", format="bf16 contiguous", precision="bf16", ms=ms, bytes=bf16_bytes)
        del k_n, v_n

    # prefill baseline: the last `chunk` tokens of the first `pb` sequences attend causally
    # (bottom-right) to their whole context
    pb, chunk = cfg.prefill_batch, cfg.prefill_chunk
    q_pre = torch.randn(pb * chunk, hq, d, generator=dgen, device=device, dtype=torch.bfloat16)
    visible = chunk * (s - chunk) + chunk * (chunk + 1) // 2
    flops = 4.0 * pb * hq * d * visible
    sdpa_pre_ms = _sdpa_prefill_ms(timer, q_pre, k_c[:pb], v_c[:pb], pb, chunk, hq, h, scale)
    add(op="prefill", impl="sdpa", format="bf16 contiguous", precision="bf16", ms=sdpa_pre_ms,
        tflops=flops / (sdpa_pre_ms * 1e-3) / 1e12)

    # ---- our ops over each format -------------------------------------------------------------
    n_blocks = b * s // bs
    tables = torch.randperm(n_blocks, generator=gen).to(torch.int32).view(b, s // bs).to(device)
    seq_lens = torch.full((b,), s, dtype=torch.int32, device=device)
    pos = torch.arange(s, device=device)
    qsl = torch.arange(0, (pb + 1) * chunk, chunk, dtype=torch.int32, device=device)
    params = AttentionParams(scale=scale)
    for name in cfg.formats:
        fmt = parse_format(name)
        log(f"format {name}: storing {b} x {s} tokens")
        layer = make_layer(fmt.k, fmt.v, n_blocks, bs, h, d, device=device)
        # the store by the dispatcher (a codec the Triton store does not declare runs the reference)
        chosen = _store_backend(device, layer)

        def store(layer, k, v, slots):
            api.store(layer, k, v, slots, backend=chosen, checks=False)
        for i in range(b):
            slots = tables[i, pos // bs].long() * bs + pos % bs
            store(layer, k_c[i].transpose(0, 1), v_c[i].transpose(0, 1), slots)
        # store of one prefill chunk (pb x chunk tokens, K and V) into the same slots
        tail = pos[s - chunk:]
        chunk_slots = torch.cat([tables[i, tail // bs].long() * bs + tail % bs for i in range(pb)])
        k_chunk = torch.cat([k_c[i, :, s - chunk:].transpose(0, 1) for i in range(pb)]).contiguous()
        v_chunk = torch.cat([v_c[i, :, s - chunk:].transpose(0, 1) for i in range(pb)]).contiguous()
        store_ms = timer(lambda: store(layer, k_chunk, v_chunk, chunk_slots))
        read = b * s * h * (fmt.k.row_bytes(d) + fmt.v.row_bytes(d))
        for prec in cfg.precisions:
            ms = timer(lambda: decode_attention(q_dec, layer, tables, seq_lens, params,
                                                block_n=cfg.decode_block_n, precision=prec))
            out = decode_attention(q_dec, layer, tables, seq_lens, params, block_n=cfg.decode_block_n,
                                   precision=prec).float()
            rel = float((out - sdpa_out).norm() / sdpa_out.norm())
            add(op="decode", impl="ours", format=name, precision=prec, ms=ms, bytes=read,
                speedup_vs_sdpa=sdpa_ms / ms, rel_err_vs_sdpa=rel)
            ms = timer(lambda: prefill_attention(q_pre, layer, tables[:pb], seq_lens[:pb], qsl, params,
                                                 block_m=cfg.prefill_block_m, block_n=cfg.prefill_block_n,
                                                 precision=prec))
            add(op="prefill", impl="ours", format=name, precision=prec, ms=ms,
                tflops=flops / (ms * 1e-3) / 1e12, speedup_vs_sdpa=sdpa_pre_ms / ms,
                store_ms=store_ms, store_over_prefill=store_ms / ms)
        add(op="store", impl="ours" if chosen.name.startswith("triton") else chosen.name, format=name,
            precision="-", ms=store_ms, tokens_per_s=pb * chunk / (store_ms * 1e-3))
        del layer
        if device.type == "cuda":
            torch.cuda.empty_cache()

    return {
        "device": "cpu (dry run, Triton interpreter)" if cfg.dry_run else torch.cuda.get_device_name(device),
        "config": asdict(cfg),
        "peak_bandwidth": peak,
        "copy_bandwidth": copy_bw,
        "rows": rows,
    }


def _store_backend(device: torch.device, layer):
    """The store's backend: the dispatcher's choice on a GPU; on the dry run's CPU tensors the
    Triton interpreter's backend, or the reference where it declines the codec."""
    from ..ops import select_backend
    from ..ops import triton as tr
    from ..ops.dispatch import Op, codec_refusal

    choice = None
    if device.type != "cuda":
        interp = tr.interpreter_backend()
        choice = interp if codec_refusal(interp, Op.STORE, layer) is None else "reference"
    return select_backend(Op.STORE, device, layer, None, backend=choice)


def _sdpa_prefill_ms(timer, q_pre, k, v, pb, chunk, hq, h, scale) -> float:
    """SDPA over the contiguous cache with a bottom-right causal mask (K/V expanded for GQA)."""
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    q = q_pre.view(pb, chunk, hq, -1).transpose(1, 2)
    kk = k.repeat_interleave(hq // h, dim=1)
    vv = v.repeat_interleave(hq // h, dim=1)
    mask = causal_lower_right(chunk, k.shape[2])
    ms = timer(lambda: F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, scale=scale))
    del kk, vv
    return ms


def format_table(result: dict) -> str:
    """Plain-text table of a run_cuda_bench result."""
    head = f"device: {result['device']}"
    if result.get("peak_bandwidth"):
        head += f" | peak {result['peak_bandwidth'] / 1e12:.2f} TB/s"
    if result.get("copy_bandwidth"):
        head += f" | measured copy {result['copy_bandwidth'] / 1e12:.2f} TB/s"
    cols = ("op", "impl", "format", "precision", "ms", "speedup_vs_sdpa", "gbps", "frac_peak", "tflops",
            "store_over_prefill", "rel_err_vs_sdpa")
    lines = [head, " | ".join(cols)]
    for r in result["rows"]:
        cells = []
        for c in cols:
            v = r.get(c, "")
            cells.append(f"{v:.3g}" if isinstance(v, float) and math.isfinite(v) else str(v))
        lines.append(" | ".join(cells))
    return "\n".join(lines)
