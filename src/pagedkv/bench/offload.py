"""`pagedkv bench offload`: bytes moved and read-back time per tier and format, vs recomputing.

For each KV format, a prefix of `--tokens` seeded random K/V is stored in a cache of `--layers`
layers (`--kv-heads` x `--head-dim`); then for each tier (memory, disk in a temporary
directory (the prefix store's tier), the swap file (the swap tier), and Redis when
`--redis-url` is given):
- bytes/token: record bytes (every layer, K and V, headers and checksums) / block_size, and the
  ratio to bf16's bytes/token;
- write: encode + put of every block (publish / swap-out), per token;
- load: get + verify + write into a pool block of every block (a prefix hit), per token;
- swap read: the per-layer section reads attention does for a swapped block, per token;
against recomputing the prefix:
- recompute (store): encoding and storing the prefix's K/V in every layer from float K/V,
  a LOWER BOUND on recomputing (a real model also runs its projections, MLPs and attention);
- recompute (toy prefill): the prefill of `pagedkv.bench.toy.ToyLM` (projections, store,
  attention) over the prefix;
- recompute (model), with `--model embedded|PATH`: a plain forward of that model over the prefix
  (what a prefix hit actually saves); the cache dims then follow the model's config.
Times are medians of `--repeats` runs, one thread; loads are checked to restore the exact bytes.
"""

from __future__ import annotations

import os
import tempfile
from typing import Callable, Optional

import torch

from ..cache import CacheConfig, PagedCache
from ..errors import ConfigError
from ..ops import api as ops
from ..timing import median_seconds
from ..offload.disk import DiskTier
from ..offload.record import (BlockLayout, encode_record, header_bytes, read_block, section_offsets,
                     section_views, try_decode_record, write_block)
from ..offload.swapfile import SwapFileTier
from ..offload.tiers import MemoryTier, Tier
from .config import OffloadBench
from .toy import ToyLM

def _model_recompute(name: str, tokens: int, repeats: int) -> tuple[dict, float, str]:
    """(dims, median seconds of a forward over `tokens` token ids, label) for a model.

    Imports the eval layer lazily (only this optional measurement needs transformers)."""
    from ..eval.model import load_model, resolve_model_source

    lm = load_model(resolve_model_source(None if name == "embedded" else name))
    c = lm.model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    dims = {"layers": c.num_hidden_layers, "heads": c.num_key_value_heads, "head_dim": head_dim}
    ids = torch.randint(0, min(int(c.vocab_size), 30000), (1, tokens),
                        generator=torch.Generator().manual_seed(0))

    def fwd():
        with torch.no_grad():
            lm.model(ids, use_cache=False)

    return dims, median_seconds(fwd, repeats), lm.label


def _fill(cache: PagedCache, tokens: int, seed: int = 0) -> tuple[list[int], list]:
    """Store `tokens` seeded random K/V in every layer; returns (block ids, per-layer K/V)."""
    g = torch.Generator().manual_seed(seed)
    new = cache.add_sequence(list(range(tokens)) + [0])
    kv = []
    for li, pl in enumerate(cache.layers):
        k = torch.randn(tokens + 1, pl.num_kv_heads, pl.head_dim, generator=g)
        v = torch.randn(tokens + 1, pl.num_kv_heads, pl.head_dim, generator=g)
        cache.store(li, k, v, new.slot_mapping)
        kv.append((k, v))
    cache.commit(new.seq_id)
    nb = tokens // cache.block_size
    return list(cache.seqs.table(new.seq_id))[:nb], kv


def measure_tier(tier: Tier, cache: PagedCache, blocks: list[int], repeats: int) -> dict:
    """Write / load / swap-read times (s, medians) and bytes of `blocks` through `tier`."""
    layers, layout = cache.layers, BlockLayout.from_layers(cache.layers)
    keys = [f"bench-{b:08d}" for b in blocks]
    recs = {}

    def write():
        for key, b in zip(keys, blocks):
            rec = encode_record(layout, key.encode(), read_block(layers, b))
            tier.put(key, rec)
            recs[key] = len(rec)

    write_s = median_seconds(write, repeats)
    scratch = cache.pool.allocate_one()  # a pool block to load into
    want = [read_block(layers, b) for b in blocks]

    def load():
        for key, expect in zip(keys, want):
            sections = try_decode_record(tier.get(key), layout, key.encode())
            if sections is None:
                raise RuntimeError(f"bench: {tier.name} lost {key}")
            write_block(layers, scratch, sections)
        assert read_block(layers, scratch) == want[-1]

    load_s = median_seconds(load, repeats)

    heads = [header_bytes(layout, k.encode()) for k in keys]
    offsets = section_offsets(layout)

    def swap_read():  # what SwapSpace does per layer at every decode step
        for li, lay in enumerate(layout.layers):
            starts = [len(h) + offsets[li] for h in heads]
            if hasattr(tier, "read_ranges"):
                raws = tier.read_ranges(keys, starts, lay.section_bytes)
            else:
                raws = [tier.get_range(k, st, lay.section_bytes) for k, st in zip(keys, starts)]
            for raw, h in zip(raws, heads):
                if section_views(raw, h[-16:], li, lay.k_bytes, lay.v_bytes) is None:
                    raise RuntimeError(f"bench: {tier.name} returned a bad section")

    swap_s = median_seconds(swap_read, repeats)
    cache.pool.release(scratch)
    for key in keys:
        tier.delete(key)
    return {"write_s": write_s, "load_s": load_s, "swap_read_s": swap_s,
            "record_bytes": sum(recs.values())}


_D = OffloadBench  # the defaults


def run_bench(formats: list[str], *, tokens: int = _D.tokens, layers: int = _D.layers,
              kv_heads: int = _D.kv_heads, head_dim: int = _D.head_dim, block_size: int = _D.block_size,
              repeats: int = _D.repeats, redis_url: Optional[str] = _D.redis_url,
              disk_dir: Optional[str] = _D.disk_dir, model: Optional[str] = _D.model) -> dict:
    """Measure every format x tier; returns a JSON-ready dict (see module doc)."""
    torch.set_num_threads(1)
    for name, v in (("tokens", tokens), ("layers", layers), ("kv-heads", kv_heads),
                    ("head-dim", head_dim), ("block-size", block_size), ("repeats", repeats)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"--{name} must be a positive integer, got {v!r}")
    if tokens < block_size:
        raise ConfigError(f"--tokens ({tokens}) must be at least --block-size ({block_size})")
    if not formats:
        raise ConfigError("--formats needs at least one KV format")
    model_s, model_label = None, None
    if model:
        dims, model_s, model_label = _model_recompute(model, (tokens // block_size) * block_size,
                                                      repeats)
        layers, kv_heads, head_dim = dims["layers"], dims["heads"], dims["head_dim"]
    tmp = None
    if disk_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="pagedkv-bench-")
    disk_root = disk_dir or tmp.name
    tiers: list[tuple[str, Callable[[], Tier]]] = [
        ("memory", MemoryTier), ("disk", lambda: DiskTier(disk_root)),
        ("swapfile", lambda: SwapFileTier(os.path.join(disk_root, "swap")))]
    if redis_url:
        from ..offload.redis_tier import RedisTier

        tiers.append(("redis", lambda: RedisTier(redis_url, prefix="pagedkv-bench:")))
    bs = block_size
    n_blocks = tokens // bs
    bf16_per_token = 2 * 2 * layers * kv_heads * head_dim
    results = []
    try:
        for fmt in formats:
            cfg = CacheConfig(num_layers=layers, num_kv_heads=kv_heads,
                              head_dim=head_dim, kv_format=fmt, block_size=bs,
                              num_blocks=2 * n_blocks + 4, high_precision_layers=0)
            cache = PagedCache(cfg)
            blocks, kv = _fill(cache, n_blocks * bs)  # also warms the codec's tables up
            slots = cache.slot_mapping(cache.sequence_ids()[0], 0, n_blocks * bs)

            def restore():
                for li, (k, v) in enumerate(kv):
                    ops.store(cache.layers[li], k[:n_blocks * bs], v[:n_blocks * bs], slots)

            store_s = median_seconds(restore, repeats)
            toy_cache = PagedCache(cfg)
            model = ToyLM(toy_cache)
            prompt = [i % model.vocab for i in range(n_blocks * bs)]

            def toy_prefill():
                toy_cache.clear()
                new = toy_cache.add_sequence(prompt)
                model.forward(prompt, [new.seq_id], new.slot_mapping,
                              torch.tensor([0, len(prompt)], dtype=torch.int32))

            toy_prefill()
            toy_s = median_seconds(toy_prefill, repeats)
            for tier_name, make in tiers:
                tier = make()
                try:
                    m = measure_tier(tier, cache, blocks, repeats)
                finally:
                    tier.close()
                faults = tier.stats.faults
                ntok = n_blocks * bs
                results.append({
                    "format": cfg.layers[0].format.name, "tier": tier_name,
                    "bytes_per_token": m["record_bytes"] / ntok,
                    "vs_bf16": (m["record_bytes"] / ntok) / bf16_per_token,
                    "write_us_per_token": 1e6 * m["write_s"] / ntok,
                    "load_us_per_token": 1e6 * m["load_s"] / ntok,
                    "swap_read_us_per_token": 1e6 * m["swap_read_s"] / ntok,
                    "recompute_store_us_per_token": 1e6 * store_s / ntok,
                    "recompute_toy_us_per_token": 1e6 * toy_s / ntok,
                    "load_vs_store": store_s / m["load_s"],
                    "recompute_model_us_per_token": None if model_s is None else 1e6 * model_s / ntok,
                    "load_vs_model": None if model_s is None else model_s / m["load_s"],
                    "tier_faults": faults,
                })
    finally:
        if tmp is not None:
            tmp.cleanup()
    return {"tokens": n_blocks * bs, "layers": layers, "kv_heads": kv_heads,
            "head_dim": head_dim, "block_size": bs, "repeats": repeats,
            "bf16_bytes_per_token": bf16_per_token, "model": model_label, "results": results}


COLUMNS = ("format", "tier", "B/token", "vs bf16", "write us/tok", "load us/tok",
           "swap read us/tok", "recompute store us/tok", "toy prefill us/tok", "load speedup vs store")


def table(result: dict) -> tuple[str, tuple[str, ...], list[list]]:
    """(title, columns, rows) for printing `run_bench`'s result."""
    title = (f"offload: {result['tokens']}-token prefix, {result['layers']} layers x "
             f"{result['kv_heads']} kv heads x {result['head_dim']}, block {result['block_size']} "
             f"(median of {result['repeats']}, 1 thread; 'recompute store' is a lower bound)")
    cols = COLUMNS
    rows = [[r["format"], r["tier"], round(r["bytes_per_token"], 1), round(r["vs_bf16"], 3),
             r["write_us_per_token"], r["load_us_per_token"], r["swap_read_us_per_token"],
             r["recompute_store_us_per_token"], r["recompute_toy_us_per_token"],
             round(r["load_vs_store"], 2)] for r in result["results"]]
    if result.get("model"):
        title += f"; model: {result['model']}"
        cols = cols + ("model prefill us/tok", "load speedup vs model")
        for row, r in zip(rows, result["results"]):
            row += [r["recompute_model_us_per_token"], round(r["load_vs_model"], 1)]
    return title, cols, rows
