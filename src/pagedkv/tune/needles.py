"""Needle rows of `pagedkv tune`: key-value facts hidden in the calibration window and asked at
its end, so that the sensitivity also scores the queries that must find one far token.

The text rows of the sensitivity (`sensitivity.query_rows`) are spread over every position of
the window, where a query mostly reads its neighbours. A long prompt's answer often hangs on one
far token (a number, a name: retrieval), read by a few layers whose heads look far back; on the
text rows those layers seem cheap, and storing their keys in 3 bits loses the needle
(docs/long-context.md: on SmolLM2-135M the pass key is lost through the keys of layers 15-19).
The layer-local error of `sensitivity` does not see this even on the needle rows (a retrieval
head is one of a layer's heads, and what it loses shows only in the layers after it), so the
needle sensitivity is end to end: the gradient g of the answers' negative log-likelihood with
respect to every layer's keys and values (one forward and one backward), and per layer, side and
codec the sum of g^2 e^2 over the stored elements, e the codec's round-trip error with the
statistics the cache fits (`sensitivity._fit_roundtrip`): the expected squared change of the
answers' loss, to first order, when that side of that layer alone is stored in that codec.

The window keeps its length: the text is cut to make room for `needles` sentences "The code for
WORD is NNNNN." at depths spread over it and, at its end, one question per needle with its answer
("What is the code for WORD? The code for WORD is NNNNN."), the answers teacher-forced (one
forward records every layer, as for the text rows). Seeded and deterministic; the words are not
the eval's multikey keys, and the text is the tune's calibration text, never the eval text.
"""

from __future__ import annotations

import random
from typing import Sequence

from ..errors import ConfigError

NEEDLE = " The code for {word} is {value}. "
QUESTION = "\nWhat is the code for {word}? The code for {word} is"  # then " NNNNN."
WORDS = ("amber", "basalt", "cobalt", "dahlia", "ember", "fennel", "granite", "hazel", "indigo", "juniper",
         "kestrel", "lilac", "mango", "nutmeg", "opal", "pepper", "quartz", "russet", "saffron", "thistle")
DIGITS = 5
SEED = 0
DEFAULT_NEEDLES = 8
MIN_CONTEXT = 2048  # plans for shorter contexts get no needles by default (`tune.for_context`)
# depths of the needles: spread over the window, none at its very start or in the questions' part
FIRST_DEPTH, LAST_DEPTH = 0.05, 0.9


def needle_window(encode, ids: Sequence[int], needles: int = DEFAULT_NEEDLES, seed: int = SEED) -> tuple[list[int], list[int]]:
    """(window, rows): `ids` (a calibration window, BOS first when the model has one) with
    `needles` facts inserted and asked at its end, of the same length; rows: the positions whose
    next token is a token of an answer (" NNNNN"), sorted. encode(text) -> token ids without special tokens.
    ConfigError when the window is too short to hold them (a quarter of it at most)."""
    if not 1 <= needles <= len(WORDS):
        raise ConfigError(f"needles must be in 1..{len(WORDS)}, got {needles}")
    rng = random.Random(f"pagedkv-tune-needles-{seed}")
    words = rng.sample(WORDS, needles)
    values = [str(rng.randrange(10 ** (DIGITS - 1), 10 ** DIGITS)) for _ in words]
    facts = [list(encode(NEEDLE.format(word=w, value=v))) for w, v in zip(words, values)]
    asks, answers = [], []
    for w, v in zip(words, values):
        head, answer = list(encode(QUESTION.format(word=w))), list(encode(f" {v}"))
        asks.append(head + answer + list(encode(".")))
        answers.append((len(head), len(answer)))
    extra = sum(map(len, facts)) + sum(map(len, asks))
    if extra * 4 > len(ids):
        raise ConfigError(f"a calibration window of {len(ids)} tokens is too short for {needles} needles "
                          f"({extra} tokens); use a longer window or fewer needles")
    text = list(ids[:len(ids) - extra])
    start = 1 if len(text) > 1 else 0  # after the BOS (or the first token)
    span = len(text) - start
    cuts = [start + round(span * (FIRST_DEPTH + (LAST_DEPTH - FIRST_DEPTH) * i / max(1, needles - 1)))
            for i in range(needles)]
    window, prev = [], 0
    for cut, fact in zip(cuts, facts):
        window += text[prev:cut] + fact
        prev = cut
    window += text[prev:]
    rows = []
    for ask, (head, n) in zip(asks, answers):
        first = len(window) + head  # the answer's first token
        rows += range(first - 1, first + n - 1)
        window += ask
    return window, sorted(rows)


MAX_WINDOW = 2048  # the needle window: far reads at a length whose backward fits in memory on a CPU
NEEDLE_LABEL = "pagedkv_needles"  # the attention implementation the gradient capture registers


def needle_gradients(model, window: Sequence[int], rows: Sequence[int]) -> list[tuple]:
    """Per attention layer, in order, (q, k, v, dL/dk, dL/dv): float32 [H, T, D] (q: [Hq, T, D])
    after RoPE, L the answers' negative log-likelihood at `rows` of `window` (one forward and
    one backward through the model's own sdpa; its attention implementation is restored)."""
    import torch

    from ..integrations.capture import attention_hook, logit_rows

    seen: dict = {}

    def record(module, query, key, value, kwargs):
        # a zero offset per side: its gradient is the total derivative through every later layer
        dk = torch.zeros_like(key, requires_grad=True)
        dv = torch.zeros_like(value, requires_grad=True)
        seen[int(module.layer_idx)] = (query.detach(), key.detach(), value.detach(), dk, dv)
        return key + dk, value + dv

    # the weights need no gradient (only the K/V offsets do): no weight gradient is computed or held
    frozen = [p for p in model.parameters() if p.requires_grad]
    try:
        for p in frozen:
            p.requires_grad_(False)
        with attention_hook(model, NEEDLE_LABEL, record), torch.inference_mode(False), \
                torch.enable_grad():  # also when called under inference mode
            ids = torch.tensor([list(window)], device=model.device)
            at = torch.tensor(list(rows), device=model.device)
            head = logit_rows(model, at)  # the LM head at the answer rows only, where the model allows
            logits = model(ids, use_cache=False, **head).logits[0]
            logits = (logits if head else logits[at]).float()
            nll = -torch.log_softmax(logits, -1).gather(-1, ids[0, at + 1, None]).sum()
            nll.backward()
    finally:
        for p in frozen:
            p.requires_grad_(True)
    return [tuple(x[0].float() for x in seen[i][:3]) + tuple(x.grad[0].float() for x in seen[i][3:])
            for i in sorted(seen)]


def needle_errors(model, window: Sequence[int], rows: Sequence[int], ladder: Sequence) -> list[dict]:
    """Per attention layer {"k": {codec: sensitivity}, "v": {...}} (see the module docstring) for
    the needle window `window` (token ids) and its answer rows, over the `ladder` codecs each
    layer's head_dim can store."""
    from .sensitivity import _fit_roundtrip, _stores

    out = []
    for q, k, v, gk, gv in needle_gradients(model, window, rows):
        gk, gv = gk.square(), gv.square()
        row: dict = {"k": {}, "v": {}}
        for codec in ladder:
            if not _stores(codec, k.shape[-1]):
                continue
            kq, vq, _, _ = _fit_roundtrip(codec, k, v, q)
            row["k"][codec.name] = float((gk * (kq - k).square()).sum())
            row["v"][codec.name] = float((gv * (vq - v).square()).sum())
        out.append(row)
    return out


def combine(text: Sequence[dict], needle: Sequence[dict]) -> list[dict]:
    """Per layer {"k": {codec: error}, "v": ...}: each measure divided by its total over every
    layer and side at the cheapest codec, then summed, so that text quality and retrieval weigh
    the same in the plan (neither's unit matters)."""
    def total(errors):
        # the largest error of each (layer, side) is its cheapest rung's
        return sum(max(e[s].values()) for e in errors for s in ("k", "v") if e[s]) or 1.0
    nt, nn = total(text), total(needle)
    return [{s: {c: t[s][c] / nt + n[s].get(c, 0.0) / nn for c in t[s]} for s in ("k", "v")}
            for t, n in zip(text, needle)]
