"""The transformers drop-in with its pages on a CUDA device (skipped without one): the tiny random
models of test_integration_transformers on the GPU, so that the store, decode and chunked-prefill
attention the cache calls are the Triton kernels, chosen by the automatic dispatch.

Oracles: transformers' DynamicCache with eager attention on the same device (bf16 pages, within
bf16 rounding of K/V), and, for compressed pages, eager attention over the K/V the pages hold,
decoded by the reference (the attention kernels alone). An oracle that encodes the K/V its own
model computes does not work on a GPU: from the second layer on its inputs differ from the paged
run's by the first layer's bf16-operand rounding, and a codec of 4 or fewer bits turns those
small differences into whole code steps (the first layer, with identical inputs, stores exactly
the reference's codes; the store's bytes are tested against the reference in test_triton). The
registered CUDA backend multiplies bf16 operands (fp32 accumulation), so both compare within
bf16 rounding (2**-8 relative per operand).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.triton]

transformers = pytest.importorskip("transformers")
pytest.importorskip("triton")
from transformers import DynamicCache  # noqa: E402

from pagedkv.formats import parse_format  # noqa: E402
from pagedkv.integrations.transformers import ATTN_IMPLEMENTATION, PagedKVCache  # noqa: E402
from pagedkv.ops import AttentionParams, Op, select_backend  # noqa: E402
from pagedkv.integrations.hf_compat import with_cache  # noqa: E402
from test_integration_transformers import _QDQLayer, _ids, _model  # noqa: E402

_DynamicLayer = transformers.cache_utils.DynamicLayer

CUDA = torch.device("cuda")


def _logits(model, ids, cache):
    """By the keyword this transformers takes a cache by (the GPU image ran 5.17: past_key_values=)."""
    with torch.no_grad():
        return model(ids, **with_cache(model, cache), use_cache=True).logits.float()


def _run(model, ids, cache, prompt: int):
    """The prompt in one pass (prefill), then token by token (decode)."""
    ids = ids.to(CUDA)
    return torch.cat([_logits(model, ids[:, :prompt], cache)] +
                     [_logits(model, ids[:, t:t + 1], cache) for t in range(prompt, ids.shape[1])], dim=1)


@pytest.mark.parametrize("family", ["llama", "gemma2", "gemma3"])
def test_bf16_pages_on_cuda_match_dynamic_cache(family):
    model = _model(family).to(CUDA)
    ids = _ids(24)
    ref = _run(model, ids, DynamicCache(config=model.config), 10)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    cache = PagedKVCache(model, "bf16", high_precision_layers=0, block_size=4)
    out = _run(model, ids, cache, 10)
    assert out.device.type == CUDA.type
    assert cache.get_seq_length() == 24
    layer = cache.layers[0].paged
    assert layer.k_pool.device.type == CUDA.type
    assert select_backend(Op.DECODE, layer.k_pool.device, layer, AttentionParams(scale=0.1), None).name == "triton"
    err = float((out - ref).abs().max() / ref.abs().max())
    print(f"{family} bf16 pages on cuda: max |logit error| / max |logit| = {err:.2e}")
    assert err <= 2e-2


class _StoredLayer(_DynamicLayer):
    """Dense oracle: each token's K and V replaced by what the paged layer stored for it, decoded
    by the reference (`PagedCache.gather`: float32, original basis)."""

    def __init__(self, k, v):
        super().__init__()
        self.stored = (k, v)  # [len, H, D] each

    def update(self, k, v, *args, **kwargs):
        n, t = 0 if self.keys is None else self.keys.shape[-2], k.shape[-2]
        ks, vs = (x[n:n + t].permute(1, 0, 2)[None].to(k.dtype) for x in self.stored)
        return super().update(ks, vs)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "turbo3", "turbo4", "bf16k_turbo3v", "turbo2"])
def test_compressed_pages_on_cuda_equal_dense_attention_on_stored_kv(fmt):
    kvf = parse_format(fmt)
    model = _model("llama").to(CUDA)
    ids = _ids(40, seed=2)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    cache = PagedKVCache(model, fmt, high_precision_layers=0, block_size=8)
    out = _run(model, ids, cache, 24)
    (seq,) = cache._rows
    stored = [cache.engine.gather(i, seq) for i in range(len(cache.layers))]
    model.set_attn_implementation("eager")
    oracle = DynamicCache()
    oracle.layers = [_StoredLayer(k, v) for k, v in stored]
    oracle.layer_class_to_replicate = None
    ref = _run(model, ids, oracle, 24)
    err = float((out - ref).abs().max() / ref.abs().max())
    # how far the GPU store's codes are from the reference encode (informative: the rows whose
    # stored K differs from the reference round trip by more than float rounding)
    qdq = DynamicCache()
    qdq.layers = [_QDQLayer(kvf, layer) for layer in cache.layers]
    qdq.layer_class_to_replicate = None
    _run(model, ids, qdq, 24)
    rows = [float(((k - layer.keys[0].permute(1, 0, 2)).abs().amax(-1) > 1e-3 * k.abs().amax()).float().mean())
            for (k, _), layer in zip(stored, qdq.layers)]
    print(f"{fmt} pages on cuda: max |logit error| / max |logit| vs dense attention on the stored K/V = "
          f"{err:.2e}; K rows off the reference round trip per layer: {rows}")
    assert err <= 1e-2


def test_recent_window_format_generates_like_the_cpu():
    """A format with a q8_0 recent window and sinks: greedy generation on CUDA gives the tokens the
    same cache gives on the CPU (reference and C kernels there)."""
    fmt = "turbo4+r16s4q8_0"
    model = _model("llama")
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    ids = _ids(30, seed=3)
    cpu = model.generate(ids, **with_cache(model, PagedKVCache(model, fmt, high_precision_layers=0, block_size=4)),
                         max_new_tokens=12, do_sample=False)
    model = model.to(CUDA)
    gpu = model.generate(ids.to(CUDA), **with_cache(model, PagedKVCache(model, fmt, high_precision_layers=0,
                                                                         block_size=4)),
                         max_new_tokens=12, do_sample=False)
    assert gpu.cpu().tolist() == cpu.tolist()
