"""KV format parsing and the `pagedkv formats` / `pagedkv codecs` commands."""

import json

import pytest

from pagedkv.cli.main import main
from pagedkv.codecs import CODECS
from pagedkv.errors import ConfigError
from pagedkv.formats import all_formats, parse_format


@pytest.mark.parametrize("name,k,v", [
    ("turbo3", "turbo3", "turbo3"),
    ("bf16k_turbo3v", "bf16", "turbo3"),
    ("turbo4k_turbo3v", "turbo4", "turbo3"),
    ("fp8k_turbo2v", "fp8", "turbo2"),
    ("turbo4k3v", "turbo4", "turbo3"),
    ("bf16k4v", "bf16", "turbo4"),
    ("fp8k2v", "fp8", "turbo2"),
    ("turbo3k8v", "turbo3", "turbo8"),
    ("k=fp8,v=turbo2", "fp8", "turbo2"),
    ("q8_0k_q4_0v", "q8_0", "q4_0"),
    (" Turbo3 ", "turbo3", "turbo3"),
    ("fp8_e4m3", "fp8", "fp8"),  # vLLM's names for the same bytes
    ("bfloat16", "bf16", "bf16"),
    ("auto", "bf16", "bf16"),
    ("fp8_e5m2", "fp8_e5m2", "fp8_e5m2"),
    ("float16", "f16", "f16"),
    ("fp8_e4m3k_turbo3v", "fp8", "turbo3"),
    ("k=bfloat16,v=turbo5", "bf16", "turbo5"),
])
def test_parse_names_and_aliases(name, k, v):
    f = parse_format(name)
    assert (f.k.name, f.v.name) == (k, v)
    assert parse_format(f.name) == f  # canonical names parse back


def test_every_pair_is_a_format_from_one_code_path():
    formats = list(all_formats())
    assert len(formats) == len(CODECS) ** 2
    assert len({(f.k.name, f.v.name) for f in formats}) == len(formats)
    for f in formats:
        assert parse_format(f.name) == f


def test_asymmetric_formats_have_different_block_sizes():
    f = parse_format("bf16k_turbo3v")
    assert f.k_block_bytes(16, 3, 64) == 16 * 3 * 64 * 2
    assert f.v_block_bytes(16, 3, 64) == 16 * 3 * 64 * 3 // 8 + 16 * 3 * 64 // 16
    assert f.bits_per_element == (16 + 3.5) / 2


def test_aliases_are_the_same_bytes():
    for alias, canonical in (("fp8_e4m3", "fp8"), ("bfloat16", "bf16"), ("auto", "bf16"), ("half", "f16")):
        a, c = parse_format(alias), parse_format(canonical)
        assert a == c and a.name == canonical
        assert a.k_block_bytes(16, 2, 64) == c.k_block_bytes(16, 2, 64)


@pytest.mark.parametrize("bad, use", [("fp8_inc", "use fp8"), ("q5_0", "use turbo5"),
                                      ("bf16k_q5_0v", "use turbo5"), ("float32", "use bf16 or f16"),
                                      ("iq4_nl", "use turbo4")])
def test_names_meaning_other_bytes_are_refused_with_what_to_use(bad, use):
    with pytest.raises(ConfigError, match="is not the same thing") as exc:
        parse_format(bad)
    assert use in str(exc.value) and repr(bad) in str(exc.value)


@pytest.mark.parametrize("bad", ["turbo9", "bf16k_turbo9v", "k=fp8", "", "fp8k_v"])
def test_unknown_names_list_valid_ones(bad):
    with pytest.raises(ConfigError, match="unknown KV format") as exc:
        parse_format(bad)
    assert repr(bad) in str(exc.value) and "turbo3" in str(exc.value)


def test_formats_cli_json(capsys):
    assert main(["formats", "turbo3", "bf16k4v", "--kv-heads", "8", "--head-dim", "128", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    names = [f["name"] for f in out["formats"]]
    assert names == ["turbo3", "bf16k_turbo4v"]
    bf = out["formats"][1]
    assert bf["k_block_bytes"] == 16 * 8 * 128 * 2
    assert bf["v_block_bytes"] == 16 * 8 * 128 // 2 + 16 * 8 * 128 // 16
    assert [c["name"] for c in out["codecs"]] == ["turbo3"]


def test_formats_cli_lists_everything(capsys):
    assert main(["formats", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["formats"]) == len(CODECS) ** 2 and len(out["codecs"]) == len(CODECS)


def test_formats_cli_unknown_name_is_one_line_exit_2(capsys):
    assert main(["formats", "turbo9"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "turbo9" in err and "turbo3" in err


def test_codecs_bench_json(capsys):
    assert main(["codecs", "--bench", "--json", "--vectors", "256", "--repeats", "1"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["distribution"] for r in rows} == {"gaussian", "outliers"}
    by = {(r["codec"], r["distribution"]): r for r in rows}
    assert by[("turbo3", "gaussian")]["nmse"] < 0.03
    assert by[("turbo3", "gaussian")]["rd_limit"] == 4.0 ** -3.5
    # rotation spreads outlier channels: turbo4 beats unrotated nvfp4 on heavy tails
    assert by[("turbo4", "outliers")]["nmse"] < by[("nvfp4", "outliers")]["nmse"]
