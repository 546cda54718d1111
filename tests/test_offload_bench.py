"""`pagedkv bench offload` measurement on tiny shapes: bytes per token follow the codecs."""

from __future__ import annotations

import pytest

from pagedkv.errors import ConfigError
from pagedkv.formats import parse_format
from pagedkv.offload import bench


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
