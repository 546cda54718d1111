"""One KV-format grammar (`pagedkv.spec`) at every front door: `PagedKVCache`, `CacheConfig`,
the vLLM settings (their torch-free part, with the page bytes the vLLM backend asks vLLM for)
and the command line (`parse_choice`, which `eval` and `generate` call before the model loads,
and `pagedkv plan` run as a command) accept exactly the same spec strings, windows and plan
files included, and build the same layers with the same bytes per block; a spec's window gives
the same stored bytes as the same window passed as an argument; a bad spec fails at every door
with one error naming the bad part."""

from __future__ import annotations

import json

import pytest
import torch

from helpers.tiny_llama import peaked_llama

from pagedkv.cache.config import CacheConfig
from pagedkv.errors import ConfigError
from pagedkv.spec import RecentWindow, parse_spec

VOCAB, LAYERS, DIMS = 96, 4, [(2, 64)] * 4


@pytest.fixture(scope="module")
def model():
    return peaked_llama(num_hidden_layers=LAYERS)


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    d = tmp_path_factory.mktemp("plans")
    layers = [{"k": "q8_0", "v": "turbo3"}, {"k": "turbo4", "v": "turbo2"}, {"k": "turbo3", "v": "turbo3"},
              {"k": "q4_0", "v": "q8_0"}]
    out = {}
    for name, recent in (("plan.json", {"tokens": 8, "codec": "q8_0", "sinks": 4}), ("plain.json", None)):
        (d / name).write_text(json.dumps({"pagedkv_plan": 1, "layers": layers, "layer_dims": DIMS,
                                          "recent_window": recent}))
        out[name] = str(d / name)
    return out


SPECS = ["turbo3", "TURBO3", "turbo3+hp", "turbo4k3v+hp1", "q8_0k_turbo2v", "turbo3k_turbo2v", "turbo3+r8",
         "turbo3+r8s4q8_0", "turbo3+r64s16q8_0", "turbo2+hp+r16s4q8_0", "fp8k_turbo3v+hp2+r8f16", "PLAN:plan.json",
         "PLAN:plain.json", "PLAN:plain.json+r8s2"]
BAD = [("turbo9", "turbo9"), ("turbo3+r8zz9", "zz9"), ("turbo3+r8+hp", "a window must be last"),
       ("turbo3+hpx", "turbo3\\+hpx"), ("turbo3+r8fp8", "tensor scale"), ("PLAN:plan.json+r16", "differs"),
       ("PLAN:plain.json+hp", "\\+hp after a plan"), ("tuned3+r8", "after tunedB"), ("PLAN:missing.json", "missing.json. cannot be")]


def _spec(text, plans, tmp_path=None):
    if text.startswith("PLAN:"):
        name, _, suffix = text[5:].partition("+")
        path = plans.get(name) or str(tmp_path / name)
        return path + ("+" + suffix if suffix else "")
    return text


def _doors(model):
    """What each front door builds from a spec: (layer formats, recent window, bytes per block
    over every layer's K and V pages)."""
    from pagedkv.eval.runner import cache_for, parse_choice
    from pagedkv.integrations.transformers import PagedKVCache
    from pagedkv.integrations.vllm.layout import content_bytes, layer_formats
    from pagedkv.integrations.vllm.settings import parse_settings

    def drop_in(spec):
        c = PagedKVCache(model, spec, block_size=4)
        return c.config.layer_formats, c.recent_window, c.config.bytes_per_block

    def config(spec):
        c = CacheConfig(num_layers=LAYERS, num_kv_heads=2, head_dim=64, kv_format=spec, block_size=4, num_blocks=1)
        return c.layer_formats, c.recent_window, c.bytes_per_block

    def vllm(spec):  # the bytes: what the backend's KV spec asks vLLM for per block (state_content_bytes)
        s = parse_settings({"kv_format": spec}, environ={})
        formats = layer_formats(s.kv_format, s.high_precision_layers, s.hp_format, LAYERS, DIMS)
        return formats, s.recent_window, sum(4 * h * content_bytes(f, d) for f, (h, d) in zip(formats, DIMS))

    def cli(spec):
        c = cache_for(model, parse_choice(spec), block_size=4)
        return c.config.layer_formats, c.recent_window, c.config.bytes_per_block

    return {"PagedKVCache": drop_in, "CacheConfig": config, "vLLM settings": vllm, "CLI": cli}


@pytest.fixture(scope="module")
def model_folder(model, tmp_path_factory):
    """The model's config.json alone: all `pagedkv plan` reads."""
    folder = tmp_path_factory.mktemp("model")
    model.config.save_pretrained(folder)
    return str(folder)


def _plan_cli(folder, spec, capsys):
    """`pagedkv plan --json` for one spec: (exit status, its row or the error lines)."""
    from pagedkv.cli.main import main

    rc = main(["plan", "--model", folder, "--formats", spec, "--block-size", "4", "--json"])
    out = capsys.readouterr()
    return rc, (json.loads(out.out)[0] if rc == 0 else out.err.splitlines())


@pytest.mark.parametrize("text", SPECS)
def test_every_front_door_builds_the_same_layers_from_a_spec(model, model_folder, plans, text, capsys):
    spec = _spec(text, plans)
    want = parse_spec(spec)
    got = {door: build(spec) for door, build in _doors(model).items()}
    first = next(iter(got.values()))
    assert all(g == first for g in got.values()), got
    assert first[1] == want.recent_window
    if want.layers is not None:
        assert first[0] == want.layers
    elif want.high_precision_layers is None:
        assert first[0] == (want.format,) * LAYERS
    bpb = sum(f.k_block_bytes(4, h, d) + f.v_block_bytes(4, h, d) for f, (h, d) in zip(first[0], DIMS))
    assert first[2] == bpb  # the catalogue's bytes of those layers (blocks of 4 tokens)
    rc, row = _plan_cli(model_folder, spec, capsys)
    assert rc == 0 and row["bytes_per_block"] == bpb, row


@pytest.mark.parametrize("text, needle", BAD)
def test_a_bad_spec_fails_at_every_front_door_naming_the_bad_part(model, model_folder, plans, tmp_path, text,
                                                                  needle, capsys):
    import re

    spec = _spec(text, plans, tmp_path)
    for door, build in _doors(model).items():
        with pytest.raises(ConfigError, match=needle) as err:
            build(spec)
        assert "\n" not in str(err.value), door
    rc, err = _plan_cli(model_folder, spec, capsys)
    assert rc == 2 and len(err) == 1 and re.search(needle, err[0]), err


def test_a_tuned_label_is_made_by_eval_only(model):
    """`tunedB` parses everywhere; only eval can make the plan (it needs the tokenizer)."""
    assert parse_spec("tuned3.5").tune_bits == 3.5
    for door, build in _doors(model).items():
        if door != "CLI":
            with pytest.raises(ConfigError, match="pagedkv tune --bits 3.5"):
                build("tuned3.5")


def test_a_window_in_the_spec_stores_the_same_bytes_as_the_argument(model):
    from pagedkv.integrations.hf_compat import with_cache
    from pagedkv.integrations.transformers import PagedKVCache

    ids = torch.randint(3, VOCAB, (1, 24), generator=torch.Generator().manual_seed(2))
    caches, logits = [], []
    for spec, recent in (("turbo3+r8s4q8_0", None), ("turbo3", RecentWindow(8, "q8_0", sinks=4))):
        cache = PagedKVCache(model, spec, block_size=4, recent_window=recent)
        with torch.no_grad():
            logits.append(model(ids, use_cache=True, **with_cache(model, cache)).logits)
        caches.append(cache)
    assert torch.equal(logits[0], logits[1])
    a, b = caches
    assert a.config.fingerprint == b.config.fingerprint
    for la, lb in zip(a.layers, b.layers):
        for name in ("k_pool", "v_pool"):
            assert torch.equal(getattr(la.paged, name), getattr(lb.paged, name))
            assert torch.equal(getattr(la.tail, name), getattr(lb.tail, name))
    with pytest.raises(ConfigError, match="names a recent window"):
        PagedKVCache(model, "turbo3+r8", recent_window=16)
    with pytest.raises(ConfigError, match="names its high-precision layers"):
        PagedKVCache(model, "turbo3+hp", high_precision_layers=2)
    assert PagedKVCache(model, "turbo3+r8", recent_window=8).recent_window == RecentWindow(8)  # agreeing


def test_per_layer_lists_in_python_and_vllm(model):
    from pagedkv.integrations.vllm.settings import parse_settings

    names = ["q8_0", "turbo3", "turbo4k3v", "bf16"]
    cfg = CacheConfig(num_layers=LAYERS, num_kv_heads=2, head_dim=64, kv_format=names, num_blocks=1)
    assert parse_settings({"kv_format": names}, environ={}).kv_format == tuple(f.name for f in cfg.layer_formats)
    for bad in (["turbo3+hp"] * 4, ["plan.json"] * 4, []):
        for build in (lambda v: CacheConfig(num_layers=LAYERS, num_kv_heads=2, head_dim=64, kv_format=v, num_blocks=1),
                      lambda v: parse_settings({"kv_format": v}, environ={})):
            with pytest.raises(ConfigError, match="per-layer|empty list"):
                build(bad)
