"""Long-window KL (issue 33): the eval's KL by position bucket and bits as stored at the end of
a long window, against direct computations on a tiny random Llama."""

from __future__ import annotations

import math

import pytest
import torch

from helpers.tiny_llama import peaked_llama
from pagedkv.eval.config import EvalConfig
from pagedkv.eval.metrics import bucket_label, position_buckets
from pagedkv.eval.text import make_windows

L = 2100  # three buckets: 0-1k, 1-2k and positions 2048..2098 of 2-4k


def test_position_buckets_double_from_1k():
    assert position_buckets(1024) == [(0, 1024)]
    assert position_buckets(8191) == [(0, 1024), (1024, 2048), (2048, 4096), (4096, 8191)]
    assert position_buckets(5) == [(0, 5)]
    assert [bucket_label(lo, hi) for lo, hi in position_buckets(20000)] == \
        ["0-1k", "1-2k", "2-4k", "4-8k", "8-16k", "16-32k"]


@torch.inference_mode()
def _direct_kl(model, window, label):
    """KL(bf16 cache || label's cache) at every position of the window, from the whole logits
    of two plain forwards (the eval never forms them)."""
    from pagedkv.eval.runner import cache_for, parse_choice

    lp = {}
    for name in ("bf16", label):
        cache = cache_for(model, parse_choice(name), checks=False)
        lp[name] = torch.log_softmax(model(window[None], cache=cache, use_cache=True).logits[0, :-1].float(), -1)
    ref = lp["bf16"]
    return (ref.exp() * (ref - lp[label])).sum(-1).double()


def test_kl_by_position_is_the_direct_computation():
    from pagedkv.eval.runner import evaluate

    model = peaked_llama(max_position_embeddings=4096)
    windows = make_windows(torch.randint(3, 96, (5000,), generator=torch.Generator().manual_seed(3)), 2, L, bos=1)
    cfg = EvalConfig(formats=("bf16", "turbo2"), windows=2, window_tokens=L, memory_bytes=2**20, decode_steps=0)
    row = {r["format"]: r for r in evaluate(model, windows, cfg)}["turbo2"]
    kls = [_direct_kl(model, w, "turbo2") for w in windows]
    got = row["kl_by_position"]
    assert [b["positions"] for b in got] == ["0-1k", "1-2k", "2-4k"]
    assert [b["tokens"] for b in got] == [2048, 2048, 2 * (L - 1 - 2048)]
    for b in got:
        per = [float(k[b["lo"]:b["hi"]].mean()) for k in kls]
        want = sum(float(k[b["lo"]:b["hi"]].sum()) for k in kls) / b["tokens"]
        # the same fp32 products; the eval forms the logits in chunks of rows (float rounding only)
        assert math.isclose(b["kl"], want, rel_tol=1e-4), (b, want)
        assert all(math.isclose(x, y, rel_tol=1e-4) for x, y in zip(b["kl_per_window"], per))
        assert b["kl"] > 0
    assert math.isclose(sum(b["kl"] * b["tokens"] for b in got) / row["tokens"], row["kl"], rel_tol=1e-9)


def test_bits_at_length_count_the_window_tail_as_stored_then():
    """turbo3+r64s16q8_0 on 16-token blocks: at N tokens the tail holds the blocks covering the last
    64 positions and the first 16 (sinks), in q8_0 (8.5 bits) on both sides; the pages 3.5 bits
    for every token. At N = 8192: 4 + 1 blocks = 80 slots; at 1024 the same 80; at 1030 (the last
    block part-filled): 5 + 1 = 96."""
    from pagedkv.eval.runner import cache_for, layout_numbers, parse_choice

    model = peaked_llama()
    choice = parse_choice("turbo3+r64s16q8_0")
    cache = cache_for(model, choice)
    for n, slots in ((8192, 80), (1024, 80), (1030, 96), (16384, 80)):
        bits, _, _ = layout_numbers(cache, 2**30, choice.recent, n)
        assert math.isclose(bits, 3.5 + slots / n * 8.5, rel_tol=1e-12), (n, bits)
    plain, _, _ = layout_numbers(cache_for(model, parse_choice("turbo3")), 2**30, None, 8192)
    assert plain == 3.5


def test_the_head_check_refuses_a_model_whose_logits_are_not_its_head():
    """The eval scores logits formed from the final hidden states; a model that forms them
    otherwise (here: a scaled head output) is refused in one line, not scored wrongly."""
    from pagedkv.errors import PagedKVError
    from pagedkv.eval.runner import evaluate

    model = peaked_llama()
    windows = make_windows(torch.randint(3, 96, (200,), generator=torch.Generator().manual_seed(1)), 1, 40, bos=1)
    cfg = EvalConfig(formats=("bf16",), windows=1, window_tokens=40, memory_bytes=2**20, decode_steps=0)
    assert evaluate(model, windows, cfg)[0]["kl"] == 0
    model.config.final_logit_softcapping = 0.5
    with pytest.raises(PagedKVError, match="output embeddings"):
        evaluate(model, windows, cfg)
