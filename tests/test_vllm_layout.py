"""The vLLM backend's parts that need no vLLM: settings parsing and pages as pool views.

The engine tests themselves run in their own environment (tests_vllm/, `make test-vllm`).
"""

import pytest
import torch

from pagedkv import ops
from pagedkv.errors import ConfigError
from pagedkv.formats import all_formats, parse_format
from pagedkv.integrations.vllm.fit import FitPlan
from pagedkv.integrations.vllm.layout import (check_geometry, content_bytes, layer_formats, page_bytes,
                                              paged_layer)
from pagedkv.integrations.vllm.settings import parse_settings, settings_from
from pagedkv.ops.batch import AttentionParams, make_layer


def test_settings_forms_and_opt_in():
    assert parse_settings("turbo3").kv_format == "turbo3"
    s = parse_settings('{"kv_format": ["bf16", "turbo3"], "high_precision_layers": 0}', environ={})
    assert s.kv_format == ("bf16", "turbo3") and s.high_precision_layers == 0
    assert settings_from({}, None) is None  # nothing named: pagedkv stays out of vLLM's way
    assert settings_from({"other": 1}, None) is None
    assert settings_from({}, "turbo4").kv_format == "turbo4"
    assert settings_from({"pagedkv": {"kv_format": "fp8"}}, "turbo4").kv_format == "fp8"


def test_a_format_name_means_the_same_layers_as_everywhere_in_pagedkv():
    """"turbo3" is turbo3 in every layer, as in `PagedKVCache(model, "turbo3")` and on the
    command line; "turbo3+hp" adds the automatic high-precision layers, as there."""
    from pagedkv.cache.config import CacheConfig

    dims = [(3, 64)] * 30

    def layers(value):
        s = parse_settings(value, environ={})
        return [f.name for f in layer_formats(s.kv_format, s.high_precision_layers, s.hp_format, 30, dims)]

    for name in ("turbo3", "turbo3+hp", "turbo3+hp2", "fp8k_turbo3v+hp"):
        ref = CacheConfig(num_layers=30, num_kv_heads=3, head_dim=64, kv_format=name, num_blocks=1)
        assert layers(name) == [f.name for f in ref.layer_formats], name
    assert layers("turbo3") == ["turbo3"] * 30
    assert layers("turbo3+hp")[:3] == ["q8_0"] * 3
    assert layers({"kv_format": "turbo3", "high_precision_layers": 2})[:3] == ["q8_0", "q8_0", "turbo3"]


@pytest.mark.parametrize("value, needle", [
    ({"kv_format": "turbo9"}, "turbo9"),
    ({"kv_format": "turbo3", "colour": 1}, "colour"),
    ({}, "kv_format"),
    ({"kv_format": "turbo3", "high_precision_layers": -1}, "high_precision_layers"),
    ({"kv_format": "turbo3+hp", "high_precision_layers": 2}, "turbo3\\+hp"),
    ({"kv_format": ["bf16", "turbo3+hp"]}, "per-layer"),
    ({"kv_format": "turbo3", "calibration": "/no/such/file"}, "/no/such/file"),
    ({"kv_format": "turbo3", "backend": "gpu"}, "gpu"),
    ("{not json", "JSON"),
])
def test_settings_errors_name_the_value(value, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_settings(value, environ={})


def test_page_is_exactly_the_catalogue_block_for_every_format():
    for fmt in all_formats():
        for hd in (64, 128):
            check_geometry(fmt, 16, 3, hd)
            assert 16 * 3 * content_bytes(fmt, hd) == page_bytes(fmt, 16, 3, hd)


def test_layer_formats_follow_the_high_precision_policy():
    f = layer_formats("turbo3", "auto", "q8_0", 30, [(3, 64)] * 30)
    assert [x.name for x in f[:3] + f[-3:]] == ["q8_0"] * 6 and f[3].name == "turbo3"
    assert len(set(layer_formats(["bf16", "turbo3"], 0, "q8_0", 2, [(3, 64)] * 2))) == 2
    with pytest.raises(ConfigError):
        layer_formats(["bf16"] * 3, 0, "q8_0", 2, [(3, 64)] * 2)
    with pytest.raises(ConfigError, match="head_dim"):
        layer_formats("turbo3", 0, "q8_0", 1, [(3, 40)])


def test_fit_plan_defaults_match_the_transformers_cache():
    fmts = [parse_format("q8_0"), parse_format("bf16k_turbo3v"), parse_format("bf16")]
    p = FitPlan.build(fmts, None, None, False, [False, True, False])
    assert p.key_centring and p.value_centring == (True, False, False) and p.needed
    assert not FitPlan.build([parse_format("bf16")], None, None, False).needed


@pytest.mark.parametrize("name", ["bf16", "turbo3", "q4_0", "fp8k_turbo3v", "turbo4k_q8_0v"])
def test_views_of_a_vllm_page_equal_contiguous_pools(name):
    """K and V pools as strided views of vLLM's [blocks, H, N, C] page (two layers interleaved
    block-outermost, so the row stride is larger than the page), with the layer's statistics
    (centres, key multipliers): same bytes and the same attention as pools of their own."""
    fmt = parse_format(name)
    h, d, n, nb = 3, 64, 16, 5
    c = content_bytes(fmt, d)
    g = torch.Generator().manual_seed(0)
    backing = torch.zeros(nb, 2, h, n, c, dtype=torch.uint8)  # [B, L, H, N, C]: BLHNC
    page = backing[:, 1]
    cal_scale = torch.tensor([0.05])
    from pagedkv.cache.calibration import Calibration

    stats = {"k_centre": torch.randn(h, d, generator=g), "k_mult": torch.rand(h, d, generator=g) + 0.5,
             "v_centre": torch.randn(h, d, generator=g)}
    cal = Calibration(k_scale=cal_scale if fmt.k.name == "fp8" else None, **stats)
    view = paged_layer(page, fmt, h, d, cal)
    own = make_layer(fmt.k, fmt.v, nb, n, h, d, k_scale=float(view.k_scale), v_scale=float(view.v_scale),
                     **stats)
    t = 37
    k = torch.randn(t, h, d, generator=g)
    v = torch.randn(t, h, d, generator=g)
    slots = torch.randperm(nb * n, generator=g)[:t].sort().values
    for layer in (view, own):
        ops.store(layer, k, v, slots)
    assert torch.equal(view.k_pool, own.k_pool) and torch.equal(view.v_pool, own.v_pool)
    assert int(backing[:, 0].sum()) == 0  # the other layer's pages untouched
    lens = torch.tensor([20, 33], dtype=torch.int32)
    tables = torch.stack([torch.unique(slots // n)[:3].int()] * 2)
    q = torch.randn(2, 9, d, generator=g)
    params = AttentionParams(scale=d ** -0.5)
    a = ops.decode_attention(q, view, tables, lens, params)
    b = ops.decode_attention(q, own, tables, lens, params)
    assert torch.equal(a, b)


def _plan(path, layers, dims=(3, 64), recent=None):
    import json

    doc = {"pagedkv_plan": 1, "layers": [{"k": k, "v": v} for k, v in layers],
           "layer_dims": [list(dims)] * len(layers), "recent_window": recent}
    path.write_text(json.dumps(doc))
    return str(path)


def test_a_plan_file_is_a_vllm_format_checked_against_the_layout(tmp_path, monkeypatch):
    """kv_format "plan.json" (`pagedkv tune`'s file): the plan's codecs per layer, the path made
    absolute (vLLM's processes may not share a working directory), checked against the dims."""
    layers = [("q8_0", "turbo3"), ("turbo4", "turbo3"), ("turbo4", "turbo4"), ("q8_0", "turbo3")]
    _plan(tmp_path / "plan.json", layers)
    monkeypatch.chdir(tmp_path)
    s = parse_settings({"kv_format": "plan.json"}, environ={})
    assert s.kv_format == str(tmp_path / "plan.json") and s.label == "plan plan.json"
    assert [f.name for f in s.named_formats()] == ["q8_0k_turbo3v", "turbo4k_turbo3v", "turbo4"]
    got = layer_formats(s.kv_format, s.high_precision_layers, s.hp_format, 4, [(3, 64)] * 4)
    assert [(f.k.name, f.v.name) for f in got] == layers
    with pytest.raises(ConfigError, match="made for 4 layers"):
        layer_formats(s.kv_format, None, "q8_0", 30, [(3, 64)] * 30)
    with pytest.raises(ConfigError, match="not a pagedkv plan"):
        (tmp_path / "bad.json").write_text("{}")
        parse_settings({"kv_format": "bad.json"}, environ={})


@pytest.mark.parametrize("value, want", [
    ({"kv_format": "turbo3", "recent_window": 64}, ("turbo3", 64, "bf16", 0)),
    ({"kv_format": "turbo3", "recent_window": "64s16q8_0"}, ("turbo3", 64, "q8_0", 16)),
    ({"kv_format": "turbo3", "recent_window": {"tokens": 32, "codec": "q8_0", "sinks": 16}}, ("turbo3", 32, "q8_0", 16)),
    ({"kv_format": "turbo3+r64q8_0"}, ("turbo3", 64, "q8_0", 0)),
    ({"kv_format": "turbo3+hp+r64s16q8_0"}, ("turbo3", 64, "q8_0", 16)),
    ({"kv_format": "turbo3", "recent_window": 0}, ("turbo3", None, None, None)),
    ({"kv_format": "PLAN"}, (None, 64, "bf16", 0)),
])
def test_a_recent_window_from_its_setting_a_name_or_a_plan(tmp_path, value, want):
    """The window means what it means in `pagedkv eval` and the drop-in (`+rRsS<codec>` last)."""
    if value["kv_format"] == "PLAN":
        value = {"kv_format": _plan(tmp_path / "r.json", [("turbo3", "turbo3")], recent={"tokens": 64, "codec": "bf16"})}
    s = parse_settings(value, environ={})
    r = s.recent_window
    assert (None if want[0] is None else s.kv_format, *((r.tokens, r.codec.name, r.sinks) if r else (None,) * 3)) \
        == (None if want[0] is None else want[0], *want[1:])
    if "+hp" in value["kv_format"]:
        assert s.high_precision_layers == "auto"


@pytest.mark.parametrize("value, needle", [
    ({"kv_format": "turbo3+r64", "recent_window": 32}, "names a recent window \\(r64\\)"),
    ({"kv_format": "turbo3", "recent_window": "sixty"}, "recent_window must be"),
    ({"kv_format": "turbo3", "recent_window": {"tokens": 64}}, "recent_window must be"),
    ({"kv_format": "turbo3", "recent_window": "64fp8"}, "tensor scale"),
    ({"kv_format": "turbo3+r64zz9"}, "zz9"),
])
def test_bad_recent_windows_are_refused_naming_the_value(value, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_settings(value, environ={})


def test_the_tail_may_have_its_own_block_size():
    """`ops.recent` with tail_block_tables reads a tail of another block size (the vLLM tail
    group's blocks are smaller than the pages'): the same result as a tail at the pages' size."""
    from pagedkv.codecs import get_codec
    from pagedkv.ops.recent import recent_prefill_attention

    fmt, tc = parse_format("turbo3"), get_codec("q8_0")
    h, d, n = 2, 64, 70
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(n, h, d, generator=g), torch.randn(n, h, d, generator=g)
    q = torch.randn(n, 2 * h, d, generator=g)
    pages = make_layer(fmt.k, fmt.v, 8, 16, h, d)
    ops.store(pages, k, v, torch.arange(n) + 16)  # blocks 1..5
    tables = torch.tensor([[1, 2, 3, 4, 5]], dtype=torch.int32)
    lens, qsl = torch.tensor([n], dtype=torch.int32), torch.tensor([0, n], dtype=torch.int32)
    params = AttentionParams(scale=d ** -0.5)
    outs = []
    for bs in (16, 8):
        tail = make_layer(tc, tc, 2 * 80 // bs, bs, h, d)
        ids = torch.randperm(tail.num_blocks, generator=g)[:-(-n // bs)]
        slots = (ids[torch.arange(n) // bs] * bs + torch.arange(n) % bs).long()
        ops.store(tail, k, v, slots)
        outs.append(recent_prefill_attention(q, pages, tail, tables, lens, qsl, params, recent=20, sinks=5,
                                             tail_block_tables=ids.to(torch.int32)[None]))
    assert torch.allclose(outs[0], outs[1], atol=1e-5)
    with pytest.raises(ConfigError, match="block size"):
        recent_prefill_attention(q, pages, make_layer(tc, tc, 20, 8, h, d), tables, lens, qsl, params, recent=20)
