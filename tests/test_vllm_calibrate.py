"""`python -m pagedkv.integrations.vllm.calibrate`: the statistics file the vLLM settings'
`calibration` key reads, fitted ahead of time as the engine would fit them at start (the
capture of the model's q/k/v is replaced by fixed tensors here; the engine suite runs it on a
real model). And every `python -m pagedkv...` a message names exists."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import torch

from pagedkv.cache.calibration import CalibrationOptions, calibrate
from pagedkv.integrations.vllm import calibrate as cal_cli
from pagedkv.integrations.vllm import fit as fit_mod
from pagedkv.integrations.vllm.settings import parse_settings

SRC = Path(__file__).resolve().parent.parent / "src" / "pagedkv"


def _layers():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(1, 4, 40, 64, generator=g), torch.randn(1, 2, 40, 64, generator=g) + 0.5,
             torch.randn(1, 2, 40, 64, generator=g) - 0.25) for _ in range(3)]


def test_the_file_holds_what_the_engine_fits(tmp_path, monkeypatch, capsys):
    layers = _layers()
    monkeypatch.setattr(fit_mod, "capture", lambda model_dir, tokens: layers)
    monkeypatch.setattr(cal_cli, "capture", lambda model_dir, tokens: layers)
    out = tmp_path / "stats.pt"
    assert cal_cli.main([str(tmp_path), "--kv-format", "turbo3+hp1", "--out", str(out), "--key-scaling"]) == 0
    assert str(out) in capsys.readouterr().out
    got = fit_mod.load(str(out), 3)
    for i, ((q, k, v), c) in enumerate(zip(layers, got)):
        k_codec, v_codec = ("q8_0", "q8_0") if i in (0, 2) else ("turbo3", "turbo3")  # +hp1: the ends in q8_0
        want = calibrate(k, v, q, k_codec, v_codec,
                         CalibrationOptions(key_centring=True, key_scaling=True, value_centring=True), "cpu")
        for name in ("k_centre", "k_mult", "v_centre"):
            assert torch.equal(getattr(c, name), getattr(want, name)), (i, name)
    assert parse_settings({"kv_format": "turbo3+hp1", "calibration": str(out)}, environ={}).calibration == str(out)


def test_a_bad_spec_is_one_line_before_any_capture(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cal_cli, "capture", lambda *a: (_ for _ in ()).throw(AssertionError("captured")))
    assert cal_cli.main([str(tmp_path), "--kv-format", "turbo3+r8zz9", "--out", str(tmp_path / "x.pt")]) == 2
    err = capsys.readouterr().err.strip()
    assert "zz9" in err and "\n" not in err


def test_every_module_a_message_names_exists():
    named = set()
    for path in SRC.rglob("*.py"):
        named |= set(re.findall(r"python -m (pagedkv(?:\.\w+)+)", path.read_text()))
    assert "pagedkv.integrations.vllm.calibrate" in named
    missing = [m for m in sorted(named) if importlib.util.find_spec(m) is None]
    assert not missing, missing
