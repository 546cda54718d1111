"""The retrieval tasks of `pagedkv eval --task passkey|multikey`: generators, scoring, statistics,
pairing across formats, and the `--quick` preset end to end on a tiny model with a character
tokenizer (random weights: what it answers does not matter here, that every format is asked
the same and scored the same does)."""

from __future__ import annotations

import json

import pytest

from pagedkv.errors import ConfigError
from pagedkv.eval.retrieval_stats import depth_bins, mcnemar_exact, paired_counts, wilson
from pagedkv.eval.retrieval_tasks import (MULTIKEY_NEEDLE, MULTIKEY_OPENING, MULTIKEY_QUESTION, PASSKEY_NEEDLE,
                                          computed_tokens, extract_answer,
                                          generate, is_correct, sharing_order)


class CharCodec:
    """One token per character (ord), no merges: positions are easy to check."""

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


C = CharCodec()
TEXT = C.encode("Lorem ipsum dolor sit amet, consectetur. Sed do eiusmod tempor incididunt.\n" * 300)


def _trials(task, length=3000, trials=9, **kw):
    return generate(task, length, trials, C, bos=1, text_tokens=lambda: TEXT, **kw)


@pytest.mark.parametrize("task", ["passkey", "multikey"])
def test_generators_are_deterministic_and_put_each_needle_where_they_say(task):
    a, b = _trials(task), _trials(task)
    assert a == b and _trials(task, seed=1) != a  # seeded: same seed same trials, another seed others
    assert [t.index for t in a] == list(range(9))
    for t in a:
        assert len(t.prompt) <= t.length - t.max_new_tokens and t.prompt[0] == 1
        for n in t.needles:
            text = (PASSKEY_NEEDLE.format(value=n.value) if task == "passkey"
                    else MULTIKEY_NEEDLE.format(key=n.key, value=n.value))
            assert C.decode(t.prompt[n.position:n.position + n.tokens]) == text
        assert t.answer == t.needles[t.queried].value and t.answer.isdigit()
        # the target depth i/8, moved at most to a neighbouring sentence boundary (< 60 characters)
        haystack = len(t.prompt) - sum(n.tokens for n in t.needles)
        assert abs(t.depth - t.index / 8) <= 60 / haystack, (t.index, t.depth)
        if task == "passkey":
            assert t.context == t.index and len(t.needles) == 1
    if task == "passkey":
        assert len({t.answer for t in a}) == 9 and len({len(t.prompt) for t in a}) == 1
    else:  # contexts of 4 neighbouring depths, each needle asked once, distinct keys per context
        by_context: dict = {}
        for t in a:
            by_context.setdefault(t.context, []).append(t)
        assert [len(v) for v in by_context.values()] == [4, 4, 1]
        for ts in by_context.values():
            assert len({n.key for n in ts[0].needles}) == len(ts[0].needles) == len(ts)
            assert sorted(t.queried for t in ts) == list(range(len(ts)))
            assert all(t.needles == ts[0].needles for t in ts)
    assert generate(task, 3000, 3, C, bos=1, text_tokens=lambda: TEXT, depths=(0.25,))[2].depth == \
        pytest.approx(0.25, abs=0.03)


def test_the_opening_cue_asks_with_the_needle_opening_and_changes_nothing_else():
    question, opening = _trials("multikey"), _trials("multikey", cue="opening")
    for q, o in zip(question, opening):
        key = q.needles[q.queried].key
        # the same needles, answers and contexts (the haystack takes the room the cue leaves)
        assert [(n.key, n.value) for n in o.needles] == [(n.key, n.value) for n in q.needles]
        assert (o.answer, o.context, o.queried, o.length) == (q.answer, q.context, q.queried, q.length)
        assert len(o.prompt) <= o.length - o.max_new_tokens
        assert C.decode(q.prompt).endswith(MULTIKEY_QUESTION.format(key=key))
        assert C.decode(o.prompt).endswith(f"\nOne of the special magic numbers for {key} is:")
        assert C.decode(o.prompt).endswith(MULTIKEY_OPENING.format(key=key))
    assert _trials("passkey", cue="opening") == _trials("passkey")  # passkey always ends with its opening
    with pytest.raises(ConfigError, match="--cue 'needle'.*question, opening"):
        _trials("multikey", cue="needle")


def test_trials_share_the_haystack_before_their_first_needle_in_sharing_order():
    for task in ("passkey", "multikey"):
        ordered = sharing_order(_trials(task))
        firsts = [t.first_needle for t in ordered]
        assert firsts == sorted(firsts, reverse=True)
        tokens = computed_tokens(ordered, 16)
        assert tokens[0] == len(ordered[0].prompt)
        assert sum(tokens) < 0.75 * sum(len(t.prompt) for t in ordered)
        assert computed_tokens(ordered, 16, reuse=False) == [len(t.prompt) for t in ordered]


def test_a_wrong_answer_is_scored_wrong():
    assert is_correct(" 48213. Remember", "48213") and is_correct("48213", "48213")
    for wrong in (" 48214.", " 482130", " 4821", "", " the pass key", " 4 8213", " 048213"):
        assert not is_correct(wrong, "48213"), wrong
    assert extract_answer("is: 12 and 34") == "12" and extract_answer("none") is None


def test_wilson_interval_and_mcnemar_exact_test():
    lo, hi = wilson(0, 10)
    assert lo == 0 and hi == pytest.approx(0.2775, abs=1e-4)  # the published Wilson bound for 0/10
    lo, hi = wilson(8, 10)
    assert (lo, hi) == (pytest.approx(0.4902, abs=1e-4), pytest.approx(0.9433, abs=1e-4))
    assert wilson(0, 0) == (0.0, 1.0)
    assert mcnemar_exact(0, 0) == 1.0 and mcnemar_exact(3, 3) == 1.0
    assert mcnemar_exact(5, 0) == pytest.approx(0.0625) and mcnemar_exact(0, 5) == pytest.approx(0.0625)
    assert mcnemar_exact(2, 0) == pytest.approx(0.5)
    assert mcnemar_exact(10, 1) == pytest.approx(2 * 12 / 2048)
    assert paired_counts([True, True, False, False], [True, False, True, False]) == (1, 1)
    bins = depth_bins([0.0, 0.3, 1.0, 0.99], [True, False, True, False])
    assert [(b["trials"], b["correct"]) for b in bins] == [(1, 1), (1, 0), (0, 0), (0, 0), (2, 1)]


def test_score_pairs_every_format_with_bf16_and_counts_a_wrong_answer_wrong():
    from types import SimpleNamespace

    from pagedkv.eval.retrieval import make_units, score

    trials = _trials("passkey", trials=4)
    cells = {("passkey", 3000): trials}
    units = make_units(cells, [SimpleNamespace(label="bf16", recent=None), SimpleNamespace(label="x", recent=None)])
    assert units[0].trials == units[1].trials  # the same trials, in the same order, for every format
    right = [C.encode(" " + t.answer + ".") for t in units[0].trials]
    wrong = [C.encode(" " + (t.answer if i else str(int(t.answer) + 1)) + ".") for i, t in enumerate(units[1].trials)]
    res = {0: {"generated": right, "bits_per_element": 16.0, "computed": 1, "seconds": 0.0},
           1: {"generated": wrong, "bits_per_element": 3.5, "computed": 1, "seconds": 0.0}}
    rows, records = score(units, res, C.decode)
    ref, x = rows
    assert (ref["correct"], ref["lost"], ref["gained"], ref["mcnemar_p"], ref["informative"]) == (4, 0, 0, 1.0, True)
    assert (x["correct"], x["lost"], x["gained"], x["bf16_accuracy"]) == (3, 1, 0, 1.0)
    assert x["mcnemar_p"] == 1.0 and x["ci95"] == list(wilson(3, 4))
    assert sum(1 for r in records if not r["correct"]) == 1


def _char_tokenizer():
    pytest.importorskip("tokenizers")
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(i) for i in range(32, 127)] + ["\n"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tk.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A tiny random Llama (context 2048) with a character tokenizer, saved as a HF folder."""
    pytest.importorskip("transformers")
    from helpers.tiny_llama import peaked_llama

    tok = _char_tokenizer()
    model = peaked_llama(pagedkv_attention=False, vocab_size=len(tok), hidden_size=64, intermediate_size=96,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=2048,
                         bos_token_id=1, eos_token_id=2)
    folder = tmp_path_factory.mktemp("tiny-char-llama")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def test_quick_preset_runs_end_to_end_on_a_tiny_model(tiny_folder, capsys, tmp_path):
    pytest.importorskip("matplotlib")
    from pagedkv.cli.main import main
    from pagedkv.eval.retrieval_config import QUICK_PRESET

    plot = tmp_path / "r.png"
    assert main(["eval", "--task", "passkey,multikey", "--quick", "--model", tiny_folder, "--json",
                 "--workers", "2", "--threads", "1", "--plot", str(plot)]) == 0
    cap = capsys.readouterr()
    out = json.loads(cap.out)
    rows, detail = out["rows"], out["trials_detail"]
    assert [(r["task"], r["format"]) for r in rows] == [(t, f) for t in ("passkey", "multikey")
                                                       for f in QUICK_PRESET.formats]
    assert all(r["length"] == QUICK_PRESET.lengths[0] and r["trials"] == QUICK_PRESET.trials for r in rows)
    by = {(r["task"], r["format"]): r for r in rows}
    assert by[("passkey", "bf16")]["bits_per_element"] == 16 and by[("passkey", "turbo3")]["bits_per_element"] == 3.5
    assert 3.5 < by[("passkey", "turbo3+r64s16q8_0")]["bits_per_element"] < 5
    for r in rows:
        assert r["informative"] == (r["bf16_accuracy"] >= 0.8) and 0 <= r["ci95"][0] <= r["accuracy"] <= r["ci95"][1]
        assert r["computed_tokens"] < QUICK_PRESET.trials * QUICK_PRESET.lengths[0]  # prefix hits were taken
    for task in ("passkey", "multikey"):  # every format was asked the same trials
        asked = {f: [(d["trial"], d["depth"], d["answer"]) for d in detail if d["task"] == task and d["format"] == f]
                 for f in QUICK_PRESET.formats}
        assert len(asked["bf16"]) == QUICK_PRESET.trials and all(v == asked["bf16"] for v in asked.values())
        for d in detail:
            assert d["correct"] == (d["extracted"] == d["answer"])
    assert cap.err.count("done: ") == 6 and "done: passkey 1024 bf16: " in cap.err
    assert "expected ~" in cap.err and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_workers_give_the_answers_of_one_process(tiny_folder):
    """Units shared out to 2 forked workers generate exactly the tokens one process does."""
    from pagedkv.eval.model import ModelSource, load_model
    from pagedkv.eval.retrieval import make_units, run_units
    from pagedkv.eval.retrieval_tasks import TextCodec
    from pagedkv.eval.runner import parse_choice
    from pagedkv.eval.workers import fork_available

    if not fork_available():
        pytest.skip("no fork start method here")
    lm = load_model(ModelSource(tiny_folder, None, "tiny"), attn_implementation="pagedkv", model_cache=None)
    codec = TextCodec(lm.tokenizer)
    cells = {("passkey", 300): generate("passkey", 300, 3, codec, bos=1)}
    units = make_units(cells, [parse_choice(f) for f in ("bf16", "turbo3", "q4_0")])
    one = dict(run_units(lm.model, units, 16, [1.0] * 3, workers=1, threads=1))
    two = dict(run_units(lm.model, units, 16, [1.0] * 3, workers=2, threads=1))
    assert [one[i]["generated"] for i in range(3)] == [two[i]["generated"] for i in range(3)]
    assert one[0]["computed"] < 3 * 300 and one[1]["bits_per_element"] == 3.5


@pytest.mark.parametrize("argv,needle", [
    (["--lengths", "4k"], "past the context"),
    (["--formats", ","], "--formats"),
    (["--depths", "0,1.5"], "outside 0..1"),
    (["--lengths", "2x"], "--lengths"),
    (["--task", "needle"], "--task"),
    (["--trials", "0"], "--trials"),
    (["--trials", "10000000000000"], "--trials"),
    (["--lengths", "99999999k"], "--lengths"),
    (["--lengths", "9" * 5000], "--lengths"),
    (["--formats", "bf16,turbo9"], "turbo9"),
    (["--cue", "answer"], "--cue"),
])
def test_bad_arguments_fail_in_one_line_before_the_model_loads(tiny_folder, monkeypatch, capsys, argv, needle):
    import pagedkv.eval.model as em
    from pagedkv.cli.main import main

    def no_load(*a, **kw):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(em, "load_model", no_load)
    assert main(["eval", "--task", "passkey", "--model", tiny_folder, *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_config_refuses_what_the_cli_would():
    from pagedkv.eval.retrieval_config import RetrievalConfig, parse_depths, parse_lengths

    assert parse_lengths("2k,4k,8k") == (2048, 4096, 8192) and parse_lengths("1500") == (1500,)
    assert parse_depths("0,0.5,1") == (0.0, 0.5, 1.0)
    for bad in (dict(formats=()), dict(lengths=()), dict(depths=(-0.1,)), dict(trials=0), dict(keys=0),
                dict(cue="answer")):
        with pytest.raises(ConfigError):
            RetrievalConfig(**bad)
    assert RetrievalConfig(formats=("turbo3", "bf16")).all_formats == ("bf16", "turbo3")
    with pytest.raises(ConfigError, match="past the context"):
        RetrievalConfig(lengths=(8192,)).check_context(4096, "m")


def test_the_estimate_counts_prefix_hits_and_knows_which_caches_take_none():
    transformers = pytest.importorskip("transformers")
    from types import SimpleNamespace

    from pagedkv.eval.retrieval import CostModel, has_sliding_layers, make_units, unit_seconds

    assert not has_sliding_layers(transformers.LlamaConfig())
    assert has_sliding_layers(transformers.Gemma3TextConfig())  # 5 of 6 layers slide: no prefix hits
    assert not has_sliding_layers(transformers.Qwen2Config(sliding_window=4096, use_sliding_window=False))
    (unit,) = make_units({("passkey", 3000): _trials("passkey")}, [SimpleNamespace(label="bf16", recent=None)])
    hits, whole = unit_seconds(unit, 16, CostModel(1.0, 1.0)), unit_seconds(unit, 16, CostModel(1.0, 1.0, reuse=False))
    assert 0 < hits < 0.8 * whole


def test_the_estimate_caps_a_sliding_layers_attention_at_its_window():
    """A sliding layer attends to at most its window: the mean reach matches a count over the
    positions, and Gemma-3's layout (5 of 6 layers at 512) costs far less at 16k than the same
    model with every layer global (the estimate once said 328 min for a 51-minute run)."""
    transformers = pytest.importorskip("transformers")
    from types import SimpleNamespace

    from pagedkv.eval.retrieval import CostModel, cost_model, make_units, unit_seconds

    model = CostModel(1.0, 1.0, (None, 512, 512))
    for start, end in ((0, 100), (0, 4000), (300, 700), (600, 5000), (4000, 4000), (100, 100)):
        ps = range(start, end + 1) if end > start else [end]
        brute = sum((p + min(p, 512) * 2) / 3 for p in ps) / len(ps)
        assert model.reach(start, end) == pytest.approx(brute, rel=2e-3)
    gemma = cost_model(transformers.Gemma3TextConfig(  # Gemma-3-270M's shape
        hidden_size=640, num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
        intermediate_size=2048, sliding_window=512))
    assert None in gemma.windows and gemma.windows.count(512) > 0.8 * len(gemma.windows) and not gemma.reuse
    everywhere = CostModel(gemma.weights, gemma.attention, (None,) * len(gemma.windows), reuse=False)
    (unit,) = make_units({("passkey", 16384): _trials("passkey", 16384)}, [SimpleNamespace(label="bf16", recent=None)])
    assert unit_seconds(unit, 16, gemma) < 0.5 * unit_seconds(unit, 16, everywhere)


def test_the_named_lists_expand_to_formats_every_front_door_parses():
    """`--formats retrieval` (the recorded study's rows) and the default preset name formats the
    one spec parser accepts, each once and bf16 first."""
    from pagedkv.eval.config import RETRIEVAL_FORMATS, expand_formats
    from pagedkv.eval.retrieval_config import DEFAULT_PRESET
    from pagedkv.spec import parse_spec

    assert expand_formats(["retrieval"]) == RETRIEVAL_FORMATS
    for names in (RETRIEVAL_FORMATS, DEFAULT_PRESET.formats):
        assert names[0] == "bf16" and len(set(names)) == len(names)
        for name in names:
            parse_spec(name)
