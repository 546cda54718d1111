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
