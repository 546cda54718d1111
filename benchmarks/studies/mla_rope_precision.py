"""Which codec should the rope part of a latent (MLA) layer use? Measure, do not guess.

For every latent codec of the catalogue and a few rope codecs (the same codec = uniform layout,
q8_0, bf16), store synthetic but realistically shaped DeepSeek-like latents through the codec
round trip (exactly the stored values: uniform rows [latent | rope] are encoded as one row,
mixed layouts per part) and compare absorbed attention outputs with fp32 attention on the
unquantized data. Prints bytes/token and the relative output error ||o - o32|| / ||o32|| (median
over heads x queries, and the mean), for decode queries over a 2048-token context.

Data (seeded): latent = RMSNorm output (unit RMS per token, a shared component as real latents
have) times a log-normal per-channel gain; rope keys = RoPE(position) of a per-pair log-normal
amplitude times (a fixed direction + noise), half-split pairs, theta 10000; queries scaled so the
latent logits have std 2.0 and the rope logits std 1.2 across keys (moderately peaked softmax).

    .venv/bin/python benchmarks/studies/mla_rope_precision.py [--tokens 2048] [--heads 16] [--seed 0]
"""

from __future__ import annotations

import argparse

import torch

from pagedkv.codecs import CODECS, roundtrip
from pagedkv.ops.latent_layer import LatentSpec

L, R = 512, 64


def make_data(n: int, hq: int, nq: int, seed: int, rope_spread: float = 0.6, rope_std: float = 1.2):
    g = torch.Generator().manual_seed(seed)
    randn = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    shared = randn(L)
    z = 0.6 * shared + randn(n, L)
    z = z / z.pow(2).mean(-1, keepdim=True).sqrt()
    gain = torch.exp(0.4 * randn(L))
    c = z * gain
    amp = torch.exp(rope_spread * randn(R // 2)).repeat(2)
    base = randn(R)
    b = amp * (base + 0.5 * randn(n, R))
    inv = 10000.0 ** (-torch.arange(0, R, 2).float() / R)
    ang = torch.arange(n).float()[:, None] * inv[None, :]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    rot = torch.cat([-b[:, R // 2:], b[:, : R // 2]], -1)
    r = b * cos + rot * sin
    q_lat = randn(nq, hq, L) * gain
    q_rope = randn(nq, hq, R) * amp
    # scale each head's queries to the target logit spread over the keys
    s_lat = torch.einsum("qhl,nl->qhn", q_lat, c).std(-1, keepdim=True)
    s_rope = torch.einsum("qhr,nr->qhn", q_rope, r).std(-1, keepdim=True)
    return c, r, q_lat * (2.0 / s_lat), q_rope * (rope_std / s_rope)


def attention(q_lat, q_rope, c, r):
    s = torch.einsum("qhl,nl->qhn", q_lat, c) + torch.einsum("qhr,nr->qhn", q_rope, r)
    return torch.einsum("qhn,nl->qhl", torch.softmax(s, -1), c)


def stored(spec: LatentSpec, c, r):
    """The values a layer with `spec` stores (fp8: tensor scale = 2 * amax / 448 per section)."""
    def rt(codec, x):
        ts = 2.0 * float(x.abs().amax()) / 448.0 if codec.name == "fp8" else None
        return roundtrip(codec, x, ts)
    if spec.uniform:
        row = rt(spec.latent_codec, torch.cat([c, r], -1))
        return row[:, :L], row[:, L:]
    return rt(spec.latent_codec, c), rt(spec.rope_codec, r)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--queries", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rope-spread", type=float, default=0.6, help="log-normal sigma of rope pair amplitudes")
    ap.add_argument("--rope-logit-std", type=float, default=1.2, help="std of the rope logits over keys")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    c, r, ql, qr = make_data(args.tokens, args.heads, args.queries, args.seed,
                                args.rope_spread, args.rope_logit_std)
    ref = attention(ql, qr, c, r)
    print(f"latent {L} + rope {R}, {args.tokens} tokens, {args.heads} heads x {args.queries} queries, "
          f"rope spread {args.rope_spread}, rope logit std {args.rope_logit_std}")
    print(f"{'layout':22s} {'B/token':>8s} {'median rel err':>15s} {'mean rel err':>13s}")
    for name, codec in CODECS.items():
        for rope in dict.fromkeys((name, "q8_0", "bf16")):
            spec = LatentSpec(L, R, codec, CODECS[rope])
            cs, rs = stored(spec, c, r)
            out = attention(ql, qr, cs, rs)
            err = (out - ref).norm(dim=-1) / ref.norm(dim=-1)
            print(f"{spec.name:22s} {spec.bytes_per_token():8.1f} {float(err.median()):15.5f} "
                  f"{float(err.mean()):13.5f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
