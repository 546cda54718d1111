"""The recent window's decode in vLLM's attention group: validated once per step, the same results.

`impl.attend_recent` is called by every layer of an attention group with the step's one metadata
object and the tail group's one table tensor. The step's first layer validates (the public op's
checks) and records the tail tables it read through; the others run the split directly. These
tests call it as vLLM's layers do (no engine: the layers, tables and metadata built here) and
compare with the public op, layer by layer; a bad table is refused on the step's first layer,
before anything is written; `checks=True` validates every layer.
"""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from helpers.attention_oracle import make_case  # noqa: E402

from pagedkv.codecs import get_codec  # noqa: E402
from pagedkv.errors import InvalidInput  # noqa: E402
from pagedkv.integrations.vllm import impl  # noqa: E402
from pagedkv.integrations.vllm.backend import PagedKVMetadata  # noqa: E402
from pagedkv.ops import AttentionParams  # noqa: E402
from pagedkv.ops import recent as rec  # noqa: E402
from pagedkv.spec import RecentWindow  # noqa: E402

LENS = (300, 5, 129, 77)
WINDOW = RecentWindow(64, "q8_0", sinks=16)


def _layers(n_layers: int):
    """n_layers (pages, tail) pairs over the same tables (one attention group), and the tables."""
    kw = dict(seq_lens=LENS, num_kv_heads=3, group=3)
    pairs = []
    for i in range(n_layers):
        main = make_case(get_codec("turbo3"), get_codec("turbo3"), block_size=32, seed=40 + i, **kw)
        tail = make_case(get_codec("q8_0"), get_codec("q8_0"), block_size=16, seed=60 + i, **kw)
        pairs.append((main, tail))
    # one group: every layer reads through the first layer's tables (the cases' random tables differ)
    tables, tail_tables = pairs[0][0].block_tables, pairs[0][1].block_tables
    return pairs, tables, tail_tables


def _metadata(tables, lens):
    b = tables.shape[0]
    empty = torch.zeros(0, dtype=torch.int32)
    return PagedKVMetadata(num_actual_tokens=b, num_decodes=b, decode_block_tables=tables,
                           decode_seq_lens=lens, prefill_block_tables=tables[:0], prefill_seq_lens=empty,
                           prefill_query_start=torch.zeros(1, dtype=torch.int32))


def _same_tables(pairs, tables, tail_tables):
    """Store every layer's K/V through the group's tables (the cases stored through their own)."""
    from pagedkv.ops import api

    for main, tail in pairs:
        for case, tab in ((main, tables), (tail, tail_tables)):
            bs = case.layer.block_size
            for b, n in enumerate(LENS):
                pos = torch.arange(n)
                api.store(case.layer, case.k[b], case.v[b], tab[b, pos // bs].long() * bs + pos % bs)


def _validations(monkeypatch):
    calls = []
    real = rec.prepare_split_decode
    monkeypatch.setattr(rec, "prepare_split_decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@pytest.mark.parametrize("checks", [False, True])
def test_every_layer_of_a_step_gives_the_public_ops_result_validated_once(checks, monkeypatch):
    pairs, tables, tail_tables = _layers(3)
    _same_tables(pairs, tables, tail_tables)
    lens = torch.tensor(LENS, dtype=torch.int32)
    params = AttentionParams(scale=0.125)
    m = _metadata(tables, lens)
    calls = _validations(monkeypatch)
    for main, tail in pairs:
        q = main.q_decode
        out = torch.full_like(q, float("nan"))
        impl.attend_recent(main.layer, tail.layer, tail_tables, WINDOW, params, q, out, m, checks=checks)
        want = rec.recent_decode_attention(q, main.layer, tail.layer, tables, lens, params, recent=WINDOW.tokens,
                                           sinks=WINDOW.sinks, tail_block_tables=tail_tables)
        assert torch.equal(out, want)
    # the public op above validates each time; the step's own layers validated once (checks: each)
    own = len(calls) - len(pairs)
    assert own == (len(pairs) if checks else 1)


def test_a_bad_table_is_refused_on_the_steps_first_layer():
    pairs, tables, tail_tables = _layers(1)
    lens = torch.tensor(LENS, dtype=torch.int32)
    bad = tables.clone()
    bad[0, 0] = 10 ** 6  # past the pool
    main, tail = pairs[0]
    out = torch.zeros_like(main.q_decode)
    with pytest.raises(InvalidInput, match="block"):
        impl.attend_recent(main.layer, tail.layer, tail_tables, WINDOW, AttentionParams(scale=0.125),
                           main.q_decode, out, _metadata(bad, lens), checks=False)
    assert torch.equal(out, torch.zeros_like(out))


def test_another_tail_table_is_validated_again(monkeypatch):
    """A second tail group in the step (another table tensor) is not taken for the first."""
    pairs, tables, tail_tables = _layers(2)
    _same_tables(pairs, tables, tail_tables)
    lens = torch.tensor(LENS, dtype=torch.int32)
    m = _metadata(tables, lens)
    calls = _validations(monkeypatch)
    for (main, tail), tt in zip(pairs, (tail_tables, tail_tables.clone())):
        out = torch.zeros_like(main.q_decode)
        impl.attend_recent(main.layer, tail.layer, tt, WINDOW, AttentionParams(scale=0.125), main.q_decode,
                           out, m, checks=False)
    assert len(calls) == 2


def test_where_the_split_does_not_apply_every_layer_runs_the_public_op():
    """Sparse V (the split's threshold would apply to partial weights): the step records that the
    split does not apply, and every layer gets the public op's result."""
    pairs, tables, tail_tables = _layers(2)
    _same_tables(pairs, tables, tail_tables)
    lens = torch.tensor(LENS, dtype=torch.int32)
    params = AttentionParams(scale=0.125, sparse_v_threshold=1e-3)
    m = _metadata(tables, lens)
    for main, tail in pairs:
        out = torch.full_like(main.q_decode, float("nan"))
        impl.attend_recent(main.layer, tail.layer, tail_tables, WINDOW, params, main.q_decode, out, m)
        want = rec.recent_decode_attention(main.q_decode, main.layer, tail.layer, tables, lens, params,
                                           recent=WINDOW.tokens, sinks=WINDOW.sinks, tail_block_tables=tail_tables)
        assert torch.equal(out, want)
    assert m.checked[impl.RECENT_DECODE][1] is None
