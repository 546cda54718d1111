"""`pagedkv bench offload` measurement on tiny shapes: bytes per token follow the codecs."""

from __future__ import annotations

import pytest

from pagedkv.errors import ConfigError
from pagedkv.formats import parse_format
from pagedkv.bench import offload as bench


def test_bench_bytes_per_token_follow_the_format(tmp_path):
    res = bench.run_bench(["q8_0", "bf16k_q4_0v"], tokens=32, layers=2, kv_heads=2, head_dim=32,
                          block_size=16, repeats=1, disk_dir=str(tmp_path))
    assert [(r["format"], r["tier"]) for r in res["results"]] == [
        (f, t) for f in ("q8_0", "bf16k_q4_0v") for t in ("memory", "disk", "swapfile")]
    for r in res["results"]:
        f = parse_format(r["format"])
        payload = 2 * 2 * 32 * (f.k.bits_per_element + f.v.bits_per_element) / 8  # per token
        assert payload <= r["bytes_per_token"] <= payload * 1.15  # + headers and checksums
        assert r["load_us_per_token"] > 0 and r["recompute_store_us_per_token"] > 0
        assert r["tier_faults"] == 0
    title, cols, rows = bench.table(res)
    assert len(rows) == 6 and len(rows[0]) == len(cols)
    with pytest.raises(ConfigError, match="--tokens"):
        bench.run_bench(["bf16"], tokens=4, block_size=16)


def test_cli_bench_offload_json(capsys):
    import json

    from pagedkv.cli.main import main

    rc = main(["bench", "offload", "--formats", "bf16", "--tokens", "16", "--layers", "1",
               "--kv-heads", "1", "--head-dim", "16", "--repeats", "1", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["tier"] for r in out["results"]] == ["memory", "disk", "swapfile"]
    assert main(["bench", "offload", "--tokens", "4", "--repeats", "1"]) == 2  # ConfigError


def test_bench_model_recompute_column(monkeypatch):
    """--model: dims follow the model config and its prefill time is reported (a stand-in
    model here; the real one takes a minute to load)."""
    from types import SimpleNamespace

    import torch

    import pagedkv.eval.model as em

    calls = []

    class Fake(torch.nn.Module):
        config = SimpleNamespace(num_hidden_layers=2, num_key_value_heads=1, head_dim=16,
                                 hidden_size=32, num_attention_heads=2, vocab_size=100)

        def forward(self, ids, use_cache=False):
            calls.append(tuple(ids.shape))
            return ids.float().sum()

    monkeypatch.setattr(em, "resolve_model_source", lambda name: name)
    monkeypatch.setattr(em, "load_model", lambda src: SimpleNamespace(model=Fake(), label="fake"))
    res = bench.run_bench(["bf16"], tokens=32, repeats=1, model="embedded")
    assert (res["layers"], res["kv_heads"], res["head_dim"], res["model"]) == (2, 1, 16, "fake")
    assert calls == [(1, 32), (1, 32)]  # warm-up + one timed forward over the prefix
    r = res["results"][0]
    assert r["recompute_model_us_per_token"] > 0 and r["load_vs_model"] > 0
    title, cols, rows = bench.table(res)
    assert "model prefill us/tok" in cols and len(rows[0]) == len(cols)
