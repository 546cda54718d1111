"""The vLLM connector's store side without vLLM (`integrations/vllm/fleet.py`): pages published by
one rank load bit-exact into another instance's blocks; keys bind the format, the statistics, the
model, the rank and the namespace (anything else is a miss, never a mix); a damaged entry is a
miss and is deleted; records carry the catalogue's page bytes. Engines: tests_vllm/test_fleet.py.
"""

import pytest
import torch

from pagedkv.cache.calibration import Calibration
from pagedkv.errors import ConfigError
from pagedkv.formats import parse_format
from pagedkv.integrations.vllm.fleet import (ConnectorSettings, RankPages, model_identity, open_store, probe,
                                             rank_identity)
from pagedkv.integrations.vllm.layout import content_bytes, page_bytes, paged_layer

H, D, BS, BLOCKS, LAYERS = 2, 64, 16, 6, 3
CHAINS = [bytes([i]) * 16 for i in range(4)]


def _pages(fmt="turbo3", centre_seed=0, layers=LAYERS):
    """A rank's PagedLayers over vLLM-shaped page tensors filled with random bytes."""
    f = parse_format(fmt)
    g = torch.Generator().manual_seed(centre_seed)
    out = []
    for _ in range(layers):
        kv = torch.randint(0, 256, (BLOCKS, H, BS, content_bytes(f, D)), dtype=torch.uint8)
        cal = Calibration(k_centre=torch.randn(H, D, generator=g))
        out.append(paged_layer(kv, f, H, D, cal))
    return out


def _rank(tmp_path, layers, *, model="m", rank=0, size=1, namespace=""):
    settings = ConnectorSettings.parse({"path": str(tmp_path / "store"), "namespace": namespace})
    ident = rank_identity(model, "torch.float32", BS, rank, size)
    return RankPages(layers, open_store(settings, ident), ident)


def _probe(pages: RankPages) -> int:
    return probe([(pages.store, pages.layout)], CHAINS)


def test_published_pages_load_bit_exact_into_another_instances_blocks(tmp_path):
    a = _rank(tmp_path, _pages())
    assert a.publish([(b, c) for b, c in zip((5, 1, 3, 0), CHAINS)]) == 4
    b = _rank(tmp_path, [pl for pl in _pages()])  # same format and statistics, other bytes
    assert _probe(b) == 4
    assert b.load([2, 4, 0, 1], CHAINS) == 4
    for la, lb in zip(a.layers, b.layers):
        for src, dst in zip((5, 1, 3, 0), (2, 4, 0, 1)):
            assert torch.equal(la.k_pool[src], lb.k_pool[dst]) and torch.equal(la.v_pool[src], lb.v_pool[dst])


@pytest.mark.parametrize("other", ["statistics", "format", "model", "rank", "namespace"])
def test_anything_else_is_a_miss(tmp_path, other):
    _rank(tmp_path, _pages()).publish(list(zip(range(4), CHAINS)))
    kw = {"model": "m2"} if other == "model" else {"rank": 1, "size": 2} if other == "rank" else \
        {"namespace": "tenant2"} if other == "namespace" else {}
    layers = _pages(centre_seed=1) if other == "statistics" else _pages("turbo4") if other == "format" \
        else _pages()
    assert _probe(_rank(tmp_path, layers, **kw)) == 0
    assert _probe(_rank(tmp_path, _pages())) == 4  # the same instance still hits


def test_a_damaged_entry_is_a_miss_and_is_deleted(tmp_path):
    a = _rank(tmp_path, _pages())
    a.publish(list(zip(range(4), CHAINS)))
    files = sorted(p for p in (tmp_path / "store").rglob("pkv*"))
    key = a.store.keys.key(a.layout, CHAINS[2])
    target = next(p for p in files if p.name == key)
    raw = bytearray(target.read_bytes())
    raw[len(raw) // 2] ^= 0x5A
    target.write_bytes(bytes(raw))
    assert _probe(a) == 2  # blocks 0, 1 intact; 2 damaged ends the hit
    assert not target.exists()  # deleted: the next publish replaces it
    a.publish(list(zip(range(4), CHAINS)))
    assert _probe(a) == 4


def test_records_carry_the_catalogues_page_bytes(tmp_path):
    for fmt in ("turbo3", "q8_0", "bf16"):
        pages = _rank(tmp_path, _pages(fmt))
        assert pages.page_bytes == LAYERS * page_bytes(parse_format(fmt), BS, H, D)
    t3 = _rank(tmp_path, _pages("turbo3")).page_bytes
    assert _rank(tmp_path, _pages("bf16")).page_bytes / t3 == pytest.approx(16 / 3.5)


def test_model_identity_follows_the_files_not_the_folder(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text('{"x": 1}')
        (tmp_path / name / "model.safetensors").write_bytes(bytes(range(256)) * 100)
    assert model_identity(str(tmp_path / "a")) == model_identity(str(tmp_path / "b"))
    (tmp_path / "b" / "model.safetensors").write_bytes(bytes(range(255, -1, -1)) * 100)
    assert model_identity(str(tmp_path / "a")) != model_identity(str(tmp_path / "b"))
    assert model_identity("org/name", "abc") == "name:org/name@abc"


@pytest.mark.parametrize("extra, match", [
    ({"store": "s3"}, "'disk' or 'redis'"),
    ({}, "needs \"path\""),
    ({"path": "/x", "colour": 1}, "unknown kv_connector_extra_config key"),
    ({"store": "redis"}, "redis_url"),
    ({"store": "redis", "redis_url": "redis://127.0.0.1:1/0"}, "store_secret_file"),
    ({"path": "/x", "store_secret_file": "/nonexistent/secret"}, "cannot be read"),
    ({"path": "/x", "namespace": "a/b"}, "store_namespace"),
])
def test_bad_settings_are_refused_naming_them(extra, match):
    with pytest.raises(ConfigError, match=match):
        ConnectorSettings.parse(extra)


def test_a_rank_keeps_the_statistics_of_the_heads_vllm_gives_it():
    from pagedkv.integrations.vllm.fit import for_rank, rank_heads

    assert [rank_heads(4, 2, r) for r in (0, 1)] == [[0, 1], [2, 3]]
    assert [rank_heads(2, 4, r) for r in range(4)] == [[0], [0], [1], [1]]  # replicated, as vLLM
    assert rank_heads(3, 1, 0) == [0, 1, 2]
    with pytest.raises(ConfigError, match="3 KV heads"):
        rank_heads(3, 2, 0)
    full = Calibration(k_centre=torch.randn(4, D), k_mult=torch.rand(4, D), v_centre=torch.randn(4, D),
                       k_scale=torch.tensor([0.5]))
    part = for_rank(full, rank_heads(4, 2, 1))
    assert torch.equal(part.k_centre, full.k_centre[2:]) and torch.equal(part.k_mult, full.k_mult[2:])
    assert torch.equal(part.v_centre, full.v_centre[2:]) and part.k_scale is full.k_scale
    assert for_rank(Calibration(), [0]).k_centre is None


def test_the_stores_description_never_shows_a_redis_password(tmp_path):
    """The connector logs where its store is (`settings.where`) at engine start: a password in
    `redis_url` must be shown as *** there, as everywhere (issue 28, N3)."""
    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * 32)
    secret.chmod(0o600)
    settings = ConnectorSettings.parse({"store": "redis", "redis_url": "redis://u:hunter2@127.0.0.1:6379/0",
                                        "store_secret_file": str(secret)})
    assert "hunter2" not in settings.where and "redis://u:***@127.0.0.1:6379/0" in settings.where


@pytest.mark.parametrize("name", ["turbo3", "q8_0", "fp8", "fp8k_turbo3v"])
def test_a_ranks_pages_are_its_heads_bytes_of_one_ranks_pages(name):
    """Under tensor parallelism each rank stores and attends its KV heads with the statistics
    `for_rank` cuts for them (`rank_heads`: vLLM's split); given the same keys, values and
    queries, a rank's pages are, row for row, its heads' bytes of the single rank's pages and its
    attention outputs its query heads' rows. (What TP=2 in vLLM can then still change is the
    inputs: tests_vllm/test_fleet_tp.py measures that, layer 0's pages equal byte for byte.)"""
    from pagedkv import ops
    from pagedkv.codecs.layout import block_views
    from pagedkv.integrations.vllm.fit import for_rank, rank_heads
    from pagedkv.ops.batch import AttentionParams

    f = parse_format(name)
    g = torch.Generator().manual_seed(1)
    heads, q_per_kv, t = 2, 3, 40
    cal = Calibration(k_centre=torch.randn(heads, D, generator=g), k_mult=torch.rand(heads, D, generator=g) + 0.5,
                      v_centre=torch.randn(heads, D, generator=g), k_scale=torch.tensor([0.07]),
                      v_scale=torch.tensor([0.05]))
    k, v = torch.randn(t, heads, D, generator=g) * 3, torch.randn(t, heads, D, generator=g)
    q = torch.randn(t, heads * q_per_kv, D, generator=g)
    slots = torch.arange(BS, BS + t)  # blocks 1..3
    tables = torch.tensor([[1, 2, 3]], dtype=torch.int32)
    lens = torch.tensor([t], dtype=torch.int32)
    qsl = torch.tensor([0, t], dtype=torch.int32)
    params = AttentionParams(scale=D ** -0.5)

    def serve(h, c, k, v, q):
        layer = paged_layer(torch.zeros(BLOCKS, h, BS, content_bytes(f, D), dtype=torch.uint8), f, h, D, c)
        ops.store(layer, k, v, slots)
        out = ops.prefill_attention(q, layer, tables, lens, qsl, params)
        rows = [torch.cat(block_views(codec, pool, BS, h, D), -1) for codec, pool in
                ((f.k, layer.k_pool), (f.v, layer.v_pool))]
        return rows, out

    rows, out = serve(heads, cal, k, v, q)
    for r in range(2):
        (hr,) = rank_heads(heads, 2, r)
        part_rows, part_out = serve(1, for_rank(cal, [hr]), k[:, hr:hr + 1], v[:, hr:hr + 1],
                                    q[:, hr * q_per_kv:(hr + 1) * q_per_kv])
        for whole, part in zip(rows, part_rows):
            assert torch.equal(part[:, :, 0], whole[:, :, hr])
        assert torch.equal(part_out, out[:, hr * q_per_kv:(hr + 1) * q_per_kv])
