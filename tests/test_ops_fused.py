"""Fused K path (RMSNorm -> RoPE -> store) against transformers' own functions and an unfused
composition; V-only store."""

from __future__ import annotations

import pytest
import torch

from pagedkv.codecs import CODECS
from pagedkv.codecs import reference as codec_ref
from pagedkv.codecs.layout import block_views
from pagedkv.errors import ConfigError, InvalidInput
from pagedkv.ops import NormSpec, RopeSpec, make_layer, norm_rope, store, store_k_fused, store_v
from pagedkv.ops.fused import apply_rope



def _hf(model: str):
    """transformers' modeling module, imported lazily: importing it imports Triton, which must
    not happen at collection time before tests/test_triton.py sets TRITON_INTERPRET."""
    return pytest.importorskip(f"transformers.models.{model}.modeling_{model}")


def _hf_cos_sin(positions, rotary_dim, theta):
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _decoded(layer, side="k"):
    codec = getattr(layer, f"{side}_codec")
    data, scales = block_views(codec, getattr(layer, f"{side}_pool"), layer.block_size, layer.num_kv_heads, layer.head_dim)
    return codec_ref.decode(codec, data, scales, layer.head_dim).reshape(-1, layer.num_kv_heads, layer.head_dim)


def test_rope_matches_transformers_llama():
    torch.manual_seed(0)
    x = torch.randn(9, 4, 128)
    pos = torch.tensor([0, 1, 2, 7, 100, 4095, 32000, 5, 6])
    cos, sin = _hf_cos_sin(pos, 128, 500000.0)
    want, _ = _hf("llama").apply_rotary_pos_emb(x, x, cos, sin, unsqueeze_dim=1)
    got = apply_rope(x, pos, RopeSpec(theta=500000.0))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_partial_rope_matches_transformers_phi3():
    torch.manual_seed(1)
    x = torch.randn(6, 2, 96)
    pos = torch.arange(10, 16)
    cos, sin = _hf_cos_sin(pos, 32, 10000.0)
    want, _ = _hf("phi3").apply_rotary_pos_emb(x, x, cos, sin, unsqueeze_dim=1)
    got = apply_rope(x, pos, RopeSpec(theta=10000.0, rotary_dim=32))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[..., 32:], x[..., 32:])


class _Section:  # stands in for the rotary module's `self` in recomposition_frequencies
    def __init__(self, section):
        self.mrope_section = section


@pytest.mark.parametrize("section", [None, (24, 20, 20)])
def test_interleaved_mrope_matches_transformers_qwen3_vl(section):
    qwen3_vl = _hf("qwen3_vl")
    torch.manual_seed(2)
    t, d, theta = 7, 128, 5000000.0
    pos3 = torch.randint(0, 300, (3, t))
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    freqs = pos3[:, None, :, None].float() * inv_freq  # [3, 1, T, 64]
    sec = section or (64 // 3 + 1, 64 // 3 + 1, 64 // 3 + 1)  # large enough: pure i mod 3
    recompose = qwen3_vl.Qwen3VLTextRotaryEmbedding.recomposition_frequencies
    cos = recompose(_Section(list(sec)), freqs.cos())[0]
    sin = recompose(_Section(list(sec)), freqs.sin())[0]
    x = torch.randn(t, 2, d)
    want, _ = _hf("llama").apply_rotary_pos_emb(x, x, cos, sin, unsqueeze_dim=1)
    got = apply_rope(x, pos3, RopeSpec(theta=theta, multimodal=True, mrope_section=section))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # identical streams reduce to plain RoPE
    same = torch.stack([pos3[0]] * 3)
    torch.testing.assert_close(apply_rope(x, same, RopeSpec(theta=theta, multimodal=True)),
                               apply_rope(x, pos3[0], RopeSpec(theta=theta)))


def test_norm_matches_transformers_qwen3_rmsnorm():
    torch.manual_seed(3)
    norm = _hf("qwen3").Qwen3RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(64) + 0.5)
    x = torch.randn(5, 3, 64) * 4
    got = norm_rope(x, None, NormSpec(norm.weight.detach(), eps=1e-6), None)
    torch.testing.assert_close(got, norm(x).detach(), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("codec", ["bf16", "turbo3", "fp8"])
def test_fused_store_equals_unfused_transformers_composition(codec):
    """Qwen3-style k path (k_norm then RoPE), fp32 throughout, then store: same pool contents."""
    torch.manual_seed(4)
    h, d, bs = 2, 64, 16
    weight = torch.rand(d) + 0.5
    k = (torch.randn(20, h, d) * 3).bfloat16()
    pos = torch.arange(100, 120)
    slots = torch.arange(20)
    fused = make_layer(CODECS[codec], CODECS["bf16"], 2, bs, h, d)
    stored = store_k_fused(fused, k, slots, pos, norm=NormSpec(weight, 1e-6), rope=RopeSpec(theta=1e6))

    hf_norm = _hf("qwen3").Qwen3RMSNorm(d, eps=1e-6)
    with torch.no_grad():
        hf_norm.weight.copy_(weight)
    cos, sin = _hf_cos_sin(pos, d, 1e6)
    k_hf, _ = _hf("llama").apply_rotary_pos_emb(hf_norm(k.float()).detach(), k.float(), cos, sin, unsqueeze_dim=1)
    unfused = make_layer(CODECS[codec], CODECS["bf16"], 2, bs, h, d)
    store(unfused, k_hf, None, slots)
    torch.testing.assert_close(stored, k_hf, atol=1e-5, rtol=1e-5)
    a, b = _decoded(fused)[:20], _decoded(unfused)[:20]
    differing = float((a != b).float().mean())
    assert differing < 0.01, differing  # only rounding ties of 1e-7 fp32 differences may flip a code
    step = (a - b).abs().max()
    assert float(step) <= float((a - k_hf).abs().max()) * 2 + 1e-6


def test_fused_rounds_once_and_beats_a_bf16_unfused_path():
    """fp32 between norm and RoPE: closer to the fp64 truth than rounding to bf16 after each step."""
    torch.manual_seed(5)
    h, d = 2, 128
    weight = torch.rand(d) + 0.5
    k = torch.randn(64, h, d).bfloat16()
    pos = torch.arange(1000, 1064)
    spec_n, spec_r = NormSpec(weight, 1e-6), RopeSpec(theta=1e6)
    truth = norm_rope(k.double(), pos, spec_n, spec_r).double()  # fp32 path in double input
    layer = make_layer(CODECS["bf16"], CODECS["bf16"], 4, 16, h, d)
    store_k_fused(layer, k, torch.arange(64), pos, norm=spec_n, rope=spec_r)
    fused_err = (_decoded(layer)[:64].double() - truth).pow(2).mean()
    step = norm_rope(k, pos, spec_n, None).bfloat16()  # what a bf16 model does: round after the norm
    unfused = apply_rope(step, pos, spec_r).bfloat16()
    unfused_err = (unfused.double() - truth).pow(2).mean()
    assert fused_err < 0.8 * unfused_err, (float(fused_err), float(unfused_err))


def test_store_v_writes_only_v_and_skips_negative_slots():
    layer = make_layer(CODECS["turbo3"], CODECS["turbo4"], 2, 16, 2, 64)
    v = torch.randn(4, 2, 64)
    store_v(layer, v, torch.tensor([3, -1, 5, -1]))
    assert int(layer.k_pool.abs().sum()) == 0
    got = _decoded(layer, "v")
    torch.testing.assert_close(got[[3, 5]], codec_ref.roundtrip(layer.v_codec, v[[0, 2]]))
    assert int(got[[0, 1, 2, 4, 6]].abs().sum()) == 0


def test_fused_rejects_bad_settings():
    layer = make_layer(CODECS["turbo3"], CODECS["turbo4"], 2, 16, 2, 64)
    k = torch.randn(3, 2, 64)
    with pytest.raises(InvalidInput, match="norm.weight"):
        store_k_fused(layer, k, torch.arange(3), torch.arange(3), norm=NormSpec(torch.ones(32)))
    with pytest.raises(InvalidInput, match="positions"):
        store_k_fused(layer, k, torch.arange(3), torch.arange(4), rope=RopeSpec())
    with pytest.raises(InvalidInput, match=r"positions must have shape \[3, 3\]"):
        store_k_fused(layer, k, torch.arange(3), torch.arange(3), rope=RopeSpec(multimodal=True))
    with pytest.raises(ConfigError, match="rotary_dim"):
        store_k_fused(layer, k, torch.arange(3), torch.arange(3), rope=RopeSpec(rotary_dim=65))
    with pytest.raises(InvalidInput, match="k holds NaN"):
        store_k_fused(layer, torch.full((3, 2, 64), float("nan")), torch.arange(3), torch.arange(3), rope=RopeSpec())
    assert int(layer.k_pool.abs().sum()) == 0


def test_fused_path_uses_a_backend_fused_kernel_when_it_has_one():
    from pagedkv.ops import Backend, reference

    calls = []

    def fused_kernel(layer, k, slot_mapping, positions, *, norm=None, rope=None):
        calls.append(k.shape)
        kf = norm_rope(k, positions, norm, rope)
        reference.store(layer, kf, None, slot_mapping)
        return kf

    with_kernel = Backend(name="test-fused", device_types=("cpu",), store=reference.store,
                          decode_attention=reference.decode_attention,
                          prefill_attention=reference.prefill_attention, store_k_fused=fused_kernel)
    a = make_layer(CODECS["turbo3"], CODECS["turbo4"], 2, 16, 2, 64)
    b = make_layer(CODECS["turbo3"], CODECS["turbo4"], 2, 16, 2, 64)
    k, pos = torch.randn(5, 2, 64), torch.arange(5)
    store_k_fused(a, k, torch.arange(5), pos, rope=RopeSpec(), backend=with_kernel)
    store_k_fused(b, k, torch.arange(5), pos, rope=RopeSpec(), backend="reference")
    assert calls == [torch.Size([5, 2, 64])]
    assert torch.equal(a.k_pool, b.k_pool)


@pytest.mark.parametrize("codec", ["bf16", "turbo3", "q8_0"])
def test_fused_store_applies_the_layer_transform(codec):
    """k_mult / k_centre on the layer: the fused path stores norm_rope(k) * k_mult - k_centre
    (the same bytes as storing those keys into a layer without the transform) and returns the
    keys before the transform; store_v subtracts v_centre."""
    torch.manual_seed(6)
    h, d = 2, 64
    k, v = torch.randn(7, h, d) * 2, torch.randn(7, h, d) + 3
    mult, centre, vc = torch.rand(h, d) + 0.5, torch.randn(h, d), torch.randn(h, d) + 3
    pos, slots, norm = torch.arange(7), torch.tensor([0, 3, -1, 5, 6, 9, 17]), NormSpec(torch.rand(d) + 0.5)
    layer = make_layer(CODECS[codec], CODECS[codec], 2, 16, h, d, k_centre=centre, k_mult=mult, v_centre=vc)
    bare = make_layer(CODECS[codec], CODECS[codec], 2, 16, h, d)
    got = store_k_fused(layer, k, slots, pos, norm=norm, rope=RopeSpec())
    store_v(layer, v, slots)
    want = norm_rope(k, pos, norm, RopeSpec())
    torch.testing.assert_close(got, want)
    store(bare, want * mult - centre, v - vc, slots)
    assert torch.equal(layer.k_pool, bare.k_pool) and torch.equal(layer.v_pool, bare.v_pool)
