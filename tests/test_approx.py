"""`pagedkv.approx.Approximation`: the approximate attention paths as one setting every front door
carries (the transformers drop-in, vLLM's settings, `pagedkv eval / generate --approx`).

The paths' own error bounds are tested at the kernel (test_cpu_int8.py, test_cpu_prefill.py);
here: the text form, its refusals, and that each front door puts the setting into the
AttentionParams of every attention call it makes, and nowhere else (eval's bf16 reference).
"""

from __future__ import annotations

import importlib

import pytest
import torch

from pagedkv.approx import Approximation
from pagedkv.errors import ConfigError
from pagedkv.ops import AttentionParams

from helpers.tiny_llama import approx_model


def test_text_form_round_trips():
    assert Approximation.parse(None) == Approximation.parse("") == Approximation.parse("exact") == Approximation()
    a = Approximation.parse(" int8_scores , sparse_v_threshold=0.001,bf16_dots")
    assert a == Approximation(int8_scores=True, bf16_dots=True, sparse_v_threshold=0.001)
    assert a.name == "int8_scores,bf16_dots,sparse_v_threshold=0.001"
    assert Approximation.parse(a.name) == a and Approximation.parse(a) is a
    assert Approximation().name == "exact" and Approximation().exact and not a.exact


@pytest.mark.parametrize("bad, says", [
    ("int8", "unknown item 'int8'"), ("int8_scores=1", "unknown item"), ("sparse_v_threshold", "unknown item"),
    ("sparse_v_threshold=x", "must be a number"), ("sparse_v_threshold=0", "in (0, 1)"),
    ("sparse_v_threshold=1.5", "in (0, 1)"), ("int8_scores,int8_scores", "twice"), (3, "must be a string"),
])
def test_bad_text_is_refused_naming_it(bad, says):
    with pytest.raises(ConfigError, match=r"approx") as exc:
        Approximation.parse(bad)
    assert says in str(exc.value)


def test_bad_fields_are_refused():
    with pytest.raises(ConfigError, match="int8_scores must be True or False"):
        Approximation(int8_scores=1)
    with pytest.raises(ConfigError, match=r"sparse_v_threshold must be a number in \[0, 1\)"):
        Approximation(sparse_v_threshold=float("nan"))


def test_apply_sets_the_switches_and_keeps_the_rest():
    p = AttentionParams(scale=0.125, sliding_window=8, soft_cap=30.0)
    assert Approximation().apply(p) is p
    q = Approximation(int8_scores=True, sparse_v_threshold=0.01).apply(p)
    assert (q.scale, q.sliding_window, q.soft_cap) == (0.125, 8, 30.0)
    assert (q.int8_scores, q.bf16_dots, q.sparse_v_threshold) == (True, False, 0.01)


def test_vllm_settings_take_it():
    from pagedkv.integrations.vllm.settings import parse_settings

    s = parse_settings({"kv_format": "turbo3", "approx": "int8_scores"})
    assert s.approx == Approximation(int8_scores=True) and "approx int8_scores" in s.label
    assert parse_settings("turbo3").approx.exact
    with pytest.raises(ConfigError, match="unknown item 'fast'"):
        parse_settings({"kv_format": "turbo3", "approx": "fast"})


def test_cli_refuses_a_bad_spec_in_one_line(capsys):
    from pagedkv.cli.main import main

    for argv in (["eval", "--approx", "int9"], ["generate", "hi", "--approx", "sparse_v_threshold=2"]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "approx" in err


# ---------------------------------------------------------------------------- the drop-in
pytest.importorskip("transformers")


def _run(model, approx, spy):
    """Prefill 40 tokens then 3 decode steps; the logits of every position."""
    from pagedkv.integrations.transformers import PagedKVCache

    cache = PagedKVCache(model, "turbo3", approx=approx)
    ids = torch.randint(3, 96, (1, 43), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = [model(ids[:, :40], cache=cache, use_cache=True).logits]
        out += [model(ids[:, j:j + 1], cache=cache, use_cache=True).logits for j in range(40, 43)]
    return torch.cat(out, dim=1)[0].float()


@pytest.fixture
def seen(monkeypatch):
    """The AttentionParams of every decode / prefill call the drop-in makes."""
    hf = importlib.import_module("pagedkv.ops.api")  # the drop-in attends through the engine cache
    calls = []
    for name in ("decode_attention", "prefill_attention"):
        real = getattr(hf, name)

        def spy(*args, _real=real, _name=name, **kw):
            calls.append((_name, next(a for a in args if isinstance(a, AttentionParams))))
            return _real(*args, **kw)

        monkeypatch.setattr(hf, name, spy)
    return calls


def test_drop_in_passes_it_to_every_call(seen):
    model = approx_model()
    exact = _run(model, None, seen)
    assert {n for n, _ in seen} == {"decode_attention", "prefill_attention"}
    assert not any(p.int8_scores or p.bf16_dots or p.sparse_v_threshold for _, p in seen)
    seen.clear()
    approx = _run(model, "int8_scores,bf16_dots", seen)
    assert seen and all(p.int8_scores and p.bf16_dots and p.sparse_v_threshold == 0 for _, p in seen)
    # the paths' bounds are the kernel tests'; here only that the model's logits stay close
    scale = float(exact.abs().max())
    torch.testing.assert_close(approx, exact, atol=0.05 * scale, rtol=0)


def test_drop_in_int8_scores_change_the_decode_where_the_kernel_has_them():
    """On a CPU build with the integer path (AVX2, AVX-512) the decode logits move (the setting
    reaches the kernel); the prefill, which int8_scores does not touch, stays bit-identical."""
    from pagedkv.ops import cpu

    if cpu.kernel_info().get("variant") not in ("avx2", "avx512"):
        pytest.skip("no integer score path in this build")
    model = approx_model()
    exact = _run(model, None, [])
    approx = _run(model, "int8_scores", [])
    assert torch.equal(approx[:40], exact[:40])
    assert not torch.equal(approx[40:], exact[40:])


def test_drop_in_refuses_a_bad_setting_before_building():
    from pagedkv.integrations.transformers import PagedKVCache

    with pytest.raises(ConfigError, match="unknown item 'int4'"):
        PagedKVCache(approx_model(), "turbo3", approx="int4")


def test_eval_keeps_its_bf16_reference_exact():
    """With --approx the listed bf16 row is computed with the setting and compared with an exact
    bf16 pass: KL > 0 where the kernel has the bf16 prefill path, 0 where it computes exactly."""
    from pagedkv.eval.config import EvalConfig
    from pagedkv.eval.runner import evaluate
    from pagedkv.eval.text import make_windows
    from pagedkv.ops import cpu

    att = importlib.import_module("pagedkv.ops.cpu.attention")  # the module (cpu.attention is a function)
    model = approx_model(head_dim=64)
    windows = make_windows(torch.randint(3, 96, (400,)), 2, 48, bos=1)
    cfg = EvalConfig(formats=("bf16", "turbo3"), windows=2, window_tokens=48, memory_bytes=2**20, decode_steps=0,
                     approx=Approximation(bf16_dots=True))
    rows = {r["format"]: r for r in evaluate(model, windows, cfg)}
    assert all(r["approx"] == "bf16_dots" for r in rows.values())
    has_bf16 = cpu.available() and att._prefill_entry(cpu._require(), True) is not att._prefill_entry(cpu._require())
    assert (rows["bf16"]["kl"] > 0) == bool(has_bf16)
    assert rows["bf16"]["kl"] < 1e-3 and rows["turbo3"]["kl"] > rows["bf16"]["kl"]
