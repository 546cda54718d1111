"""One declaration of the cache options (`pagedkv.options.CacheOptions`): the drop-ins,
`CacheConfig`, the vLLM settings and `pagedkv generate`'s flags take it, and the statistics
defaults (centring, scaling, fp8 scales) come from codec traits, the same in the drop-in and the
vLLM fit (f16 and fp8_e5m2 included, which a name test got wrong)."""

from __future__ import annotations

import argparse

import pytest
import torch

from helpers.tiny_llama import peaked_llama

from pagedkv.cache.config import CacheConfig
from pagedkv.errors import ConfigError
from pagedkv.formats import all_formats, parse_format
from pagedkv.options import CacheOptions, add_option_arguments, option_names, options_from_args
from pagedkv.spec import RecentWindow


def test_options_are_validated_once_naming_the_value():
    for kw, needle in ((dict(block_size=0), "block_size"), (dict(hp_format="q9"), "q9"),
                       (dict(key_centring="yes"), "key_centring"), (dict(checks=1), "checks"),
                       (dict(recent_window="64"), "recent_window"), (dict(approx="int9"), "int9"),
                       (dict(backend=3), "backend"), (dict(keep_window_prefixes=1), "keep_window_prefixes")):
        with pytest.raises(ConfigError, match=needle):
            CacheOptions(**kw)
    with pytest.raises(ConfigError, match="unknown cache option.*colour.*accepted: block_size"):
        CacheOptions.of(colour=1)
    o = CacheOptions.of(CacheOptions(block_size=8, key_scaling=True), checks=False)
    assert (o.block_size, o.key_scaling, o.checks, o.hp_format.name) == (8, True, False, "q8_0")
    assert o.changed() == ("block_size", "key_scaling", "checks")


def test_the_statistics_defaults_are_the_same_in_the_drop_in_and_the_vllm_fit():
    from pagedkv.integrations.transformers import PagedKVCache
    from pagedkv.integrations.vllm.fit import FitPlan

    model = peaked_llama()
    for fmt in all_formats():
        for kw in ({}, {"key_scaling": True}, {"value_centring": False}):
            cache = PagedKVCache(model, fmt, **kw)
            plan = FitPlan.build([fmt] * 2, None, kw.get("value_centring"), kw.get("key_scaling", False))
            fits = cache.engine.fit_options(0, cache.options)  # what the drop-in's first chunk fits
            assert (cache.key_centring, fits.key_centring, fits.value_centring, fits.key_scaling) == \
                (plan.key_centring, plan.key_centring, plan.value_centring[0], plan.key_scaling[0]), (fmt.name, kw)
    raw = parse_format("f16")
    assert not FitPlan.build([raw], None, None, False).needed  # f16 is raw: nothing to fit
    assert FitPlan.build([parse_format("fp8_e5m2")], False, False, False).needed  # its tensor scales


def test_the_drop_in_takes_options_or_their_keywords_with_the_same_bytes():
    from pagedkv.integrations.hf_compat import with_cache
    from pagedkv.integrations.transformers import PagedKVCache

    model = peaked_llama()
    ids = torch.randint(3, 96, (1, 20), generator=torch.Generator().manual_seed(3))
    opts = CacheOptions(block_size=8, key_scaling=True, recent_window=RecentWindow(4, "q8_0"))
    outs = []
    for cache in (PagedKVCache(model, "turbo3", options=opts),
                  PagedKVCache(model, "turbo3", block_size=8, key_scaling=True, recent_window=RecentWindow(4, "q8_0")),
                  PagedKVCache(model, "turbo3", options=CacheOptions(block_size=8), key_scaling=True,
                               recent_window=RecentWindow(4, "q8_0"))):
        with torch.no_grad():
            outs.append(model(ids, use_cache=True, **with_cache(model, cache)).logits)
        assert cache.options == opts and cache.config.block_size == 8
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    with pytest.raises(ConfigError, match="unknown cache option"):
        PagedKVCache(model, "turbo3", block_sise=8)


def test_cache_config_takes_options():
    base = dict(num_layers=2, num_kv_heads=2, head_dim=64, num_blocks=4)
    cfg = CacheConfig(kv_format="turbo3", options=CacheOptions(block_size=8, recent_window=8, hp_format="bf16"), **base)
    assert (cfg.block_size, cfg.recent_window, cfg.hp_format.name, cfg.key_centring) == (8, RecentWindow(8), "bf16", True)
    assert not CacheConfig(kv_format="bf16", options=CacheOptions(), **base).key_centring  # raw keys
    assert not CacheConfig(kv_format="turbo3", options=CacheOptions(key_centring=False), **base).key_centring
    with pytest.raises(ConfigError, match="block_size: given both"):
        CacheConfig(kv_format="turbo3", block_size=8, options=CacheOptions(), **base)


def test_keep_window_prefixes_is_an_option_reaching_the_window_groups():
    """`keep_window_prefixes` flows as every option does: `options=` or a keyword of the drop-in,
    `CacheConfig(options=)`, to the windowed groups' `GroupSpec.keep_cached` (the one place the
    block manager holds it); the global group never keeps released blocks (it releases none)."""
    from pagedkv.cache import PagedCache
    from pagedkv.integrations.transformers import PagedKVCache

    model = peaked_llama()
    window = RecentWindow(4, "q8_0")  # the tail group slides (the tiny model's layers do not)
    for opts, kw in ((CacheOptions(keep_window_prefixes=True, recent_window=window), {}),
                     (None, dict(keep_window_prefixes=True, recent_window=window)),
                     (CacheOptions(recent_window=window), {}), (None, dict(recent_window=window))):
        cache = PagedKVCache(model, "turbo3", options=opts, **kw)
        kept = cache.options.keep_window_prefixes
        assert cache.config.keep_window_prefixes is kept
        assert [(s.window, s.keep_cached) for s in cache.engine.core.specs] == [(None, False), (4, kept)]
    assert kept is False and CacheOptions().keep_window_prefixes is False  # off by default
    base = dict(num_layers=2, num_kv_heads=2, head_dim=64, num_blocks=8, sliding_window=[None, 8])
    cfg = CacheConfig(kv_format="turbo3", options=CacheOptions(keep_window_prefixes=True), **base)
    assert cfg.keep_window_prefixes
    assert [s.keep_cached for s in PagedCache(cfg).core.specs] == [False, True]
    with pytest.raises(ConfigError, match="keep_window_prefixes: given both"):
        CacheConfig(kv_format="turbo3", keep_window_prefixes=True, options=CacheOptions(), **base)


def test_vllm_settings_hold_the_same_options():
    from pagedkv.integrations.vllm.settings import parse_settings

    s = parse_settings({"kv_format": "turbo3+r8s4q8_0", "key_scaling": True, "approx": "int8_scores",
                        "hp_format": "bf16"}, environ={})
    assert s.options == CacheOptions(key_scaling=True, approx="int8_scores", hp_format="bf16",
                                     recent_window=RecentWindow(8, "q8_0", sinks=4), checks=False)
    with pytest.raises(ConfigError, match="pagedkv key_scaling must be True or False"):
        parse_settings({"kv_format": "turbo3", "key_scaling": "yes"}, environ={})


def test_generate_flags_are_the_fields():
    from pagedkv.cli.generate_cmd import OPTION_FLAGS

    assert set(OPTION_FLAGS) == set(option_names()) - {"recent_window"}  # the window: in --kv-format
    p = argparse.ArgumentParser()
    add_option_arguments(p, OPTION_FLAGS)
    args = p.parse_args(["--block-size", "8", "--no-key-centring", "--approx", "int8_scores", "--hp-format", "bf16"])
    assert options_from_args(args, OPTION_FLAGS) == CacheOptions(block_size=8, key_centring=False,
                                                                 approx="int8_scores", hp_format="bf16")
    assert options_from_args(p.parse_args([]), OPTION_FLAGS) == CacheOptions()
