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


def test_gemma3_sliding_layers_count_one_window_per_sequence():
    """12 layers, 2 global (5 and 11) and 10 sliding with W = 512, 1 KV head of 256, bf16, blocks
    of 16: a bf16 layer block is 16 tokens x (K + V) x 256 x 2 B = 16 KiB; a sequence of 32768
    tokens takes 2048 blocks per global layer and ceil(511 / 16) + 1 = 33 per sliding layer."""
    g3 = transformers.Gemma3TextConfig(num_hidden_layers=12, num_attention_heads=4, num_key_value_heads=1,
                                       head_dim=256, hidden_size=640, sliding_window=512)
    (row,) = plan(g3, 8 * 2**30, ["bf16"], seq_len=32768, block_size=16)
    lb = 16 * 2 * 256 * 2
    assert row["sliding_layers"] == 10
    assert row["bytes_per_token"] == 12 * lb / 16 and row["global_bytes_per_token"] == 2 * lb / 16
    assert row["seq_bytes"] == (2 * 2048 + 10 * 33) * lb == 72515584
    assert row["sequences"] == 8 * 2**30 // 72515584 == 118  # 21 if every layer kept every token
    assert row["blocks"] // 2048 == 21
    # the longest single sequence: every sliding layer holds its 33 blocks, the rest is global
    assert row["tokens"] == (8 * 2**30 - 10 * 33 * lb) // (2 * lb) * 16 == (262144 - 165) * 16
    # shorter than the window: sliding layers hold the whole sequence
    (short,) = plan(g3, 8 * 2**30, ["bf16"], seq_len=100, block_size=16)
    assert short["seq_bytes"] == 12 * 7 * lb
    # every layer sliding (Mistral v0.1 style): tokens counts the sequences of seq_len that fit
    mistral = transformers.MistralConfig(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1,
                                         head_dim=256, hidden_size=640, sliding_window=512)
    (m,) = plan(mistral, 2**30, ["bf16"], seq_len=4096, block_size=16)
    assert m["seq_bytes"] == 4 * 33 * lb and m["sequences"] == 2**30 // (4 * 33 * lb)
    assert m["tokens"] == m["sequences"] * 4096 and m["global_bytes_per_token"] == 0


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
