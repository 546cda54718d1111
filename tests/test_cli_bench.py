"""`pagedkv bench TARGET`: one sub-command per target, each with only its own flags, defaults from
the target's dataclass in `pagedkv.bench.config`."""

from __future__ import annotations

import json

import pytest

from pagedkv.bench.config import AttentionBench, BenchShape, MemoryBench, OffloadBench
from pagedkv.cli.bench import TARGETS
from pagedkv.cli.main import build_parser, main


def _flags(target: str) -> set[str]:
    parser = build_parser()
    bench = next(a for a in parser._subparsers._group_actions[0].choices["bench"]._actions
                 if a.dest == "target")
    return {s for a in bench.choices[target]._actions for s in a.option_strings}


def test_each_target_has_only_its_own_flags():
    assert set(TARGETS) >= {"attention", "offload", "memory"}
    att, off, mem = _flags("attention"), _flags("offload"), _flags("memory")
    assert {"--device", "--contexts", "--batch", "--precisions", "--dry-run", "--q-heads"} <= att
    assert {"--tokens", "--redis-url", "--disk-dir", "--model"} <= off
    assert {"--memory-context", "--chunk", "--malloc", "--no-warmup"} <= mem
    assert not ({"--tokens", "--redis-url", "--memory-context", "--malloc"} & att)
    assert not ({"--device", "--contexts", "--memory-context", "--chunk"} & off)
    assert not ({"--device", "--tokens", "--layers", "--contexts"} & mem)


@pytest.mark.parametrize("argv", [["bench", "memory", "--layers", "3"], ["bench", "offload", "--device", "cuda"],
                                  ["bench", "attention", "--tokens", "16"], ["bench"]])
def test_a_flag_of_another_target_is_an_argument_error(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2


def test_defaults_come_from_the_dataclasses():
    parser = build_parser()
    a = parser.parse_args(["bench", "attention"])
    assert (a.layers, a.q_heads, a.kv_heads, a.head_dim, a.block_size, a.repeats, a.threads) == (
        BenchShape.layers, BenchShape.num_q_heads, BenchShape.num_kv_heads, BenchShape.head_dim,
        BenchShape.block_size, BenchShape.repeats, BenchShape.threads)
    o = parser.parse_args(["bench", "offload"])
    assert (o.formats, o.tokens, o.layers, o.block_size, o.repeats) == (
        ",".join(OffloadBench.formats), OffloadBench.tokens, OffloadBench.layers, OffloadBench.block_size,
        OffloadBench.repeats)
    m = parser.parse_args(["bench", "memory"])
    assert (m.formats, int(m.memory_context), m.chunk, m.malloc) == (
        ",".join(MemoryBench.formats), MemoryBench.context, MemoryBench.chunk, MemoryBench.malloc)
    assert AttentionBench.contexts == (1024, 4096, 16384, 32768)


def test_bench_attention_cli_tiny_json(capsys):
    """The CPU target end to end on a tiny grid: decode rows with ratio = ms / baseline_ms."""
    from pagedkv.ops import cpu

    if not cpu.available():
        pytest.skip("the fast CPU kernel is not built here")
    rc = main(["bench", "attention", "--formats", "turbo3", "--contexts", "32", "--batch", "1",
               "--layers", "1", "--repeats", "1", "--no-prefill", "--no-memory", "--json"])
    assert rc == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["kind"], r["format"], r["context"], r["batch"]) for r in rows] == [("decode", "turbo3", 32, 1)]
    assert rows[0]["ratio"] == pytest.approx(rows[0]["ms"] / rows[0]["baseline_ms"])
    rc = main(["bench", "attention", "--formats", "turbo3", "--contexts", "64", "--batch", "2",
               "--layers", "1", "--repeats", "1", "--no-prefill", "--no-memory", "--scaling-threads", "2", "--json"])
    assert rc == 0
    scaling = [r for r in json.loads(capsys.readouterr().out) if r["kind"] == "scaling"]
    assert [(r["format"], r["context"], r["batch"], r["threads"]) for r in scaling] == [("turbo3", 64, 2, 2)]
    assert scaling[0]["speedup"] == pytest.approx(scaling[0]["ms_1"] / scaling[0]["ms_n"])
    assert main(["bench", "attention", "--contexts", "32", "--scaling-threads", "1"]) == 2
    assert "scaling threads" in capsys.readouterr().err
    assert main(["bench", "attention", "--formats", "turbo3,turbo3"]) == 2  # listed twice
    assert main(["bench", "attention", "--contexts", "0"]) == 2
    assert "--contexts" in capsys.readouterr().err


def test_bench_attention_prefill_shapes_without_decode(capsys):
    """--prefill-shapes gives one prefill row per (shape, format) with its context and query count;
    --no-decode skips the decode grid; a bad shape is a one-line error naming it, exit 2."""
    from pagedkv.ops import cpu

    if not cpu.available():
        pytest.skip("the fast CPU kernel is not built here")
    rc = main(["bench", "attention", "--formats", "turbo3", "--prefill-shapes", "64:16,96:32", "--no-decode",
               "--layers", "1", "--repeats", "1", "--no-memory", "--json"])
    assert rc == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["kind"], r["format"], r["context"], r["q_len"]) for r in rows] == [
        ("prefill", "turbo3", 64, 16), ("prefill", "turbo3", 96, 32)]
    assert all(r["ratio"] == pytest.approx(r["ms"] / r["baseline_ms"]) for r in rows)
    for bad in ("4k", "512:4k", "4k:0", "4k:x"):
        assert main(["bench", "attention", "--prefill-shapes", bad, "--no-decode"]) == 2
        err = capsys.readouterr().err
        assert "--prefill-shapes" in err and len(err.strip().splitlines()) == 1


def test_prefill_shapes_parse():
    from pagedkv.cli.bench.attention import parse_prefill_shapes

    assert parse_prefill_shapes("4k:512,16k:2k") == [(4096, 512), (16384, 2048)]
    assert parse_prefill_shapes(build_parser().parse_args(["bench", "attention"]).prefill_shapes) == list(
        AttentionBench.prefill_shapes)
