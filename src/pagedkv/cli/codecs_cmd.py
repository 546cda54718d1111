"""`pagedkv codecs [--bench]`: the catalogue, and each codec's error and speed on seeded data.

--bench: the normalised MSE of seeded vectors beside the rate-distortion limit and the reference
encode/decode throughput, 1 thread (harness: `pagedkv.bench.codecs`).
"""

from __future__ import annotations

import argparse

from .output import print_json, print_table


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("codecs", help="the codec catalogue; --bench measures error and speed")
    p.add_argument("--bench", action="store_true", help="measure normalised MSE and throughput")
    p.add_argument("--vectors", type=int, default=4096, help="vectors per distribution (default 4096)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", action="store_true")
    return p


def run(args) -> int:
    from ..codecs import CODECS

    if not args.bench:
        rows = [{"codec": c.name, "bits_per_element": c.bits_per_element, "description": c.description}
                for c in CODECS.values()]
        if args.json:
            print_json(rows)
        else:
            print_table("Codecs", ["codec", "bits/elem", "description"],
                        [[r["codec"], r["bits_per_element"], r["description"]] for r in rows])
        return 0
    from ..bench.codecs import HEAD_DIM, bench

    rows = bench(args.vectors, args.repeats)
    if args.json:
        print_json(rows)
        return 0
    print_table(
        f"Codec error and reference speed ({args.vectors} vectors x head_dim {HEAD_DIM}, 1 thread)",
        ["codec", "distribution", "bits/elem", "nmse", "rd limit 4^-bits", "encode Melem/s", "decode Melem/s"],
        [[r["codec"], r["distribution"], r["bits_per_element"], r["nmse"], r["rd_limit"],
          r["encode_melem_s"], r["decode_melem_s"]] for r in rows],
    )
    return 0
