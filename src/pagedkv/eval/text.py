"""Evaluation text and windows.

The default text is Python's own documentation topics (`pydoc_data.topics`, shipped with every
Python): the topic texts in sorted key order joined by blank lines, real English prose with code.
Windows are spread evenly over the token stream, first and last included, so runs with a
different number of windows share their first and last windows and stay comparable.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from ..errors import ConfigError

MAX_TEXT_BYTES = 64 << 20  # an evaluation / calibration text (the default is ~1 MB)


def default_text() -> str:
    """`pydoc_data.topics`: the topics' texts in sorted key order, joined by blank lines."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def read_text(path: Optional[str]) -> str:
    """The text in `path` (UTF-8), or the default text when `path` is None."""
    if path is None:
        return default_text()
    p = Path(path).expanduser()
    if not p.is_file():  # follows a link; a FIFO or device (/dev/zero) is no regular file
        raise ConfigError(f"--text {path!r} is not a file; pass a UTF-8 text file or nothing for "
                          "the default (pydoc_data.topics)")
    with open(p, "rb") as fh:
        data = fh.read(MAX_TEXT_BYTES + 1)  # bounded: never the whole of a huge file
    if len(data) > MAX_TEXT_BYTES:
        raise ConfigError(f"--text {path!r} is larger than {MAX_TEXT_BYTES >> 20} MiB; pass a "
                          "smaller text (a few MB gives thousands of windows)")
    return data.decode("utf-8", errors="replace")


def tokenize(tokenizer, text: str) -> torch.Tensor:
    """int64 [N] token ids of `text`, without special tokens (BOS is added per window)."""
    ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.int64)


def bos_id(tokenizer) -> Optional[int]:
    """The tokenizer's BOS id, or None when it has none (base models like Gemma need it)."""
    bid = getattr(tokenizer, "bos_token_id", None)
    return int(bid) if bid is not None else None


def window_starts(num_tokens: int, windows: int, length: int) -> list[int]:
    """Start offsets of `windows` windows of `length` tokens spread evenly over `num_tokens`
    (first at 0, last ending at the end). Raises ConfigError when the text is too short."""
    if windows < 1:
        raise ConfigError(f"--windows must be >= 1, got {windows}")
    if length < 2:
        raise ConfigError(f"--window-tokens must be >= 2, got {length}")
    if num_tokens < length:
        raise ConfigError(f"the text has {num_tokens} tokens, fewer than one window of {length}; "
                          "pass a longer --text or a smaller --window-tokens")
    last = num_tokens - length
    if windows == 1:
        return [0]
    return [round(i * last / (windows - 1)) for i in range(windows)]


def subset_indices(windows: int, subset: Optional[int]) -> list[int]:
    """`subset` of the indices 0..windows-1, first and last included, evenly spread (all of
    them for None): a quick run on exactly some of the full run's windows."""
    if subset is None:
        return list(range(windows))
    if isinstance(subset, bool) or not isinstance(subset, int) or not 1 <= subset <= windows:
        raise ConfigError(f"--subset must be between 1 and --windows ({windows}), got {subset!r}")
    if subset == 1:
        return [0]
    return sorted({round(i * (windows - 1) / (subset - 1)) for i in range(subset)})


def make_windows(tokens: torch.Tensor, windows: int, length: int, bos: Optional[int],
                 subset: Optional[int] = None) -> list[torch.Tensor]:
    """`windows` int64 [length] windows; with a BOS id, each is BOS + (length - 1) text tokens.
    subset: keep only these many of them (`subset_indices`), the same windows a full run has."""
    body = length - 1 if bos is not None else length
    starts = window_starts(int(tokens.numel()), windows, body)
    starts = [starts[i] for i in subset_indices(windows, subset)]
    out = []
    for s in starts:
        w = tokens[s:s + body]
        if bos is not None:
            w = torch.cat([torch.tensor([bos], dtype=torch.int64), w])
        out.append(w)
    return out
