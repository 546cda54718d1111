"""Latent (MLA) layers: layout arithmetic, store, and absorbed attention of every path vs oracles.

Oracles: `pagedkv.ops.reference.latent` (decodes the pool in the original basis), and an fp64
dense computation over the codec round trip of the same rows (independent of pool layout, block
tables and the gather code)."""

from __future__ import annotations

import pytest
import torch

from pagedkv.cache.config import CacheConfig
from pagedkv.cache.latent import LatentLayout
from pagedkv.codecs import CODECS, get_codec, roundtrip
from pagedkv.errors import ConfigError, InvalidInput
from pagedkv.ops import AttentionParams
from pagedkv.ops.latent import (LatentSpec, latent_decode_attention, latent_prefill_attention,
                                latent_store, make_latent_layer)

L, R, BS = 64, 32, 16  # small dims keep the test fast; 512 + 64 is checked by the layout tests

# uniform rows where the codec stores L + R dims, else its latent with a q8_0 rope (turbo2g64: groups of 64)
SPECS = [(c, c) if (L + R) % max(CODECS[c].group_size, 1) == 0 else (c, "q8_0") for c in CODECS] + [
    ("turbo3", "bf16"), ("fp8", "q8_0"), ("q4_0", "q8_0")]
SETTINGS = {
    "plain": AttentionParams(scale=0.3),
    "window_cap_sinks": AttentionParams(scale=0.3, sliding_window=21, soft_cap=8.0,
                                        sinks=torch.linspace(-1.0, 2.0, 6)),
}


def _case(latent: str, rope: str, seed: int = 0):
    """Two sequences (45 and 18 tokens) stored through a shuffled block table."""
    g = torch.Generator().manual_seed(seed)
    spec = LatentSpec(L, R, get_codec(latent), get_codec(rope))
    layer = make_latent_layer(spec, 12, BS, latent_scale=0.02, rope_scale=0.03)
    lens = [45, 18]
    perm = torch.randperm(12, generator=g)
    tables = torch.zeros(2, 4, dtype=torch.int32)
    tables[0, :3] = perm[:3].int()
    tables[1, :2] = perm[3:5].int()
    cs, rs = [], []
    for b, n in enumerate(lens):
        c = torch.randn(n, L, generator=g) * torch.exp(0.3 * torch.randn(L, generator=g))
        r = torch.randn(n, R, generator=g) * 2.0
        pos = torch.arange(n)
        latent_store(layer, c, r, tables[b].long()[pos // BS] * BS + pos % BS)
        cs.append(c)
        rs.append(r)
    return layer, tables, torch.tensor(lens, dtype=torch.int32), cs, rs, g


def _dense(spec, c, r, q_lat, q_rope, pos, params):
    """fp64 attention over the codec round trip of one sequence's rows -> [Tq, Hq, L]."""
    if spec.uniform:
        row = roundtrip(spec.latent_codec, torch.cat([c, r], -1), 0.02)
        c, r = row[:, :L], row[:, L:]
    else:
        c, r = roundtrip(spec.latent_codec, c, 0.02), roundtrip(spec.rope_codec, r, 0.03)
    c, r = c.double(), r.double()
    s = (torch.einsum("thl,nl->htn", q_lat.double(), c) + torch.einsum("thr,nr->htn", q_rope.double(), r))
    s = s * params.scale
    if params.soft_cap:
        s = params.soft_cap * torch.tanh(s / params.soft_cap)
    kp = torch.arange(c.shape[0])
    vis = kp[None] <= pos[:, None]
    if params.sliding_window:
        vis &= kp[None] > pos[:, None] - params.sliding_window
    s = s.masked_fill(~vis, float("-inf"))
    if params.sinks is not None:
        sk = params.sinks.double().reshape(-1, 1, 1).expand(-1, s.shape[1], 1)
        s = torch.cat([s, sk], -1)
    p = torch.softmax(s, -1)
    if params.sinks is not None:
        p = p[..., :-1]
    return torch.einsum("htn,nl->thl", p, c)


@pytest.mark.parametrize("latent,rope", SPECS, ids=[f"{a}+{b}" for a, b in SPECS])
def test_every_path_matches_the_oracles(latent, rope):
    layer, tables, lens, cs, rs, g = _case(latent, rope)
    hq = 6
    qd_lat, qd_rope = torch.randn(2, hq, L, generator=g) * 0.5, torch.randn(2, hq, R, generator=g) * 0.5
    qsl = torch.tensor([0, 9, 14], dtype=torch.int32)
    qp_lat, qp_rope = torch.randn(14, hq, L, generator=g) * 0.5, torch.randn(14, hq, R, generator=g) * 0.5
    for params in SETTINGS.values():
        ref_d = latent_decode_attention(qd_lat, qd_rope, layer, tables, lens, params, backend="reference")
        ref_p = latent_prefill_attention(qp_lat, qp_rope, layer, tables, lens, qsl, params,
                                         backend="reference")
        # the oracle vs fp64 dense attention over the codec round trip
        for b, n in enumerate(lens.tolist()):
            d = _dense(layer.spec, cs[b], rs[b], qd_lat[b:b + 1], qd_rope[b:b + 1], torch.tensor([n - 1]), params)
            torch.testing.assert_close(ref_d[b:b + 1].double(), d, atol=2e-5, rtol=1e-4)
            lo, hi = qsl[b].item(), qsl[b + 1].item()
            d = _dense(layer.spec, cs[b], rs[b], qp_lat[lo:hi], qp_rope[lo:hi],
                       torch.arange(n - (hi - lo), n), params)
            torch.testing.assert_close(ref_p[lo:hi].double(), d, atol=2e-5, rtol=1e-4)
        # automatic (fused kernel for uniform rows) and the chunked torch path vs the oracle
        for backend in (None, "chunked"):
            out_d = latent_decode_attention(qd_lat, qd_rope, layer, tables, lens, params, backend=backend)
            out_p = latent_prefill_attention(qp_lat, qp_rope, layer, tables, lens, qsl, params, backend=backend)
            torch.testing.assert_close(out_d, ref_d, atol=2e-5, rtol=1e-4)
            torch.testing.assert_close(out_p, ref_p, atol=2e-5, rtol=1e-4)


def test_uniform_rows_run_on_the_cpu_kernel():
    from pagedkv.ops import cpu

    if not cpu.available():
        pytest.skip(f"CPU kernel unavailable: {cpu.kernel_info()}")
    layer, tables, lens, *_ , g = _case("turbo3", "turbo3")
    q_lat, q_rope = torch.randn(2, 4, L, generator=g), torch.randn(2, 4, R, generator=g)
    p = AttentionParams(scale=0.2, sinks=torch.zeros(4))
    ref = latent_decode_attention(q_lat, q_rope, layer, tables, lens, p, backend="reference")
    out = latent_decode_attention(q_lat, q_rope, layer, tables, lens, p, backend="cpu")
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    with pytest.raises(InvalidInput):  # a mixed layout is not one codec row: the kernel cannot read it
        mixed, t2, l2, *_ = _case("turbo3", "bf16")
        latent_decode_attention(q_lat, q_rope, mixed, t2, l2, p, backend="cpu")


def test_padding_row_and_chunk_boundaries():
    import pagedkv.ops.latent as lat

    layer, tables, lens, *_, g = _case("turbo4", "turbo4")
    lens0 = torch.tensor([45, 0], dtype=torch.int32)
    q_lat, q_rope = torch.randn(2, 3, L, generator=g), torch.randn(2, 3, R, generator=g)
    p = AttentionParams(scale=0.2, sliding_window=30)
    ref = latent_decode_attention(q_lat, q_rope, layer, tables, lens0, p, backend="reference")
    assert torch.count_nonzero(ref[1]) == 0
    old = lat.CHUNK_TOKENS
    try:
        lat.CHUNK_TOKENS = BS  # one block per chunk: exercises the online softmax across chunks
        out = latent_decode_attention(q_lat, q_rope, layer, tables, lens0, p, backend="chunked")
    finally:
        lat.CHUNK_TOKENS = old
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_bad_input_raises_before_any_write():
    layer, tables, lens, *_ = _case("turbo3", "bf16")
    before = layer.pool.clone()
    slots = torch.tensor([0, 1], dtype=torch.int64)
    with pytest.raises(InvalidInput, match="rope"):
        latent_store(layer, torch.randn(2, L), torch.randn(2, R + 1), slots)
    bad = torch.randn(2, R)
    bad[1, 3] = float("nan")
    with pytest.raises(InvalidInput):
        latent_store(layer, torch.randn(2, L), bad, slots)
    assert torch.equal(layer.pool, before)
    with pytest.raises(InvalidInput, match="q_lat"):
        latent_decode_attention(torch.randn(2, 4, L + 16), torch.randn(2, 4, R), layer, tables, lens,
                                AttentionParams(scale=1.0))
    with pytest.raises(InvalidInput, match="sinks"):
        latent_decode_attention(torch.randn(2, 4, L), torch.randn(2, 4, R), layer, tables, lens,
                                AttentionParams(scale=1.0, sinks=torch.zeros(3)))


def test_layout_arithmetic_and_rope_choice():
    # DeepSeek-V3 dims: 512 latent + 64 rope per token, per layer, NOT per head
    for name, per_token in (("bf16", 576 * 2), ("turbo3", 576 * 3 / 8 + 576 / 16),
                            ("turbo4", 576 / 2 + 576 / 16), ("q4_0", 576 / 2 + 576 / 32 * 2)):
        c = get_codec(name)
        spec = LatentSpec(512, 64, c, c)
        assert spec.uniform and spec.bytes_per_token() == per_token
        assert spec.block_bytes(16) == c.block_bytes(16, 1, 576)
    mixed = LatentSpec(512, 64, get_codec("turbo3"), get_codec("bf16"))
    assert mixed.block_bytes(16) == get_codec("turbo3").block_bytes(16, 1, 512) + 16 * 64 * 2
    # rope codec "auto" follows the measurement (benchmarks/studies/mla_rope_precision.py)
    auto = LatentLayout(512, 64)
    from pagedkv.formats import parse_format
    assert auto.spec(parse_format("fp8")).name == "fp8+q8_0rope"
    assert auto.spec(parse_format("turbo8")).name == "turbo8+q8_0rope"
    assert auto.spec(parse_format("turbo3")).name == "turbo3"
    assert auto.spec(parse_format("bf16k_turbo3v")).name == "bf16"  # the more precise side
    assert LatentLayout(512, 16).spec(parse_format("fp8")).name == "fp8"  # q8_0 needs 32 | rope_dim
    assert LatentLayout(512, 64, "same").spec(parse_format("fp8")).name == "fp8"
    cfg = CacheConfig(num_layers=4, num_kv_heads=1, head_dim=1, kv_format="turbo4",
                      high_precision_layers=1, hp_format="bf16", latent=LatentLayout(512, 64),
                      num_blocks=1)
    per_block = [s.k_block_bytes for s in cfg.layers]
    assert per_block == [16 * 1152, get_codec("turbo4").block_bytes(16, 1, 576),
                         get_codec("turbo4").block_bytes(16, 1, 576), 16 * 1152]
    assert cfg.bytes_per_block == sum(per_block) and all(s.v_block_bytes == 0 for s in cfg.layers)
    plain = CacheConfig(num_layers=4, num_kv_heads=1, head_dim=576, kv_format="turbo4",
                        high_precision_layers=1, num_blocks=1)
    assert plain.fingerprint != cfg.fingerprint
    with pytest.raises(ConfigError, match="latent_dim"):
        LatentLayout(0, 64)
    with pytest.raises(ConfigError):
        LatentSpec(500, 64, get_codec("turbo3"), get_codec("turbo3"))  # 564 is not a multiple of 16


def test_automatic_uses_chunked_when_only_the_reference_serves_the_row(monkeypatch):
    """e.g. CUDA with 512 + 64 rows: Triton takes head_dim <= 256; the chunked path beats the
    reference (which decodes whole sequences at once)."""
    import pagedkv.ops.latent as lat
    from pagedkv.ops.dispatch import get_backend

    layer, tables, lens, *_, g = _case("q4_0", "q4_0")
    q_lat, q_rope = torch.randn(2, 3, L, generator=g), torch.randn(2, 3, R, generator=g)
    p = AttentionParams(scale=0.2)
    ref = latent_decode_attention(q_lat, q_rope, layer, tables, lens, p, backend="reference")
    monkeypatch.setattr(lat, "select_backend", lambda *a: get_backend("reference"))

    def boom(*a, **k):
        raise AssertionError("the generic ops were called")

    monkeypatch.setattr(lat.api, "decode_attention", boom)
    out = latent_decode_attention(q_lat, q_rope, layer, tables, lens, p)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["fp8", "q8_0"])
def test_fast_row_decoders_equal_the_reference(name):
    from pagedkv.codecs import reference as codec_ref
    from pagedkv.ops.latent import decode_rows

    codec = get_codec(name)
    g = torch.Generator().manual_seed(7)
    d = 64
    rows = torch.randint(0, 256, (300, codec.row_data_bytes(d)), dtype=torch.uint8, generator=g)
    rows[:256, 0] = torch.arange(256, dtype=torch.uint8)  # every code
    _, scales = codec_ref.encode(codec, torch.randn(300, d, generator=g))
    ts = 0.37 if name == "fp8" else None
    want = codec_ref.decode(codec, rows, scales, d, ts, rotated_basis=True)
    assert torch.equal(decode_rows(codec, rows, scales, d, ts), want)
