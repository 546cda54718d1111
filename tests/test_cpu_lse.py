"""The C kernel's log-sum-exp output (`lse=`) and key lower bound (`key_start=`).

Both serve the recent window's split decode (`pagedkv.ops.recent_decode`), which merges kernel
calls over disjoint key ranges by log-sum-exp. The oracle: fp64 logits of the case's dequantized
K/V (`helpers.attention_oracle.make_case`: the codec round trip of the stored rows, the layer's
transform undone), s_j = scale * q . k_j, soft-capped, masked (causal, sliding window, j >=
key_start); lse = log(sum_j e^{s_j} + e^{sink}) (the sink logit only with `params.sinks`), -inf
for a row that sees no key and has no sink; out = sum_j e^{s_j - lse} v_j. The kernel and the
oracle read the same values, so the tolerance is fp32 rounding of a 64-term dot product and of
the online softmax (1e-4 relative to the logits' scale), for every codec pair it implements.
"""

from __future__ import annotations

import pytest
import torch

from helpers.attention_oracle import make_case
from helpers.backend_check import all_pairs
from pagedkv.codecs import CODECS
from pagedkv.ops import AttentionParams, cpu

pytestmark = pytest.mark.skipif(not cpu.available(), reason="the C attention kernel is not built here")

LENS, QLENS = (37, 0, 70, 5), (6, 0, 25, 5)  # a padding row; a short row fully before key_start 20


def _pairs():
    from pagedkv.ops.cpu.attention import ATTENTION_SUPPORT

    return all_pairs(ATTENTION_SUPPORT)


def _oracle(case, q, positions, params: AttentionParams, key_start: int):
    """fp64 (out [Tq, Hq, D], lse [Tq, Hq]) of packed queries q at `positions` (one tensor per sequence)."""
    outs, lses, at = [], [], 0
    hq, h = q.shape[1], case.layer.num_kv_heads
    for b, pos in enumerate(positions):
        n, t = int(case.seq_lens[b]), pos.numel()
        if t == 0:
            continue
        qq = q[at:at + t].double().transpose(0, 1)  # [Hq, t, D]
        at += t
        k = case.k_deq[b].repeat_interleave(hq // h, 1).transpose(0, 1)  # [Hq, n, D]
        v = case.v_deq[b].repeat_interleave(hq // h, 1).transpose(0, 1)
        s = (qq @ k.transpose(1, 2)) * params.scale
        if params.soft_cap is not None:
            s = params.soft_cap * torch.tanh(s / params.soft_cap)
        j = torch.arange(n)
        see = (j[None, :] <= pos[:, None]) & (j[None, :] >= key_start)
        if params.sliding_window is not None:
            see &= j[None, :] > pos[:, None] - params.sliding_window
        s = s.masked_fill(~see, float("-inf"))
        full = s if params.sinks is None else torch.cat(
            [s, params.sinks.double()[:, None, None].expand(hq, t, 1)], -1)
        lse = torch.logsumexp(full, -1)  # [Hq, t]
        w = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
        outs.append((w @ v).transpose(0, 1))
        lses.append(lse.transpose(0, 1))
    return torch.cat(outs), torch.cat(lses)


def _run(case, mode: str, params: AttentionParams, key_start: int = 0):
    if mode == "decode":
        q, lens, tables = case.q_decode, case.seq_lens, case.block_tables  # the padding row: no key
        qsl = torch.arange(q.shape[0] + 1, dtype=torch.int32)
        positions = [torch.tensor([n - 1]) for n in lens.tolist()]
    else:
        q, lens, tables, qsl = case.q_prefill, case.seq_lens, case.block_tables, case.query_start_loc
        positions = [torch.arange(n - ql, n) for n, ql in zip(lens.tolist(), case.q_lens)]
    lse = torch.full(q.shape[:2], float("nan"))
    out = cpu.attention(q, case.layer, tables, lens, qsl, params, lse=lse, key_start=key_start)
    plain = cpu.attention(q, case.layer, tables, lens, qsl, params, key_start=key_start)
    assert torch.equal(out, plain)  # asking for lse changes nothing else
    return out, lse, _oracle(case, q, positions, params, key_start)


def _check(out, lse, want):
    w_out, w_lse = want
    scale = max(1.0, float(w_lse[torch.isfinite(w_lse)].abs().max()))
    assert torch.equal(torch.isinf(lse), torch.isinf(w_lse)) and not torch.isnan(lse).any()
    fin = torch.isfinite(w_lse)
    assert (lse[fin].double() - w_lse[fin]).abs().max() < 1e-4 * scale
    assert (out.double() - w_out).abs().max() < 1e-4 * max(1.0, float(w_out.abs().max()))


@pytest.mark.parametrize("pair", _pairs())
def test_lse_of_every_codec_pair(pair):
    """Decode and varlen prefill (GQA, a key centre, padding and short rows)."""
    case = make_case(CODECS[pair[0]], CODECS[pair[1]], seq_lens=LENS, q_lens=QLENS, num_kv_heads=2, group=2,
                     seed=3, centre=True, k_offset=2.0, store_backend=None)
    for mode in ("decode", "prefill"):
        _check(*_run(case, mode, AttentionParams(scale=0.125)))


@pytest.mark.parametrize("pair", [("turbo3", "turbo3"), ("fp8", "turbo2"), ("q8_0", "q8_0"), ("bf16", "turbo4")])
@pytest.mark.parametrize("key_start", [0, 16, 20])
@pytest.mark.parametrize("setting", ["plain", "sink logits", "window+cap+sinks"])
def test_lse_with_key_start_and_sinks(pair, key_start, setting):
    """key_start on and off a block boundary (rows that see no key: lse -inf, or the sink; out 0),
    sink logits in the denominator, a sliding window and soft-cap beside key_start."""
    case = make_case(CODECS[pair[0]], CODECS[pair[1]], seq_lens=LENS, q_lens=QLENS, num_kv_heads=2, group=2,
                     seed=9, transform=setting == "plain" and pair[0] == "turbo3", store_backend=None)
    sinks = torch.linspace(-1.0, 2.0, 4)
    params = {"plain": AttentionParams(scale=0.125), "sink logits": AttentionParams(scale=0.125, sinks=sinks),
              "window+cap+sinks": AttentionParams(scale=0.125, sliding_window=23, soft_cap=4.0, sinks=sinks)}[setting]
    for mode in ("decode", "prefill"):
        out, lse, want = _run(case, mode, params, key_start)
        _check(out, lse, want)
        if key_start:  # the 5-token row sees no key
            row = -1 if mode == "decode" else slice(-5, None)
            assert torch.equal(out[row], torch.zeros_like(out[row]))


def test_lse_refused_where_the_kernel_hands_over_to_the_reference():
    """Sink logits with a value centre run the reference ops (the kernel does not report the
    sinks' weight), which give no lse and read every key: asking for lse or a key_start is an
    error, not a silent NaN or a silently ignored bound."""
    from pagedkv.errors import InvalidInput

    case = make_case(CODECS["turbo3"], CODECS["turbo3"], seq_lens=(9,), transform=True, store_backend=None)
    params = AttentionParams(scale=0.125, sinks=torch.zeros(2))
    qsl = torch.arange(2, dtype=torch.int32)
    with pytest.raises(InvalidInput, match="lse"):
        cpu.attention(case.q_decode, case.layer, case.block_tables, case.seq_lens, qsl, params,
                      lse=torch.empty(1, 2))
    with pytest.raises(InvalidInput, match="key_start=3"):  # the reference would read every key
        cpu.attention(case.q_decode, case.layer, case.block_tables, case.seq_lens, qsl, params, key_start=3)


def test_bad_lse_and_key_start_are_refused_before_the_kernel_runs():
    from pagedkv.errors import InvalidInput

    case = make_case(CODECS["turbo3"], CODECS["turbo3"], seq_lens=(9, 4), store_backend=None)
    args = (case.q_decode, case.layer, case.block_tables, case.seq_lens, torch.arange(3, dtype=torch.int32),
            AttentionParams(scale=0.125))
    for bad in (torch.empty(1, 2), torch.empty(2, 2, dtype=torch.float64), torch.empty(2, 4).t()):
        with pytest.raises(InvalidInput, match="lse must be"):
            cpu.attention(*args, lse=bad)
    for bad in (-1, 2.0, True):
        with pytest.raises(InvalidInput, match="key_start must be"):
            cpu.attention(*args, key_start=bad)
