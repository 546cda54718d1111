"""`pagedkv codecs [--bench]`: the catalogue, and each codec's error and speed on seeded data.

The bench encodes seeded vectors (head_dim 128) from two distributions: iid N(0,1), and
"outliers" (N(0,1) with 4 fixed channels scaled x20, like the heavy channels of real keys). It
prints the normalised MSE `sum (x - x')^2 / sum x^2` beside the rate-distortion limit
`4**-bits` (bits = stored bits per element, scales included), and encode/decode throughput of
the reference implementation (median of repeats, 1 thread).
"""

from __future__ import annotations

import argparse

import torch

from ..codecs import CODECS, decode, encode
from ..timing import median_seconds
from .output import print_json, print_table

HEAD_DIM = 128
OUTLIER_CHANNELS = (3, 40, 77, 121)


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("codecs", help="the codec catalogue; --bench measures error and speed")
    p.add_argument("--bench", action="store_true", help="measure normalised MSE and throughput")
    p.add_argument("--vectors", type=int, default=4096, help="vectors per distribution (default 4096)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", action="store_true")
    return p


def sample(distribution: str, n: int, seed: int = 0) -> torch.Tensor:
    """Seeded float32 [n, 128] vectors of the named distribution ("gaussian" | "outliers")."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, HEAD_DIM, generator=gen)
    if distribution == "outliers":
        x[:, list(OUTLIER_CHANNELS)] *= 20.0
    return x


def nmse(x: torch.Tensor, y: torch.Tensor) -> float:
    return float(((x - y) ** 2).sum() / (x**2).sum())


def bench(vectors: int, repeats: int) -> list[dict]:
    rows = []
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for dist in ("gaussian", "outliers"):
            x = sample(dist, vectors)
            ts = float(x.abs().max()) / 448.0  # fp8's per-tensor scale: amax maps to the E4M3 max
            for codec in CODECS.values():
                data, scales = encode(codec, x, ts)  # first call also fits codebooks
                y = decode(codec, data, scales, HEAD_DIM, ts)
                enc = median_seconds(lambda: encode(codec, x, ts), repeats)
                dec = median_seconds(lambda: decode(codec, data, scales, HEAD_DIM, ts), repeats)
                rows.append({
                    "codec": codec.name,
                    "distribution": dist,
                    "bits_per_element": codec.bits_per_element,
                    "nmse": nmse(x, y),
                    "rd_limit": 4.0 ** -codec.bits_per_element,
                    "encode_melem_s": x.numel() / enc / 1e6,
                    "decode_melem_s": x.numel() / dec / 1e6,
                })
    finally:
        torch.set_num_threads(prev)
    return rows


def run(args) -> int:
    if not args.bench:
        rows = [{"codec": c.name, "bits_per_element": c.bits_per_element, "description": c.description}
                for c in CODECS.values()]
        if args.json:
            print_json(rows)
        else:
            print_table("Codecs", ["codec", "bits/elem", "description"],
                        [[r["codec"], r["bits_per_element"], r["description"]] for r in rows])
        return 0
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
