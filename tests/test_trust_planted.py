"""Planted files (issue 28): what another local user leaves where this process looks for its own
state. A disk prefix store trusts a generated secret only in a private directory (N1); the vLLM
statistics cache loads only private, well-formed files (N2)."""

from __future__ import annotations

import os

import pytest

from pagedkv.bench.toy import ToyLM
from pagedkv.cache import CacheConfig, PagedCache
from pagedkv.errors import ConfigError
from pagedkv.offload import OffloadConfig
from helpers.other_user import OTHER_UID, plant_tree, shared_dir, skip_reason, tree_files

PROMPT = [(7 * i + 3) % 97 for i in range(45)]  # 5 full blocks of 8 can hit
SECRET = bytes(range(100, 132))  # the secret the other user plants (32 bytes, like a generated one)


def _cfg():
    return CacheConfig(num_layers=2, num_kv_heads=2, head_dim=32, kv_format="q8_0", block_size=8,
                       num_blocks=32, high_precision_layers=0, model_id="toy-planted")


def _disk(prefix_dir, **kw):
    return PagedCache(_cfg(), OffloadConfig(prefix_store="disk", prefix_dir=str(prefix_dir), **kw))


@pytest.fixture(scope="module")
def baseline():
    return ToyLM(PagedCache(_cfg())).generate(PROMPT, 8)


def _planted_store(scratch) -> dict:
    """The files of a store whose secret the attacker knows, holding other K/V for PROMPT (another
    model's weights: seed 1) under the keys the victim's cache computes from that secret."""
    ToyLM(_disk(scratch, store_secret=SECRET), seed=1).generate(PROMPT, 8)
    files = tree_files(str(scratch))
    files[".secret"] = SECRET
    return files


# ---- N1: the disk store's generated secret ------------------------------------------------------
def test_a_store_directory_made_by_another_user_is_refused(tmp_path, baseline):
    if skip_reason():
        pytest.skip(skip_reason())
    files = _planted_store(tmp_path / "scratch")
    with shared_dir() as shared:
        prefix = os.path.join(shared, "prefix")
        plant_tree(prefix, files)  # the other user made the directory first
        assert os.stat(prefix).st_uid == OTHER_UID
        with pytest.raises(ConfigError, match=r"owned by uid 65534.*store_secret="):
            _disk(prefix)
        # with the operator's own secret the planted entries are plain misses
        run = ToyLM(_disk(prefix, store_secret="operator-secret-0123456789")).generate(PROMPT, 8)
        assert run.hit_tokens == 0 and run.tokens == baseline.tokens


def test_a_secret_another_user_can_replace_is_refused(tmp_path, baseline):
    ToyLM(_disk(tmp_path / "p")).generate(PROMPT, 8)  # the store made its own secret, privately
    assert (tmp_path / "p").stat().st_mode & 0o777 == 0o700
    os.chmod(tmp_path / "p", 0o777)  # a group/other-writable directory: .secret replaceable
    with pytest.raises(ConfigError, match=r"writable by group or others.*store_secret="):
        _disk(tmp_path / "p")
    os.chmod(tmp_path / "p", 0o700)
    assert _disk(tmp_path / "p").add_sequence(PROMPT).hit_tokens == 40
    secret = tmp_path / "p" / ".secret"
    os.chmod(secret, 0o666)
    with pytest.raises(ConfigError, match=r"\.secret.*writable by group or others.*store_secret="):
        _disk(tmp_path / "p")
    os.chmod(secret, 0o600)
    if os.geteuid() == 0:  # a secret file that belongs to someone else
        os.chown(secret, OTHER_UID, OTHER_UID)
        with pytest.raises(ConfigError, match=r"owned by uid 65534.*store_secret="):
            _disk(tmp_path / "p")
        os.chown(secret, 0, 0)
    real = tmp_path / "elsewhere"
    real.write_bytes(secret.read_bytes())
    secret.unlink()
    secret.symlink_to(real)
    with pytest.raises(ConfigError, match="store_secret="):
        _disk(tmp_path / "p")


# ---- N2: the vLLM statistics cache --------------------------------------------------------------
def _fit_setup(tmp_path):
    """A model folder (its identity names the statistics file), a fit plan and one layer's
    fitted statistics (2 kv heads, head dim 64)."""
    import torch

    from pagedkv.cache.calibration import CalibrationOptions, calibrate
    from pagedkv.formats import parse_format
    from pagedkv.integrations.vllm.fit import FitPlan

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    plan = FitPlan.build([parse_format("turbo3")], None, None, False)
    g = torch.Generator().manual_seed(0)
    k, v, q = (torch.randn(1, h, 40, 64, generator=g) for h in (2, 2, 4))
    cal = calibrate(k, v, q, "turbo3", "turbo3", CalibrationOptions(True, False, True), "cpu")
    return str(model), plan, cal


def _stats_name(model, plan):
    from pagedkv.integrations.vllm.fit import model_identity

    return plan.key(model_identity(model), 512) + ".pt"


def _stats_bytes(tmp_path, layers) -> bytes:
    import torch

    from pagedkv.integrations.vllm.fit import FIT_VERSION

    p = tmp_path / "made.pt"
    torch.save({"version": FIT_VERSION, "layers": layers}, p)
    return p.read_bytes()


def test_statistics_planted_by_another_user_are_refused(tmp_path):
    if skip_reason():
        pytest.skip(skip_reason())
    import torch

    from pagedkv.integrations.vllm.fit import fit

    model, plan, cal = _fit_setup(tmp_path)
    hostile = {"k_centre": torch.full((2, 64), 3.0), "v_centre": torch.full((2, 64), -5.0)}
    with shared_dir() as shared:
        cache = os.path.join(shared, "vllm")
        plant_tree(cache, {_stats_name(model, plan): _stats_bytes(tmp_path, [hostile])})
        with pytest.raises(ConfigError, match=r"cache_dir .*owned by uid 65534"):
            fit(model, plan, 512, cache)  # main loaded it: the hostile centres in every output


def test_statistics_files_are_checked_before_use(tmp_path):
    import torch

    from pagedkv.integrations.vllm.fit import fit, load, save

    model, plan, cal = _fit_setup(tmp_path)
    cache = tmp_path / "vllm"
    name = cache / _stats_name(model, plan)
    save(str(name), [cal])
    assert cache.stat().st_mode & 0o777 == 0o700 and name.stat().st_mode & 0o077 == 0
    got = fit(model, plan, 512, str(cache), [(2, 64)])  # read back, not fitted (no model there)
    assert torch.equal(got[0].k_centre, cal.k_centre)
    for bad, match in (([{"k_centre": torch.full((2, 64), float("nan"))}], "finite"),
                       ([{"k_centre": torch.zeros(4, 64)}], r"shape \(2, 64\)"),
                       ([{"v_scale": torch.zeros(1)}], r"> 0"),
                       ([{"k_centre": torch.zeros(2, 64, dtype=torch.float64)}], "float32"),
                       ([1], "not a mapping"), ({"x": 1}, "not a pagedkv statistics file")):
        name.write_bytes(_stats_bytes(tmp_path, bad))
        with pytest.raises(ConfigError, match=match):
            fit(model, plan, 512, str(cache), [(2, 64)])
        with pytest.raises(ConfigError, match=match):
            load(str(name), 1, [(2, 64)])
    name.unlink()
    os.mkfifo(name)  # never blocks
    with pytest.raises(ConfigError, match="not a regular file"):
        fit(model, plan, 512, str(cache), [(2, 64)])
    name.unlink()
    name.symlink_to(tmp_path / "made.pt")
    with pytest.raises(ConfigError, match="cannot be opened"):
        fit(model, plan, 512, str(cache), [(2, 64)])
    name.unlink()
    os.chmod(cache, 0o777)
    with pytest.raises(ConfigError, match=r"cache_dir .*writable by group or others"):
        fit(model, plan, 512, str(cache), [(2, 64)])


def test_saving_statistics_never_follows_a_planted_temporary_name(tmp_path):
    from pagedkv.integrations.vllm.fit import load, save

    _, _, cal = _fit_setup(tmp_path)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    path = tmp_path / "vllm" / "x.pt"
    path.parent.mkdir()
    (tmp_path / "vllm" / f"x.pt.{os.getpid()}.tmp").symlink_to(victim)  # the old temporary name
    save(str(path), [cal])
    assert victim.read_bytes() == b"precious"
    assert load(str(path), 1, [(2, 64)])[0].v_centre is not None


def test_cache_dir_type_is_checked_when_the_settings_are_parsed():
    from pagedkv.integrations.vllm.settings import parse_settings

    for bad in (5, ["a"], "", {"x": 1}):
        with pytest.raises(ConfigError, match="cache_dir must be a directory path"):
            parse_settings({"kv_format": "turbo3", "cache_dir": bad})
    assert parse_settings({"kv_format": "turbo3", "cache_dir": None}).cache_dir is None
