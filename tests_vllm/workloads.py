"""The prompts and windows the vLLM tests send (shared by the session's engines)."""

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "A paged KV cache stores the keys and values of every token in fixed-size blocks, so that",
    "Q: What is the boiling point of water at sea level?\nA:",
]
FIRST_TOKENS = 8
WINDOWS, WINDOW_TOKENS = 2, 256


def eval_windows(tokenizer):
    """The windows `pagedkv eval --windows 2 --window-tokens 256` uses (default text)."""
    from pagedkv.eval.text import bos_id, default_text, make_windows, tokenize

    return [w.tolist() for w in make_windows(tokenize(tokenizer, default_text()), WINDOWS,
                                              WINDOW_TOKENS, bos_id(tokenizer))]


def prefix_prompt() -> str:
    """~520 tokens: several whole 128-token blocks for the prefix cache to hit."""
    return " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog." for i in range(40)) + "\nSummary:"
