"""The retrieval tasks of `pagedkv eval --task`: needles in a haystack, generated in the package.

Offline, deterministic, seeded: the same (task, length, trials, depths, seed, tokenizer) give the
same token ids, so every KV format sees exactly the same trials (paired).

- **passkey** (the classic probe of llama.cpp's `llama-passkey`): a haystack of one repeated
  filler paragraph, one needle "The pass key is NNNNN. Remember it. NNNNN is the pass key." at
  the trial's depth, then, on a line of its own, the needle's opening "The pass key is" for the
  model to complete; one trial per context. (llama-passkey asks "What is the pass key? The pass
  key is"; after that question the small models pagedkv ships often define the word instead,
  "a special key that is used to ...", even in bf16, so the task could not judge a cache.)
- **multikey** (RULER's niah_multikey form): a haystack of the default eval text
  (`pydoc_data.topics`) with `keys` needles "One of the special magic numbers for KEY is:
  NNNNNNN." (distinct keys, 7-digit values); each needle is queried once ("What is the special
  magic number for KEY mentioned in the provided text? ... is"), the others being its distractors.
  The queries of one context share it, so those trials are correlated (they are not independent
  draws: the interval and the test treat them as if they were). A context's needles take
  neighbouring depths of the spread, so each trial's depth is its own needle's.
  `cue="opening"` asks instead with the needle's own opening ("One of the special magic numbers
  for KEY is:"), as the passkey task does: a base model (Gemma-3-270M) completes that where it
  does not answer RULER's question; an instruction model (SmolLM2-135M-Instruct) answers the
  question better at 4k (docs/long-context.md).

Lengths count every token the model sees, the answer it writes included: a prompt has
`length - max_new_tokens` tokens at most (the BOS, an instruction line, the haystack, the needles,
the question). Depth d puts a needle after the fraction d of the haystack, moved to the nearest
boundary (a token ending a sentence or a line) so that it never splits a word; `Trial.depth` is
where it landed. All trials of a task and length cut their haystack from the same token stream,
so trials share the haystack up to their first needle: run in `sharing_order`, a cache with
prefix caching computes each trial's shared part once (`pagedkv.eval.retrieval`).

Torch-free: token ids are lists; a tokenizer is anything with `encode(text) -> list[int]` and
`decode(ids) -> str` (`TextCodec` wraps a Hugging Face tokenizer).
"""

from __future__ import annotations

import bisect
import random
import re
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from ..errors import ConfigError

TASKS = ("passkey", "multikey")

PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
PASSKEY_INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
                 "I will quiz you about the important information there.\n")
PASSKEY_NEEDLE = "The pass key is {value}. Remember it. {value} is the pass key. "
PASSKEY_QUESTION = "\nThe pass key is"

MULTIKEY_INTRO = ("Some special magic numbers are hidden within the following text. Make sure to memorize "
                  "them. I will quiz you about the numbers afterwards.\n")
MULTIKEY_NEEDLE = "\nOne of the special magic numbers for {key} is: {value}.\n"
MULTIKEY_QUESTION = ("\nWhat is the special magic number for {key} mentioned in the provided text? "
                     "The special magic number for {key} mentioned in the provided text is")
MULTIKEY_OPENING = "\nOne of the special magic numbers for {key} is:"
# how a multikey trial asks for its key: RULER's question (default) or the needle's own opening
MULTIKEY_CUES = {"question": MULTIKEY_QUESTION, "opening": MULTIKEY_OPENING}
# distinct, common, single words: the keys of the multikey needles
KEYS = ("apple", "river", "candle", "tiger", "window", "garden", "silver", "pencil", "castle", "rocket",
        "orange", "forest", "hammer", "violin", "planet", "bridge", "dragon", "mirror", "island", "jacket",
        "lemon", "falcon", "harbor", "carpet", "meadow", "anchor", "basket", "cactus", "helmet", "lantern",
        "marble", "needle", "oyster", "parrot", "saddle", "tunnel", "walrus", "yogurt", "zipper", "button")
PASSKEY_DIGITS = 5
MULTIKEY_DIGITS = 7
_DIGITS = re.compile(r"\d+")


class TextCodec:
    """encode / decode of a Hugging Face tokenizer, without special tokens."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False, return_attention_mask=False)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


@dataclass(frozen=True)
class Needle:
    key: str  # "" for the passkey
    value: str
    position: int  # index in the prompt of its first token
    tokens: int
    depth: float  # where it landed: haystack tokens before it / haystack tokens


@dataclass(frozen=True)
class Trial:
    """One question to the model. `context` numbers the haystack-with-needles it is asked about
    (trials with the same task, length and context share the prompt up to the question)."""

    task: str
    length: int
    index: int
    context: int
    prompt: tuple[int, ...]
    answer: str
    max_new_tokens: int
    needles: tuple[Needle, ...]
    queried: int  # which of `needles` the question asks for

    @property
    def depth(self) -> float:
        return self.needles[self.queried].depth

    @property
    def first_needle(self) -> int:
        return min(n.position for n in self.needles)


def extract_answer(text: str) -> Optional[str]:
    """The first run of digits in the model's text (its answer), None when there is none."""
    m = _DIGITS.search(text)
    return m.group(0) if m else None


def is_correct(generated: str, answer: str) -> bool:
    """Exact match: the first number the model wrote is the answer, digit for digit (a longer
    or shorter number, or none, is wrong)."""
    return extract_answer(generated) == answer


def spread_depths(trials: int, depths: Optional[Sequence[float]] = None) -> list[float]:
    """The target depth of each trial: `depths` taken in turn when given, else evenly spread
    over [0, 1], both ends included (0.5 for a single trial)."""
    if depths:
        return [float(depths[i % len(depths)]) for i in range(trials)]
    if trials == 1:
        return [0.5]
    return [i / (trials - 1) for i in range(trials)]


def max_new_tokens(digits: int) -> int:
    """Tokens decoded per answer: a digit per token at worst, a space and one more to see
    where the number ends."""
    return digits + 2


def generate(task: str, length: int, trials: int, codec, *, bos: Optional[int], seed: int = 0,
             depths: Optional[Sequence[float]] = None, keys: int = 4, cue: str = "question",
             text_tokens: Optional[Callable[[], list[int]]] = None) -> list[Trial]:
    """The `trials` trials of `task` at `length` tokens (see the module docstring).

    codec: encode / decode (`TextCodec`); bos: the BOS id put first, or None; keys: needles per
    multikey context (its queries); cue: how multikey asks (`MULTIKEY_CUES`); text_tokens: the
    default text's token ids, called once for multikey. ConfigError when the length leaves no room
    for the haystack."""
    if task not in TASKS:
        raise ConfigError(f"--task {task!r}: accepted tasks are {', '.join(TASKS)} (or kl)")
    check_cue(cue)
    targets = spread_depths(trials, depths)
    if task == "passkey":
        return _passkey(length, targets, codec, bos, seed)
    return _multikey(length, targets, codec, bos, seed, keys, MULTIKEY_CUES[cue], text_tokens)


def check_cue(cue) -> None:
    """ConfigError unless `cue` names one of MULTIKEY_CUES."""
    if cue not in MULTIKEY_CUES:
        raise ConfigError(f"--cue {cue!r}: accepted are {', '.join(MULTIKEY_CUES)} (how multikey asks for a key: "
                          "RULER's question or the needle's own opening)")


def _rng(task: str, seed: int, length: int, context: int) -> random.Random:
    return random.Random(f"pagedkv-{task}-{seed}-{length}-{context}")


def _boundaries(haystack: Sequence[int], codec) -> list[int]:
    """Offsets 0..n where a needle may go: the start, the end, and after every token whose text
    ends a sentence or a line."""
    ends = {}
    out = [0]
    for i, t in enumerate(haystack):
        if t not in ends:
            s = codec.decode([t])
            ends[t] = s.endswith((".", "\n", ". ", ".\n")) or s.rstrip(" ").endswith(".")
        if ends[t]:
            out.append(i + 1)
    if out[-1] != len(haystack):
        out.append(len(haystack))
    return out


def _snap(offset: float, bounds: Sequence[int]) -> int:
    i = bisect.bisect_left(bounds, offset)
    near = [b for b in bounds[max(0, i - 1):i + 1]]
    return min(near, key=lambda b: (abs(b - offset), b))


def _assemble(head: list[int], haystack: list[int], needles: list[tuple[str, str, list[int], float]],
              question: list[int], codec) -> tuple[list[int], tuple[Needle, ...]]:
    """The prompt head + haystack with the needles (key, value, tokens, target depth, sorted
    by depth) at snapped offsets + question; the Needle records."""
    bounds = _boundaries(haystack, codec)
    n = len(haystack)
    prompt = list(head)
    done = 0
    placed = []
    for key, value, toks, d in needles:
        off = max(done, _snap(d * n, bounds))
        prompt += haystack[done:off]
        placed.append(Needle(key, value, len(prompt), len(toks), off / n if n else 0.0))
        prompt += toks
        done = off
    prompt += haystack[done:] + question
    return prompt, tuple(placed)


def _head(codec, bos: Optional[int], intro: str) -> list[int]:
    return ([] if bos is None else [bos]) + codec.encode(intro)


def _room(length: int, used: int, task: str) -> int:
    n = length - used
    if n < 16:
        raise ConfigError(f"--lengths {length}: too short for the {task} task (its instruction, needles and "
                          f"question take {used} tokens); use a longer length")
    return n


def _passkey(length: int, targets: list[float], codec, bos: Optional[int], seed: int) -> list[Trial]:
    head = _head(codec, bos, PASSKEY_INTRO)
    question = codec.encode(PASSKEY_QUESTION)
    unit = codec.encode(PASSKEY_FILLER)
    max_new = max_new_tokens(PASSKEY_DIGITS)
    out = []
    for i, d in enumerate(targets):
        value = str(_rng("passkey", seed, length, i).randrange(10 ** (PASSKEY_DIGITS - 1), 10 ** PASSKEY_DIGITS))
        needle = codec.encode(PASSKEY_NEEDLE.format(value=value))
        n = _room(length, len(head) + len(needle) + len(question) + max_new, "passkey")
        haystack = (unit * (n // len(unit) + 1))[:n]
        prompt, placed = _assemble(head, haystack, [("", value, needle, d)], question, codec)
        out.append(Trial("passkey", length, i, i, tuple(prompt), value, max_new, placed, 0))
    return out


def _multikey(length: int, targets: list[float], codec, bos: Optional[int], seed: int, keys: int,
              question_form: str, text_tokens) -> list[Trial]:
    if not 1 <= keys <= len(KEYS):
        raise ConfigError(f"--keys must be between 1 and {len(KEYS)}, got {keys!r}")
    head = _head(codec, bos, MULTIKEY_INTRO)
    max_new = max_new_tokens(MULTIKEY_DIGITS)
    text = text_tokens() if text_tokens is not None else codec.encode(_default_text())
    order = sorted(range(len(targets)), key=lambda i: (targets[i], i))  # neighbouring depths share a context
    out: list[Trial] = []
    for c, first in enumerate(range(0, len(order), keys)):
        members = order[first:first + keys]
        rng = _rng("multikey", seed, length, c)
        names = rng.sample(KEYS, len(members))
        values = [str(rng.randrange(10 ** (MULTIKEY_DIGITS - 1), 10 ** MULTIKEY_DIGITS)) for _ in members]
        needles = [(k, v, codec.encode(MULTIKEY_NEEDLE.format(key=k, value=v)), targets[t])
                   for k, v, t in zip(names, values, members)]
        questions = [codec.encode(question_form.format(key=k)) for k in names]
        used = len(head) + sum(len(x[2]) for x in needles) + max(len(q) for q in questions) + max_new
        n = _room(length, used, "multikey")
        if len(text) < n:
            raise ConfigError(f"--lengths {length}: the text has {len(text)} tokens, fewer than the "
                              f"{n} of the haystack")
        start = _rng("multikey-text", seed, length, 0).randrange(0, len(text) - n + 1)  # one stream per length
        haystack = list(text[start:start + n])
        for j, (t, q) in enumerate(zip(members, questions)):
            prompt, placed = _assemble(head, haystack, needles, q, codec)
            out.append(Trial("multikey", length, t, c, tuple(prompt), values[j], max_new, placed, j))
    return sorted(out, key=lambda t: t.index)


def _default_text() -> str:
    from .text import default_text

    return default_text()


def sharing_order(trials: Sequence[Trial]) -> list[Trial]:
    """The trials in the order that shares the most prefix blocks: contexts by their first
    needle, latest first (each context's prompt up to that needle is the previous one's), the
    queries of a context one after another."""
    return sorted(trials, key=lambda t: (-t.first_needle, t.context, t.index))


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def computed_tokens(ordered: Sequence[Trial], block_size: int, reuse: bool = True) -> list[int]:
    """Prompt tokens a prefix-caching cache computes for each trial run in this order: all but
    the whole blocks it shares with the previous trial's prompt (one token always computed);
    all of them with reuse=False (caches that take no prefix hits: sliding-window layers)."""
    out = []
    prev: Sequence[int] = ()
    for t in ordered:
        hit = 0
        if reuse:
            hit = min(shared_prefix(prev, t.prompt), len(t.prompt) - 1) // block_size * block_size
        out.append(len(t.prompt) - hit)
        prev = t.prompt
    return out
