"""Triton kernels on latent (MLA) layers with one-codec rows `[latent | rope]`, under the
interpreter on CPU (tests/conftest.py sets TRITON_INTERPRET=1) or on CUDA when present.

The row is one KV head whose values are its keys (V_IS_K: the kernels reuse the decoded K tile as
V); head_dim L + R = 96 is not a power of two (the kernels pad the tile to 128 with masks;
turbo2g64, whose groups of 64 do not divide 96, takes 96 + 32).
Oracle: `pagedkv.ops.reference.latent` (decodes the pool in the original basis)."""

from __future__ import annotations

import pytest
import torch

from pagedkv.codecs import CODECS, get_codec
from pagedkv.ops import AttentionParams, make_layer
from pagedkv.ops import triton as tr
from pagedkv.ops.latent import (LatentSpec, latent_decode_attention, latent_prefill_attention,
                                latent_store, make_latent_layer)
from pagedkv.ops.triton.decode import values_are_keys
from pagedkv.ops.triton.spec import SUPPORT

pytestmark = pytest.mark.triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp32 products on a GPU (the registered default is bf16): the oracle comparisons are to fp32 rounding
BACKEND = tr.make_backend("fp32", name="triton-fp32-test") if DEVICE == "cuda" else tr.interpreter_backend()
L, R, BS, HQ = 64, 32, 8, 4
TOL = dict(atol=3e-5, rtol=1e-4)  # fp32 in another order than the oracle (and its inverse WHT)


def _dims(name: str) -> tuple[int, int]:
    """(latent, rope) dims of the test rows: L + R, or 96 + 32 for a codec whose scale groups do
    not divide L + R (turbo2g64: rows of whole groups of 64)."""
    return (L, R) if (L + R) % max(get_codec(name).group_size, 1) == 0 else (96, 32)


def _case(name: str, seed: int = 0):
    """Two sequences (19 and 7 tokens) stored through a shuffled block table."""
    g = torch.Generator().manual_seed(seed)
    codec = get_codec(name)
    lat, rope = _dims(name)
    layer = make_latent_layer(LatentSpec(lat, rope, codec, codec), 8, BS, latent_scale=0.02, device=DEVICE)
    lens = [19, 7]
    perm = torch.randperm(8, generator=g)
    tables = torch.zeros(2, 3, dtype=torch.int32)
    tables[0] = perm[:3].int()
    tables[1, :1] = perm[3:4].int()
    for b, n in enumerate(lens):
        c = torch.randn(n, lat, generator=g) * torch.exp(0.3 * torch.randn(lat, generator=g))
        r = torch.randn(n, rope, generator=g) * 2.0
        pos = torch.arange(n)
        latent_store(layer, c.to(DEVICE), r.to(DEVICE), (tables[b].long()[pos // BS] * BS + pos % BS).to(DEVICE))
    return layer, tables.to(DEVICE), torch.tensor(lens, dtype=torch.int32, device=DEVICE), g


def _check(name: str, params: AttentionParams, seed: int = 0, hq: int = HQ) -> None:
    layer, tables, lens, g = _case(name, seed)
    lat, rope = _dims(name)
    qd = [(torch.randn(2, hq, d, generator=g) * 0.5).to(DEVICE) for d in (lat, rope)]
    qsl = torch.tensor([0, 5, 8], dtype=torch.int32, device=DEVICE)
    qp = [(torch.randn(8, hq, d, generator=g) * 0.5).to(DEVICE) for d in (lat, rope)]
    ref_d = latent_decode_attention(*qd, layer, tables, lens, params, backend="reference")
    ref_p = latent_prefill_attention(*qp, layer, tables, lens, qsl, params, backend="reference")
    out_d = latent_decode_attention(*qd, layer, tables, lens, params, backend=BACKEND)
    out_p = latent_prefill_attention(*qp, layer, tables, lens, qsl, params, backend=BACKEND)
    assert out_d.shape == (2, hq, lat) and out_p.shape == (8, hq, lat)
    torch.testing.assert_close(out_d, ref_d, **TOL)
    torch.testing.assert_close(out_p, ref_p, **TOL)


@pytest.mark.parametrize("name", [n for n, c in CODECS.items() if SUPPORT.refusal(c, store=False) is None])
def test_every_codec_matches_the_latent_oracle(name):
    """Every row the kernels read (`spec.SUPPORT`; f16 runs on the reference)."""
    _check(name, AttentionParams(scale=0.3))


def test_window_soft_cap_sinks_and_sparse_v():
    sinks = torch.linspace(-1.0, 2.0, HQ, device=DEVICE)
    _check("turbo3", AttentionParams(scale=0.3, sliding_window=6, soft_cap=8.0, sinks=sinks), seed=1)
    # sparse V: the second pass reuses the K tile as V (no V read at all)
    _check("fp8", AttentionParams(scale=0.3, soft_cap=8.0, sinks=sinks, sparse_v_threshold=0.02), seed=2)


def test_sixteen_heads_on_the_row():
    """16 query heads per row (DeepSeek shards have 16-128): decode takes 8-key tiles."""
    _check("q4_0", AttentionParams(scale=0.3, sinks=torch.zeros(16, device=DEVICE)), seed=3, hq=16)


def test_values_are_keys_only_for_one_pool():
    layer, *_ = _case("q4_0")
    assert values_are_keys(layer.sections()[0])
    kv = make_layer(get_codec("q4_0"), get_codec("q4_0"), num_blocks=2, block_size=BS, num_kv_heads=1, head_dim=96, device=DEVICE)
    assert not values_are_keys(kv)  # separate K and V pools: V is read from its own pool
    mixed = make_latent_layer(LatentSpec(L, R, get_codec("turbo3"), get_codec("bf16")), 2, BS, device=DEVICE)
    assert all(values_are_keys(s) for s in mixed.sections())  # each section is its own K = V pool


def test_cuda_dispatch_of_latent_rows():
    """On CUDA tensors the automatic latent path (`ops.latent._fused`) takes the registered
    Triton backend for one-codec rows up to 256 dims; 512 + 64 rows are declined (the padded
    1024-wide tile spills, tests/triton_compile_check.py) and run the chunked torch path."""
    from pagedkv.ops import Op, select_backend

    p = AttentionParams(scale=0.1)
    for lat, rope, want in ((L, R, "triton"), (128, 64, "triton"), (512, 64, "reference")):
        codec = get_codec("turbo3")
        sec = make_latent_layer(LatentSpec(lat, rope, codec, codec), 2, BS).sections()[0]
        for op in (Op.DECODE, Op.PREFILL):
            assert select_backend(op, torch.device("cuda"), sec, p, None).name == want
