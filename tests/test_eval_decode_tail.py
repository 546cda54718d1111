"""`pagedkv eval --decode-tail N` (EvalConfig.decode_tail): the last N tokens of each window
predicted by one-token decode steps, so that the eval measures the decode paths an approximation
changes (a prefill never takes them).

Checked here on a tiny random Llama: the decode steps compute the attention a prefill computes
(same metrics, to float rounding), int8_scores moves the decode-tail numbers but not the prefill
ones, the reference stays exact, workers give the numbers of one process, and the refusals.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from pagedkv.approx import Approximation
from pagedkv.errors import ConfigError
from pagedkv.eval.config import EvalConfig
from pagedkv.eval.metrics import kl_sum, log_probs, nll_sum
from pagedkv.eval.text import make_windows

from helpers.tiny_llama import approx_model

L = 48  # tokens per window


def _windows(n=2):
    return make_windows(torch.randint(3, 96, (400,), generator=torch.Generator().manual_seed(2)), n, L, bos=1)


def _eval(model, windows, formats, tail, approx=Approximation(), **kw):
    from pagedkv.eval.runner import evaluate

    cfg = EvalConfig(formats=formats, windows=len(windows), window_tokens=L, memory_bytes=2**20, decode_steps=0,
                     approx=approx, decode_tail=tail, **kw)
    return {r["format"]: r for r in evaluate(model, windows, cfg)}


@torch.inference_mode()
def _split_prefill_logp(model, window, label, tail):
    """log-probs [tail, V] of the window's last `tail` predictions computed by two prefills on one
    cache: the tokens before the tail (the first chunk, which fixes key centre and scales as in
    the eval), then the tail's inputs as one chunk. The eval's decode steps must match them."""
    from pagedkv.eval.runner import cache_for, parse_choice

    cache = cache_for(model, parse_choice(label), checks=False)
    start = window.numel() - 1 - tail
    model(window[None, :start], cache=cache, use_cache=True)
    return log_probs(model(window[None, start:-1], cache=cache, use_cache=True).logits[0])


@pytest.mark.parametrize("label", ["turbo3", "q4_0", "turbo3+r16s4q8_0"])
def test_decode_tail_equals_the_same_positions_prefilled(label):
    """Exact setting: KL, PPL and top-1 over the tail from decode steps equal those of a prefill of
    the same positions. Tolerance: the two paths sum the same fp32 products in another order; their
    logits differ by < 1e-5 here (measured: 8e-6 bf16, 8e-7 turbo3, logits ~1 in size). To first
    order a logit change e on either side moves KL(p || q) by at most 2 e |p - q|_1 <=
    2 e sqrt(2 KL) (Pinsker), hence the bound with e = 2e-5. KL itself is small (~5e-4 with the
    recent window), so a relative 1e-4 would test the rounding, not the attention; any real
    difference (a token attended or stored differently) moves the logits by far more than 1e-5."""
    model = approx_model()
    windows, tail = _windows(), 12
    rows = _eval(model, windows, ("bf16", label), tail)
    assert rows[label]["scored_positions"] == f"last {tail}, decoded one token at a time"
    assert rows[label]["tokens"] == rows["bf16"]["tokens"] == tail * len(windows)
    kl = nll = top1 = 0.0
    for w in windows:
        ref, lp = _split_prefill_logp(model, w, "bf16", tail), _split_prefill_logp(model, w, label, tail)
        kl, nll = kl + kl_sum(ref, lp), nll + nll_sum(lp, w[-tail:])
        top1 += int((ref.argmax(-1) == lp.argmax(-1)).sum())
    n = tail * len(windows)
    assert kl > 0 and abs(rows[label]["kl"] - kl / n) <= 2 * 2e-5 * math.sqrt(2 * kl / n)
    assert math.isclose(rows[label]["ppl"], math.exp(nll / n), rel_tol=2e-5)
    assert rows[label]["top1"] == top1 / n


@pytest.mark.parametrize("tail", [1, 12, L - 1])
def test_bf16_decode_tail_equals_a_full_prefill_of_the_window(tail):
    """bf16 keeps K/V as given (no key centre or scales fitted to the first chunk), so its tail
    perplexity equals that of the same positions of one full prefill of the window, for any split,
    down to a tail of the whole window (the first decode step then starts the cache)."""
    model = approx_model()
    windows = _windows()
    rows = _eval(model, windows, ("bf16",), tail)
    nll = 0.0
    with torch.inference_mode():
        for w in windows:
            nll += _full_window_nll(model, w, tail)
    assert rows["bf16"]["tokens"] == tail * len(windows) and rows["bf16"]["kl"] == 0
    assert math.isclose(rows["bf16"]["ppl"], math.exp(nll / (tail * len(windows))), rel_tol=1e-4)


def _full_window_nll(model, window, tail):
    from pagedkv.eval.runner import cache_for, parse_choice

    cache = cache_for(model, parse_choice("bf16"), checks=False)
    logits = model(window[None], cache=cache, use_cache=True).logits[0, :-1]
    return nll_sum(log_probs(logits[-tail:]), window[-tail:])


def test_int8_scores_move_the_decode_tail_only():
    """int8_scores is a decode path of the CPU kernel (2/3/4/5-bit table keys): with a decode tail
    turbo3's KL changes (the path was taken), without one it is bit-identical to the exact run
    (the prefill stays exact), and the bf16 reference is the same exact one in both settings."""
    from pagedkv.ops import cpu

    if not cpu.available() or cpu.kernel_info().get("variant") not in ("avx2", "avx512"):
        pytest.skip("no integer score path in this build")
    model = approx_model()
    windows, int8 = _windows(), Approximation(int8_scores=True)
    full_exact, full_int8 = (_eval(model, windows, ("bf16", "turbo3"), 0, a) for a in (Approximation(), int8))
    assert full_int8["turbo3"]["kl"] == full_exact["turbo3"]["kl"] > 0
    assert "scored_positions" not in full_exact["turbo3"]
    tail_exact, tail_int8 = (_eval(model, windows, ("bf16", "turbo3"), 16, a) for a in (Approximation(), int8))
    assert tail_int8["turbo3"]["approx"] == "int8_scores"
    assert tail_int8["turbo3"]["kl"] != tail_exact["turbo3"]["kl"]
    assert tail_int8["turbo3"]["kl"] < 10 * tail_exact["turbo3"]["kl"]  # an approximation, not a failure
    assert tail_int8["bf16"]["ppl"] == tail_exact["bf16"]["ppl"] and tail_int8["bf16"]["kl"] == 0


def test_bf16_dots_tail_keeps_the_reference_exact():
    """With bf16_dots the listed bf16 row runs the setting and is compared with the exact bf16
    reference (also split prefill + decode): KL > 0 where the kernel has a bf16 path for bf16
    keys in decode or prefill, 0 where it computes exactly."""
    from pagedkv.ops import cpu

    att = importlib.import_module("pagedkv.ops.cpu.attention")
    model = approx_model()
    rows = _eval(model, _windows(), ("bf16", "turbo3"), 16, Approximation(bf16_dots=True))
    exact = _eval(model, _windows(), ("bf16", "turbo3"), 16)
    assert rows["bf16"]["kl"] < 1e-3 and rows["turbo3"]["kl"] > rows["bf16"]["kl"]
    has_bf16 = cpu.available() and att._prefill_entry(cpu._require(), True) is not att._prefill_entry(cpu._require())
    if has_bf16:  # AVX-512 BF16: the decode scores over bf16 keys are rounded too
        assert rows["bf16"]["kl"] > 0 and rows["turbo3"]["kl"] != exact["turbo3"]["kl"]


def test_workers_give_the_decode_tail_numbers_of_one_process():
    from pagedkv.eval.compute import Compute
    from pagedkv.eval.workers import fork_available

    if not fork_available():
        pytest.skip("no fork start method here")
    model = approx_model()
    windows = _windows(3)
    one = _eval(model, windows, ("bf16", "turbo3"), 8)
    two = _eval(model, windows, ("bf16", "turbo3"), 8, compute=Compute(threads=1, workers=2))
    assert one == two and len(one["turbo3"]["kl_per_window"]) == 3


@pytest.mark.parametrize("bad", [-1, L, L + 5, 1.5, True, "8"])
def test_a_bad_decode_tail_is_refused_naming_it(bad):
    """The CLI shows this line as its one-line error (tests/test_cli_errors.py)."""
    with pytest.raises(ConfigError, match=rf"--decode-tail must be an integer >= 0 and < --window-tokens \({L}\), "
                                          rf"got {bad!r}"):
        EvalConfig(window_tokens=L, decode_tail=bad)

