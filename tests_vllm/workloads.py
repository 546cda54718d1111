"""The prompts and windows the vLLM tests send (shared by the session's engines)."""

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "A paged KV cache stores the keys and values of every token in fixed-size blocks, so that",
    "Q: What is the boiling point of water at sea level?\nA:",
]
FIRST_TOKENS = 8
FORMATS = ("turbo4", "turbo3", "fp8k_turbo3v")  # compared with `pagedkv eval` as NAME+hp
KL_FACTOR = 3.0  # vLLM's prompt-logprob KL within this factor of the eval's (both vs their bf16)
WINDOW_FORMAT = "turbo3+r64s16q8_0"  # issue 13's best <= 4.5-bit format: 64 recent + 16 sink tokens in q8_0
WINDOWS, WINDOW_TOKENS = 2, 256


def eval_windows(tokenizer):
    """The windows `pagedkv eval --windows 2 --window-tokens 256` uses (default text)."""
    from pagedkv.eval.text import bos_id, default_text, make_windows, tokenize

    return [w.tolist() for w in make_windows(tokenize(tokenizer, default_text()), WINDOWS,
                                              WINDOW_TOKENS, bos_id(tokenizer))]


def prefix_prompt() -> str:
    """~520 tokens: several whole 128-token blocks for the prefix cache to hit."""
    return " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog." for i in range(40)) + "\nSummary:"


def plan_layers(num_layers: int = 30) -> list[tuple[str, str]]:
    """A per-layer (K, V) codec plan like `pagedkv tune`'s: q8_0 keys at the ends, turbo4 keys
    elsewhere, values alternating turbo3 / turbo4 (four distinct page sizes)."""
    return [("q8_0" if i in (0, 1, num_layers - 1) else "turbo4", "turbo4" if i % 2 else "turbo3")
            for i in range(num_layers)]


def write_plan(path, layers, dims=(3, 64), recent=None) -> str:
    """A plan file as `pagedkv tune` writes it (its own writer) for `layers` [(k, v)]."""
    from pagedkv.formats import KVFormat
    from pagedkv.codecs import get_codec
    from pagedkv.ops.recent import RecentWindow
    from pagedkv.tune.choose import plan_document, write_plan as write

    formats = [KVFormat(get_codec(k), get_codec(v)) for k, v in layers]
    rw = None if recent is None else RecentWindow(*recent)
    doc = plan_document(formats, [tuple(dims)] * len(layers), model="test", bits=5.0, text="stdlib",
                        tokens=512, recent=rw, errors=[{"k": {}, "v": {}} for _ in layers])
    write(str(path), doc)
    return str(path)
