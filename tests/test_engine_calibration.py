"""The engine cache (`PagedCache`) fits a layer's transform as the transformers drop-in fits its
first chunk (`calibrate_layer`): the same key centre, key multipliers, value centre and fp8
scales for the same sample, from the same option defaults (codec traits); stored rows then read
back as the reference round trip of exactly the transformed values."""

from __future__ import annotations

import pytest
import torch

from helpers.tiny_llama import peaked_llama

from pagedkv.cache import PagedCache
from pagedkv.cache.config import CacheConfig
from pagedkv.codecs.reference import roundtrip
from pagedkv.errors import ConfigError, InvalidInput
from pagedkv.formats import parse_format
from pagedkv.options import CacheOptions

FIELDS = ("k_centre", "k_mult", "v_centre", "k_scale", "v_scale")


def _sample(t=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(1, 2, t, 64, generator=g) * 2 + torch.randn(1, 2, 1, 64, generator=g) * 3  # a shared bias
    v = torch.randn(1, 2, t, 64, generator=g) + 1.5
    q = torch.randn(1, 6, t, 64, generator=g)
    return k, v, q


@pytest.mark.parametrize("fmt", ["turbo3", "q8_0k_turbo2v", "fp8", "bf16k_turbo3v", "f16"])
@pytest.mark.parametrize("opts", [dict(key_scaling=True), dict(value_centring=False), dict()])
def test_the_engine_fits_what_the_drop_in_fits(fmt, opts):
    from pagedkv.integrations.transformers import PagedKVCache

    k, v, q = _sample()
    drop_in = PagedKVCache(peaked_llama(), fmt, **opts)
    layer = drop_in.layers[0]
    layer.lazy_initialization(k, v, q)
    engine = PagedCache(CacheConfig(num_layers=2, num_kv_heads=2, head_dim=64, kv_format=fmt, num_blocks=8,
                                    options=CacheOptions(**opts)))
    engine.calibrate_layer(0, k, v, q)
    for name in FIELDS:
        a, b = getattr(layer.paged, name), getattr(engine.layers[0], name)
        if a is None or b is None:  # no centre: the engine's zero / absent one is the same transform
            assert (a if b is None else b) is None or not bool((a if b is None else b).any()), (fmt, name)
        else:
            assert torch.equal(a, b), (fmt, name)
    f = parse_format(fmt)
    assert (engine.layers[0].v_centre is not None) == (not f.v.traits.raw and opts.get("value_centring", True))
    assert (engine.layers[0].k_mult is not None) == (not f.k.traits.raw and opts.get("key_scaling", False))


def test_stored_rows_are_the_round_trip_of_the_transformed_values():
    fmt = parse_format("q8_0k_turbo3v")
    k, v, q = _sample(t=10, seed=1)
    cache = PagedCache(CacheConfig(num_layers=1, num_kv_heads=2, head_dim=64, kv_format=fmt, num_blocks=8,
                                   options=CacheOptions(key_scaling=True)))
    cal = cache.calibrate_layer(0, k, v, q)
    assert cal.k_mult is not None and cal.v_centre is not None and cal.k_centre is not None
    kt, vt = k[0].transpose(0, 1), v[0].transpose(0, 1)  # [T, H, D]
    new = cache.add_sequence(list(range(10)))
    cache.store(0, kt, vt, new.slot_mapping)
    got_k, got_v = cache.gather(0, new.seq_id)
    mult, kc, vc = cal.k_mult, cal.k_centre, cal.v_centre
    assert torch.allclose(got_k, (roundtrip(fmt.k, kt * mult - kc) + kc) / mult, atol=1e-5, rtol=1e-5)
    assert torch.allclose(got_v, roundtrip(fmt.v, vt - vc) + vc, atol=1e-5, rtol=1e-5)
    with pytest.raises(InvalidInput, match="k_mult must be > 0"):
        PagedCache(CacheConfig(num_layers=1, num_kv_heads=2, head_dim=64, kv_format=fmt, num_blocks=8)) \
            .configure_layer(0, k_mult=torch.zeros(2, 64))


def test_fit_layer_fits_each_layer_on_its_first_chunk_while_earlier_layers_store():
    """The drop-in's order (`PagedCache(fit_first_chunk=True)`): layer 0 fits and stores, then
    layer 1 fits (the cache is not empty) the same transform `calibrate_layer` fits; a stored
    layer is neither refitted nor reset; the tiers' members wait for every layer."""
    k, v, q = _sample(t=10, seed=2)
    cfg = CacheConfig(num_layers=2, num_kv_heads=2, head_dim=64, kv_format="turbo3", num_blocks=8,
                      key_centring=True)
    cache, ref = PagedCache(cfg, fit_first_chunk=True), PagedCache(cfg)
    new = cache.add_sequence(list(range(10)))
    cache.fit_layer(0, k, v, q)
    cache.store(0, k[0].transpose(0, 1), v[0].transpose(0, 1), new)
    with pytest.raises(ConfigError, match="already stores"):
        cache.fit_layer(0, k, v, q)
    with pytest.raises(ConfigError, match="store data"):
        cache.reset_transforms([0])
    with pytest.raises(ConfigError, match="empty cache"):
        cache.calibrate_layer(1, k, v, q)
    assert cache.transforms.shared() is None  # not every layer fitted: nothing to publish
    cache.fit_layer(1, k, v, q)
    ref.calibrate_layer(1, k, v, q)
    for name in FIELDS:
        a, b = getattr(cache.layers[1], name), getattr(ref.layers[1], name)
        assert (a is None and b is None) or torch.equal(a, b), name
    assert cache.layers[1].v_centre is not None and cache.layers[1].k_centre.any()
    assert cache.fitted == {0, 1} and len(cache.transforms.shared()) == 2
    cache.reset_transforms([1])  # stored nothing: back to the built transform, to be fitted again
    assert cache.layers[1].v_centre is None and not cache.layers[1].k_centre.any() and cache.fitted == {0}
    cache.clear()
    cache.reset_transforms()
    assert not cache.fitted and cache.layers[0].v_centre is None
