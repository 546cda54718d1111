"""Each codec's error and reference speed on seeded data (`pagedkv codecs --bench`).

Seeded vectors (head_dim 128) from two distributions: iid N(0,1), and "outliers" (N(0,1) with 4
fixed channels scaled x20, like the heavy channels of real keys). Rows: the normalised MSE
`sum (x - x')^2 / sum x^2` beside the rate-distortion limit `4**-bits` (bits = stored bits per
element, scales included), and encode/decode throughput of the reference implementation
(median of repeats, 1 thread).
"""

from __future__ import annotations

import torch

from ..codecs import CODECS, decode, encode
from ..errors import ConfigError
from ..timing import median_seconds

HEAD_DIM = 128
OUTLIER_CHANNELS = (3, 40, 77, 121)


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
    for name, v, most in (("--vectors", vectors, 1 << 20), ("--repeats", repeats, 1000)):
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= most:
            raise ConfigError(f"{name} must be an integer in [1, {most}], got {v!r}")
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
