"""Trust boundaries of the shared prefix store on disk (issue 12, storage-tier items 1-4 and 10):
a store needs a model identity and keys every K/V setting; its keys and records are keyed by the
operator's secret (no chain hash stored, forged values are misses); reads of untrusted entries are
bounded and never block; damaged entries are replaced; small tier defects."""

from __future__ import annotations

import errno
import os
import pathlib
import threading
import warnings

import pytest
import torch

from pagedkv.alloc.hashing import chain, root_hash
from pagedkv.cache import CacheConfig, PagedCache
from pagedkv.errors import ConfigError
from pagedkv.cache import PagedCache
from pagedkv.offload import DiskTier, OffloadConfig, TierWarning
from pagedkv.offload.record import encode_record, parse_header
from pagedkv.bench.toy import ToyLM

PROMPT = [(7 * i + 3) % 97 for i in range(45)]  # 5 full blocks of 8 can hit


def _cfg(**kw):
    base = dict(num_layers=2, num_kv_heads=2, head_dim=32, kv_format="q8_0", block_size=8,
                num_blocks=32, high_precision_layers=0, model_id="toy-trust")
    base.update(kw)
    return CacheConfig(**base)


def _cache(tmp_path, cfg=None, **kw):
    return PagedCache(cfg or _cfg(), OffloadConfig(prefix_store="disk",
                                                    prefix_dir=str(tmp_path / "prefix"), **kw))


def _entries(tmp_path):
    return sorted((p for p in (tmp_path / "prefix").rglob("pkv*") if p.parent.name != ".tmp"),
                  key=lambda p: p.stat().st_mtime_ns)


@pytest.fixture(scope="module")
def baseline():
    return ToyLM(PagedCache(_cfg())).generate(PROMPT, 8)


# ---- 1: model identity and every K/V setting --------------------------------------------------
def test_a_prefix_store_refuses_to_start_without_a_model_identity(tmp_path):
    with pytest.raises(ConfigError, match=r"model_id=.*weights_identity"):
        _cache(tmp_path, _cfg(model_id=""))
    assert not (tmp_path / "prefix").exists()  # refused before opening anything
    PagedCache(_cfg(model_id=""), OffloadConfig(resident_blocks_per_seq=2, swap="memory"))


def test_sliding_window_is_part_of_the_key(tmp_path):
    # a prefix store needs every token kept: the sliding layers stay in the global group
    slide = dict(sliding_window=16, reclaim_sliding=False)
    ToyLM(_cache(tmp_path, _cfg(**slide))).generate(PROMPT, 2)
    assert _cache(tmp_path, _cfg()).add_sequence(PROMPT).hit_tokens == 0
    assert _cache(tmp_path, _cfg(**slide)).add_sequence(PROMPT).hit_tokens == 40


def test_weights_identity_tells_checkpoints_apart():
    from pagedkv.offload import weights_identity

    torch.manual_seed(0)
    a = torch.nn.Sequential(torch.nn.Linear(300, 300), torch.nn.Linear(300, 4))
    b = torch.nn.Sequential(torch.nn.Linear(300, 300), torch.nn.Linear(300, 4))
    assert weights_identity(a) == weights_identity(a.state_dict())
    assert weights_identity(a) != weights_identity(b)
    with torch.no_grad():
        b.load_state_dict(a.state_dict())
        assert weights_identity(a) == weights_identity(b)
        b[0].weight.mul_(1.001)  # a fine-tune touches every sampled element of a tensor
    assert weights_identity(a) != weights_identity(b)
    with pytest.raises(ConfigError, match="Module or a state dict"):
        weights_identity("model")


# ---- 2: keyed store keys, sealed records --------------------------------------------------------
def test_no_chain_hash_is_stored_and_keys_need_the_secret(tmp_path):
    cfg = _cfg()
    ToyLM(_cache(tmp_path, store_secret="secret-A-0123456789")).generate(PROMPT, 8, salt="t1")
    chains = chain(root_hash(cfg.fingerprint, "t1"), PROMPT, cfg.block_size)
    stored = [(p.name, p.read_bytes()) for p in _entries(tmp_path)]
    assert len(stored) == 6
    for name, value in stored:  # a reader learns no chain hash, so cannot walk to next blocks
        for h in chains:
            assert h not in value and h.hex() not in name
    other = _cache(tmp_path, store_secret="secret-B-0123456789")
    assert other.add_sequence(PROMPT, salt="t1").hit_tokens == 0  # another secret: other keys
    same = _cache(tmp_path, store_secret="secret-A-0123456789")
    assert same.add_sequence(PROMPT, salt="t1").hit_tokens == 40
    with pytest.raises(ConfigError, match="at least 16 bytes"):
        OffloadConfig(prefix_store="disk", store_secret="short")
    assert "secret-A" not in repr(OffloadConfig(store_secret="secret-A-0123456789"))


def test_a_value_forged_without_the_secret_is_never_loaded(tmp_path, baseline):
    a = _cache(tmp_path)
    ToyLM(a).generate(PROMPT, 8)
    layout = a.layout
    for p in _entries(tmp_path):  # well-formed records (valid checksums), zeroed K/V
        old = p.read_bytes()
        head = parse_header(old)
        zeros = [(bytes(lay.k_bytes), bytes(lay.v_bytes)) for lay in layout.layers]
        rec = encode_record(layout, head.key, zeros)
        p.write_bytes(rec + old[len(rec):])
    b = _cache(tmp_path)
    rb = ToyLM(b).generate(PROMPT, 8)
    assert rb.hit_tokens == 0 and rb.tokens == baseline.tokens
    assert b.offload_stats()["prefix"]["damaged_removed"] == 1


def test_a_value_moved_to_another_key_is_a_miss(tmp_path, baseline):
    ToyLM(_cache(tmp_path)).generate(PROMPT, 8)
    files = _entries(tmp_path)
    files[1].write_bytes(files[0].read_bytes())
    rb = ToyLM(_cache(tmp_path)).generate(PROMPT, 8)
    assert rb.hit_tokens == 8 and rb.tokens == baseline.tokens


def test_namespaces_are_separate_directories(tmp_path):
    ToyLM(_cache(tmp_path, store_namespace="tenant-a")).generate(PROMPT, 2)
    assert (tmp_path / "prefix" / "tenant-a" / ".secret").is_file()
    assert _cache(tmp_path, store_namespace="tenant-b").add_sequence(PROMPT).hit_tokens == 0
    assert _cache(tmp_path, store_namespace="tenant-a").add_sequence(PROMPT).hit_tokens == 40
    with pytest.raises(ConfigError, match="store_namespace"):
        OffloadConfig(store_namespace="../x")


# ---- 3: bounded, non-blocking reads of untrusted entries ----------------------------------------
def test_a_fifo_under_a_key_does_not_hang_the_lookup(tmp_path, baseline):
    ToyLM(_cache(tmp_path)).generate(PROMPT, 8)
    victim = _entries(tmp_path)[0]
    victim.unlink()
    os.mkfifo(victim)
    out = {}

    def run():
        out["new"] = _cache(tmp_path).add_sequence(PROMPT)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout=20)
    assert not t.is_alive(), "add_sequence blocked on a FIFO in the store"
    assert out["new"].hit_tokens == 0


def test_an_oversized_entry_is_not_read(tmp_path, baseline):
    ToyLM(_cache(tmp_path)).generate(PROMPT, 8)
    files = _entries(tmp_path)
    size = files[0].stat().st_size
    with open(files[1], "r+b") as f:
        f.truncate(64 << 20)  # sparse: 64 MiB to a reader that reads it whole
    b = _cache(tmp_path)
    assert b.add_sequence(PROMPT).hit_tokens == 8
    assert b.prefix.tier.stats.bytes_read <= 2 * size


def test_a_directory_under_a_key_is_a_miss_and_is_replaced(tmp_path, baseline):
    ToyLM(_cache(tmp_path)).generate(PROMPT, 8)
    victim = _entries(tmp_path)[0]
    victim.unlink()
    victim.mkdir()
    rb = ToyLM(_cache(tmp_path)).generate(PROMPT, 8)
    assert rb.hit_tokens == 0 and rb.tokens == baseline.tokens and victim.is_file()


def test_a_symlink_under_a_key_is_not_followed(tmp_path):
    ToyLM(_cache(tmp_path)).generate(PROMPT, 8)
    victim = _entries(tmp_path)[0]
    target = tmp_path / "elsewhere"
    target.write_bytes(victim.read_bytes())
    victim.unlink()
    victim.symlink_to(target)
    assert _cache(tmp_path).add_sequence(PROMPT).hit_tokens == 0


# ---- 10: small tier defects ----------------------------------------------------------------------
def test_disk_fan_out_spreads_keys_over_directories(tmp_path):
    t = DiskTier(tmp_path / "d")
    for i in range(64):
        t.put(f"pkv2.{i:040x}", b"x")
    dirs = {p.parent.name for p in (tmp_path / "d").rglob("pkv2.*")}
    assert len(dirs) > 16 and "pk" not in dirs


def test_opening_a_disk_tier_does_not_rescan_it(tmp_path, monkeypatch):
    t = DiskTier(tmp_path / "d", limit_bytes=1 << 20)
    for i in range(50):
        t.put(f"k{i:03d}", b"y" * 10)
    listed = []
    for name in ("listdir", "scandir"):
        real = getattr(os, name)

        def counting(path=".", _real=real):
            listed.append(str(path))
            return _real(path)

        monkeypatch.setattr(os, name, counting)
    again = DiskTier(tmp_path / "d", limit_bytes=1 << 20)
    assert again.get("k007") == b"y" * 10
    again.put("k999", b"z")
    assert listed == [] and len(again) == 51 and again.used_bytes == 501


def test_tier_keys_cannot_escape_the_root(tmp_path):
    t = DiskTier(tmp_path / "d")
    for key in ("..x", ".secret", ".tmp", "-x"):
        with pytest.raises(ConfigError, match="starting with"):
            t.put(key, b"v")
    assert not (tmp_path / "x").exists()


def test_a_read_only_prefix_directory_serves_reads(tmp_path, monkeypatch, baseline):
    ToyLM(_cache(tmp_path)).generate(PROMPT, 8)
    real_mkdir = pathlib.Path.mkdir

    def read_only(self, *a, **kw):
        if str(self).startswith(str(tmp_path / "prefix")):
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real_mkdir(self, *a, **kw)

    monkeypatch.setattr(pathlib.Path, "mkdir", read_only)
    monkeypatch.setattr(os, "link", lambda *a: (_ for _ in ()).throw(OSError(errno.EROFS, "ro")))
    b = _cache(tmp_path)
    assert b.prefix.tier.read_only
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rb = ToyLM(b).generate(PROMPT + [1, 2, 3, 4, 5, 6, 7, 8], 8)
    assert rb.hit_tokens == 40 and rb.prefilled == 13
    w = [x for x in caught if issubclass(x.category, TierWarning)]
    assert len(w) == 1 and "read-only" in str(w[0].message)


def test_tiered_cache_accepts_tensor_prompts(tmp_path, baseline):
    ToyLM(_cache(tmp_path)).generate(PROMPT, 8)
    b = _cache(tmp_path)
    new = b.add_sequence(torch.tensor(PROMPT))
    assert new.hit_tokens == 40 and b.seqs.tokens(new.seq_id) == PROMPT


@pytest.mark.parametrize("tiered", [False, True])
def test_token_ids_past_int64_are_refused_at_admission(tmp_path, tiered):
    cache = _cache(tmp_path) if tiered else PagedCache(_cfg())
    with pytest.raises(ConfigError, match=r"\[0, 2\*\*63\)"):
        cache.add_sequence([1] * 8 + [1 << 63])
    assert cache.sequence_ids() == []
    sid = cache.add_sequence([1, 2, 3]).seq_id
    with pytest.raises(ConfigError, match=r"\[0, 2\*\*63\)"):
        cache.step([sid], [[1 << 64]])


def test_calibration_is_part_of_the_layout():
    """k_mult and v_centre change the stored bytes' meaning: another layout, another store key."""
    import dataclasses

    from pagedkv.offload import BlockLayout

    layers = PagedCache(_cfg()).layers
    base = BlockLayout.from_layers(layers).fingerprint
    h, d = layers[0].num_kv_heads, layers[0].head_dim
    for field in ("k_mult", "v_centre"):
        changed = [dataclasses.replace(layers[0], **{field: torch.full((h, d), 2.0)})] + \
            list(layers[1:])
        assert BlockLayout.from_layers(changed).fingerprint != base, field


def test_weights_identity_samples_tensors_past_2_to_the_24_elements():
    """A float32 linspace of sample positions rounds the last one past the end above 2**24
    elements (SmolLM2's embedding has 28.3M): the positions are computed in integers."""
    from pagedkv.offload import weights_identity

    big = torch.zeros((1 << 24) + 3, dtype=torch.bfloat16)
    a = weights_identity({"w": big})
    big[-1] = 1.0  # the last element is sampled
    assert weights_identity({"w": big}) != a


def test_no_config_that_holds_a_redis_url_prints_its_password():
    """Every dataclass with a `redis_url` field (the offload settings, `bench offload`'s) prints
    it redacted: a password must not reach a log through a repr (issue 28, N3)."""
    from pagedkv.bench.config import OffloadBench

    url = "redis://user:hunter2-secret@127.0.0.1:6379/0?password=hunter3-secret"
    for config in (OffloadConfig(redis_url=url), OffloadBench(redis_url=url)):
        text = repr(config)
        assert "hunter2" not in text and "hunter3" not in text, text
        assert "redis_url=redis://user:***@127.0.0.1:6379/0" in text, text
