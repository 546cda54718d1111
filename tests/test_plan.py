"""`pagedkv plan` arithmetic: exact catalogue sizes times the model's layer layout."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

from pagedkv.cli.sizes import parse_bytes  # noqa: E402
from pagedkv.codecs import get_codec  # noqa: E402
from pagedkv.errors import ConfigError  # noqa: E402
from pagedkv.eval.plan import plan  # noqa: E402


def _llama(layers=30, kv=3, hd=64):
    return transformers.LlamaConfig(num_hidden_layers=layers, num_attention_heads=9, num_key_value_heads=kv,
                                    head_dim=hd, hidden_size=576, max_position_embeddings=8192)


def test_bf16_and_turbo3_sizes_match_hand_arithmetic():
    rows = {r["format"]: r for r in plan(_llama(), 8 * 2**30, ["bf16", "turbo3", "q8_0"], block_size=16)}
    bf16 = rows["bf16"]
    assert bf16["bytes_per_token"] == 30 * 2 * 3 * 64 * 2 == 23040
    assert bf16["tokens"] == (8 * 2**30 // (23040 * 16)) * 16
    assert bf16["sequences"] == (8 * 2**30 // (23040 * 16)) // (8192 // 16)
    t3 = get_codec("turbo3")
    assert rows["turbo3"]["bytes_per_block"] == 30 * 2 * t3.block_bytes(16, 3, 64)
    assert rows["turbo3"]["bits_per_element"] == 3.5
    assert rows["q8_0"]["bits_per_element"] == 8.5
    assert rows["turbo3"]["vs_bf16"] == pytest.approx(rows["turbo3"]["tokens"] / bf16["tokens"])


def test_high_precision_layers_and_sliding_layers():
    rows = {r["format"]: r for r in plan(_llama(layers=10), 2**30, ["turbo3+hp1", "turbo3+hp"], seq_len=1000)}
    # one q8_0 layer (the default hp format) at each end, 8 turbo3 layers
    assert rows["turbo3+hp1"]["bits_per_element"] == pytest.approx((2 * 8.5 + 8 * 3.5) / 10)
    assert rows["turbo3+hp1"]["sequences"] == rows["turbo3+hp1"]["blocks"] // 63  # ceil(1000 / 16)
    assert rows["turbo3+hp"]["high_precision_layers"] >= 1
    g3 = transformers.Gemma3TextConfig(num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=1,
                                       head_dim=256, hidden_size=640, sliding_window=512)
    (row,) = plan(g3, 2**30, ["turbo4"])
    assert row["bytes_per_token"] == 6 * 2 * 256 * 4.5 / 8


def test_parse_bytes():
    assert parse_bytes("8GiB") == 8 * 2**30
    assert parse_bytes("512 MiB") == 512 * 2**20
    assert parse_bytes("2GB") == 2 * 10**9
    assert parse_bytes("4096") == 4096
    assert parse_bytes("1.5GiB") == 3 * 2**29
    for bad in ("lots", "8XB", "0", "-1GiB"):
        with pytest.raises(ConfigError):
            parse_bytes(bad)
    with pytest.raises(ConfigError, match="seq-len"):
        plan(_llama(), 2**30, ["bf16"], seq_len=0)
