"""`pagedkv bench offload`: bytes and read-back time per storage tier and format, vs recomputing
the prefix (harness: `pagedkv.bench.offload`)."""

from __future__ import annotations

import argparse

from ...bench.config import OffloadBench
from ..output import print_json, print_table
from ..sizes import parse_names

D = OffloadBench()


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("offload", help="storage tiers: bytes and read-back time vs recomputing",
                       description=__doc__)
    p.add_argument("--formats", default=",".join(D.formats), help=f"KV formats (default {','.join(D.formats)})")
    p.add_argument("--tokens", type=int, default=D.tokens, help=f"prefix tokens (default {D.tokens})")
    p.add_argument("--layers", type=int, default=D.layers, help=f"layers (default {D.layers})")
    p.add_argument("--kv-heads", type=int, default=D.kv_heads, help=f"KV heads (default {D.kv_heads})")
    p.add_argument("--head-dim", type=int, default=D.head_dim, help=f"head dim (default {D.head_dim})")
    p.add_argument("--block-size", type=int, default=D.block_size, help=f"tokens per block (default {D.block_size})")
    p.add_argument("--repeats", type=int, default=D.repeats, help=f"timed repeats, median (default {D.repeats})")
    p.add_argument("--redis-url", default=D.redis_url,
                   help="also measure a Redis tier at this URL (redis://host:port/db)")
    p.add_argument("--disk-dir", default=D.disk_dir,
                   help="directory of the disk tier (default: a temporary directory)")
    p.add_argument("--model", default=D.model,
                   help="also time a forward of this model over the prefix ('embedded' or a path); "
                        "the cache dims then follow its config")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    return p


def run(args) -> int:
    formats = parse_names(args.formats)
    from ...bench import offload as ob

    res = ob.run_bench(formats, tokens=args.tokens, layers=args.layers, kv_heads=args.kv_heads,
                       head_dim=args.head_dim, block_size=args.block_size, repeats=args.repeats,
                       redis_url=args.redis_url, disk_dir=args.disk_dir, model=args.model)
    print_json(res) if args.json else print_table(*ob.table(res))
    return 0
