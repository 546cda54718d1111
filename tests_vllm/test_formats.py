"""Compressed formats in a real vLLM engine: capacity from the catalogue, quality against
`pagedkv eval` on the same text, prefix caching over compressed pages.

One engine per format (turbo4, turbo3, fp8k_turbo3v, each as `NAME+hp`: the automatic
high-precision layers, the same name and bytes as `NAME+hp` in `pagedkv eval` and the
transformers cache). The statistics
are fitted once at engine start on the calibration text (stdlib docstrings), `pagedkv eval`
fits them on each window's own first chunk: the two KLs measure the same codecs on the same
windows through two front doors, and agree within KL_FACTOR.
"""

import pytest

from engine import KV_BYTES, coarse_kl
from workloads import FORMATS, KL_FACTOR


def _catalogue_blocks(name: str) -> int:
    from pagedkv.integrations.vllm.layout import layer_formats, page_bytes

    per_block = sum(page_bytes(f, 128, 3, 64) for f in layer_formats(name, "auto", "q8_0", 30, [(3, 64)] * 30))
    return KV_BYTES // per_block


@pytest.mark.parametrize("name", ("bf16",) + FORMATS)
def test_reported_capacity_is_the_catalogue_bytes(runs, name):
    blocks, tokens = runs[name]["capacity"]
    assert blocks == _catalogue_blocks(name) and tokens == blocks * 128


def test_capacity_of_every_format_as_vllm_computes_it(runs):
    """vLLM's own KV-cache sizing over the specs pagedkv's backend gives every layer, for every
    format pair (with the default high-precision layers): exactly the catalogue's blocks."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    import torch

    from pagedkv.formats import all_formats
    from pagedkv.integrations.vllm.backend import backend_for
    from pagedkv.integrations.vllm.layout import layer_formats

    cfg = runs["bf16"]["vllm_config"]
    base = FullAttentionSpec(block_size=128, num_kv_heads=3, head_size=64, dtype=torch.float32)
    for fmt in all_formats():
        specs = {f"model.layers.{i}.self_attn.attn": backend_for(f.name).customize_spec(base)
                 for i, f in enumerate(layer_formats(fmt.name, "auto", "q8_0", 30, [(3, 64)] * 30))}
        kv = get_kv_cache_configs(cfg, [specs], [KV_BYTES])[0]
        assert kv.num_blocks == _catalogue_blocks(fmt.name), fmt.name


@pytest.mark.parametrize("name", FORMATS)
def test_prompt_logprobs_agree_with_pagedkv_eval(runs, eval_kl, name):
    kl = coarse_kl(runs["bf16"]["logprobs"], runs[name]["logprobs"])
    ref = eval_kl[name + "+hp"]
    print(f"MEASURED {name}: vLLM prompt-logprob KL {kl:.5f}, pagedkv eval KL {ref:.5f}, ratio {kl / ref:.2f}")
    assert ref > 0 and ref / KL_FACTOR < kl < ref * KL_FACTOR, f"vLLM KL {kl:.5f}, pagedkv eval KL {ref:.5f}"


def test_repeated_prompt_hits_the_prefix_cache_with_identical_output(runs):
    (ids1, text1, cached1), (ids2, text2, cached2) = runs["turbo3"]["prefix"]
    assert cached2 >= 128 > cached1  # whole 128-token blocks came from the cache the second time
    assert ids1 == ids2, (text1, text2)
    assert len(text1.strip()) > 0
