"""Settings and plan files that escaped ConfigError, and a plan's recent window (issue 28: N6, N8):
a plan file is a few kilobytes of JSON, so only a regular file is read, non-blocking and at most
a size cap; JSON too deep or integers too long for Python's parser, in a plan, in the vLLM
settings or in a `+hpN` / `+rR` suffix, are ConfigErrors; `CacheConfig(kv_format="plan.json")`
keeps the plan's recent window (its bit budget counts it) or refuses a conflicting one."""

from __future__ import annotations

import json
import os
import threading

import pytest

from pagedkv.cache import CacheConfig
from pagedkv.errors import ConfigError
from pagedkv.formats import read_plan
from pagedkv.ops.recent import RecentWindow


def _plan(tmp_path, recent=None, name="plan.json"):
    doc = {"pagedkv_plan": 1, "layers": [{"k": "turbo3", "v": "q8_0"}, {"k": "q8_0", "v": "q8_0"}],
           "layer_dims": [[2, 64], [2, 64]], "recent_window": recent}
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return str(path)


def _cfg(kv_format, **kw):
    return CacheConfig(num_layers=2, num_kv_heads=2, head_dim=64, kv_format=kv_format,
                       num_blocks=16, **kw)


# ---- N6: a plan's recent window ------------------------------------------------------------------
def test_a_plan_file_brings_its_recent_window(tmp_path):
    path = _plan(tmp_path, {"tokens": 16, "codec": "q8_0", "sinks": 4})
    cfg = _cfg(path)
    assert cfg.recent_window == RecentWindow(16, "q8_0", sinks=4)
    assert _cfg(path, recent_window=RecentWindow(16, "q8_0", sinks=4)).fingerprint == cfg.fingerprint
    with pytest.raises(ConfigError, match="recent"):
        _cfg(path, recent_window=RecentWindow(8))
    assert _cfg(_plan(tmp_path, None, "plain.json")).recent_window is None


# ---- N8: plan files --------------------------------------------------------------------------------
def _refused_quickly(fn, match):
    out = {}

    def run():
        try:
            fn()
        except ConfigError as exc:
            out["err"] = str(exc)
        except BaseException as exc:  # noqa: BLE001 - reported below
            out["other"] = repr(exc)[:200]

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout=30)
    assert not t.is_alive(), "the read hung"
    assert "err" in out, out
    assert match in out["err"], out["err"]


def test_a_plan_must_be_a_small_regular_file(tmp_path):
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    _refused_quickly(lambda: read_plan(str(fifo)), "not a regular file")
    _refused_quickly(lambda: _cfg(str(fifo)), "not a regular file")
    zero = tmp_path / "zero.json"
    zero.symlink_to("/dev/zero")
    _refused_quickly(lambda: read_plan(str(zero)), "not a regular file")
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(1 << 30)  # sparse: a GiB to a reader that reads it whole
    _refused_quickly(lambda: read_plan(str(big)), "bytes")


def test_json_the_parser_cannot_take_is_a_config_error(tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text('{"pagedkv_plan": 1, "layers": ' + "[" * 100_000 + "]" * 100_000 + "}")
    _refused_quickly(lambda: read_plan(str(deep)), "deep")
    digits = tmp_path / "digits.json"
    digits.write_text('{"pagedkv_plan": ' + "9" * 5000 + ', "layers": []}')
    _refused_quickly(lambda: read_plan(str(digits)), "JSON")


def test_settings_json_and_suffixes_the_parser_cannot_take(tmp_path):
    from pagedkv.integrations.vllm.settings import parse_settings

    for text in ('{"kv_format": ' + "[" * 100_000 + "]" * 100_000 + "}",
                 '{"kv_format": "turbo3", "calibration_tokens": ' + "9" * 5000 + "}"):
        with pytest.raises(ConfigError, match="JSON"):
            parse_settings(text, environ={})
    for name in ("turbo3+hp" + "9" * 5000, "turbo3+r" + "9" * 5000, "turbo3+r4s" + "9" * 5000):
        with pytest.raises(ConfigError, match="digit"):
            parse_settings({"kv_format": name}, environ={})
        with pytest.raises(ConfigError, match="digit"):
            _cfg(name)
