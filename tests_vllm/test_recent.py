"""The high-precision recent window in a real vLLM engine (`integrations/vllm/tail.py`).

`turbo3+r64s16q8_0` (issue 13's best format at <= 4.5 bits: turbo3 pages, the last 64 and the
first 16 positions of each sequence read from a q8_0 tail) serves the embedded model with the
tail in a second KV-cache group per layer. Checked here: its prompt log-probabilities agree with
`pagedkv eval`'s KL for the same label (two front doors, one truth, within KL_FACTOR), the tail
blocks vLLM's own block manager holds at every decode step are exactly what the paged window
stores (`ops.recent.stored_tail_tokens`), the tail never widens a page block (the capacity is
the pages'), a repeated prompt hits the prefix cache with identical output, and a window whose
sinks cover every position (all keys from its bf16 tail) gives the bf16 pages' results (within
the fp32 arithmetic of the two attention paths).
"""

from engine import KV_BYTES, coarse_kl
from workloads import FIRST_TOKENS, KL_FACTOR, WINDOW_FORMAT


def _tail_group(runs):
    groups = runs["window"]["kv_cache_config"].kv_cache_groups
    assert len(groups) == 2, groups
    return groups[1].kv_cache_spec


def test_prompt_logprobs_agree_with_pagedkv_eval(runs, eval_kl):
    kl = coarse_kl(runs["bf16"]["logprobs"], runs["window"]["logprobs"])
    kl3 = coarse_kl(runs["bf16"]["logprobs"], runs["turbo3"]["logprobs"])
    ref = eval_kl[WINDOW_FORMAT]
    print(f"MEASURED {WINDOW_FORMAT}: vLLM prompt-logprob KL {kl:.5f}, pagedkv eval KL {ref:.5f}, "
          f"ratio {kl / ref:.2f} (turbo3+hp in vLLM: {kl3:.5f})")
    assert ref > 0 and ref / KL_FACTOR < kl < ref * KL_FACTOR, f"vLLM KL {kl:.5f}, pagedkv eval KL {ref:.5f}"
    assert kl < kl3  # the window helps (turbo3+hp has q8_0 in 6 of 30 layers)


def test_vllm_holds_exactly_the_tail_blocks_the_window_stores(runs):
    """At each decode step vLLM's block manager holds, for the request, cdiv(n, 128) page blocks
    and the tail blocks covering the last 64 positions and the first 16: what the paged window
    stores (the eval's bits count the same), never more."""
    from pagedkv.ops.recent import stored_tail_tokens

    spec = _tail_group(runs)
    held = runs["window"]["held"]
    decode = [row for prev, row in zip(held, held[1:]) if row[0] == prev[0] + 1]
    assert len(decode) >= 12 and decode[0][0] < 320 <= decode[-1][0]
    for n, (pages, tail) in decode:
        assert pages == -(-n // 128), (n, pages)
        assert tail * spec.block_size == stored_tail_tokens(n, 64, spec.block_size, sinks=16), (n, tail)
    assert max(t for _, (_, t) in decode) <= 1 + -(-63 // spec.block_size) + 1


def test_the_tail_does_not_widen_a_page_block(runs):
    """The pool's blocks are the pages' (30 layers of turbo3 at 128 tokens): the capacity vLLM
    reports is plain turbo3's; each tail block (32 tokens of q8_0 in 30 layers) fits in one."""
    from pagedkv.formats import parse_format
    from pagedkv.integrations.vllm.layout import page_bytes
    from pagedkv.integrations.vllm.tail import SinkWindowSpec

    spec = _tail_group(runs)
    assert isinstance(spec, SinkWindowSpec) and spec.sliding_window == 64 and spec.sink_blocks == 1
    pages = 30 * page_bytes(parse_format("turbo3"), 128, 3, 64)
    tail = 30 * page_bytes(parse_format("q8_0"), spec.block_size, 3, 64)
    assert spec.block_size == 32 and tail <= pages < 2 * tail
    assert runs["window"]["kv_cache_config"].kv_cache_groups[0].kv_cache_spec.block_size == 128
    blocks, _ = runs["window"]["capacity"]  # (vLLM's cache_config.block_size is the groups' smallest)
    assert blocks == KV_BYTES // pages  # plain turbo3's pool: the tail does not widen a block


def test_repeated_prompt_hits_the_prefix_cache_with_identical_output(runs):
    (ids1, text1, cached1), (ids2, text2, cached2) = runs["window"]["prefix"]
    assert cached2 >= 256 > cached1  # the pages' blocks and the tail's window and sinks were cached
    assert ids1 == ids2, (text1, text2)
    assert len(text1.strip()) > 0


def test_sinks_covering_every_position_give_the_bf16_pages_results(runs):
    """turbo2+r16s512 without centring: every key is a sink, read from the bf16 tail (the window
    slides and frees blocks, the sinks' blocks are kept), so the results are the bf16 pages'."""
    diffs = []
    for a_win, b_win, ids in zip(runs["bf16"]["prompt_logprobs"], runs["window_exact"]["prompt_logprobs"],
                                 runs["bf16"]["windows"]):
        for pos, (a, b) in enumerate(zip(a_win, b_win)):
            t = ids[pos + 1]
            diffs.append(abs(a[t] - b[t]))
    print(f"MEASURED all-sink bf16 tail vs bf16 pages: mean |dlogprob| {sum(diffs) / len(diffs):.2e}, "
          f"max {max(diffs):.2e}")
    # the same bf16 K/V: what differs is the fp32 arithmetic (ops.recent's torch reference against
    # the C kernel, e.g. its exp), 1e-3 on average and 1e-2 at most through 30 layers; a tail read
    # from a freed block would be off by nats
    assert sum(diffs) / len(diffs) < 3e-3 and max(diffs) < 0.05
    for (a_ids, a_text, _), (b_ids, b_text, _) in zip(runs["bf16"]["greedy"], runs["window_exact"]["greedy"]):
        assert a_ids[:FIRST_TOKENS] == b_ids[:FIRST_TOKENS], (a_text, b_text)
