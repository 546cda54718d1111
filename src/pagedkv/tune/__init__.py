"""`pagedkv tune`: a per-layer, per-side codec plan under an average-bits budget.

`sensitivity` measures, on calibration text that is not the eval text (standard-library
docstrings, `integrations.capture.calibration_text`, unless --text is given), how much each
layer's attention output moves when only its keys or only its values are stored in each codec
of the ladder (with the statistics the cache would fit). `choose` picks per layer a K and a V
codec by a greedy knapsack on those errors (best error drop per bit first) within the budget and
writes the plan file, which `pagedkv.formats.read_plan` reads wherever a format is accepted. A plan
for a context of 2048 tokens or more also weighs `needles`: what each layer's keys and values
cost the answers to facts hidden far back in the window.
"""

from __future__ import annotations

from typing import Optional, Sequence

DEFAULT_LADDER = ("turbo2g64", "turbo2", "turbo3", "turbo4", "turbo5", "q8_0")
# a plan for a context length (`--context N`) also has the codecs with a scale per 32, whose
# saving pays for a recent window's tail at long contexts, and scores retrieval (needle rows)
CONTEXT_LADDER = ("turbo2g64", "turbo2", "turbo3g32", "turbo3", "turbo4g32", "turbo4", "turbo5", "q8_0")
STDLIB_TEXT = "stdlib-docstrings"
LONG_STDLIB_TEXT = "stdlib-docstrings+members"  # `calibration.long_calibration_text`, for long windows
# The windows `recent="auto"` searches: (recent positions, sinks) with the tail in q8_0; None = no window.
WINDOW_CANDIDATES = (None, (16, 16), (32, 16), (64, 16), (128, 16), (32, 0), (64, 0), (128, 0))
WINDOW_CODEC = "q8_0"


def window_candidates() -> list:
    """The RecentWindow objects (or None) of WINDOW_CANDIDATES, in order."""
    from ..spec import RecentWindow

    return [None if c is None else RecentWindow(c[0], WINDOW_CODEC, sinks=c[1]) for c in WINDOW_CANDIDATES]


def for_context(n: int, needles: Optional[int] = None) -> dict:
    """The `tune` / `tune_budgets` arguments of a plan for a context of n tokens (`pagedkv tune
    --context N`, the eval's `tunedB@N`): measured on n tokens, its tail counted at n, the context
    ladder, and `needles` needle rows (None: `needles.DEFAULT_NEEDLES` from `needles.MIN_CONTEXT`
    tokens on, where far reads are what a prompt is; 0: none)."""
    from .needles import DEFAULT_NEEDLES, MIN_CONTEXT

    if needles is None:
        needles = DEFAULT_NEEDLES if n >= MIN_CONTEXT else 0
    return dict(context=n, tokens=n, ladder=CONTEXT_LADDER, needles=needles)


def check_context(config, context: int, what: str = "--context") -> None:
    """ConfigError when a plan for `context` tokens is asked of a model (its HF `config`, read
    before the weights load) trained to fewer positions: its calibration window would be longer
    than anything the model has seen."""
    from ..errors import ConfigError
    from ..integrations.model_config import trained_context

    limit = trained_context(config)
    if limit is not None and context > limit:
        raise ConfigError(f"{what} {context}: the model was trained to {limit} positions")


def tune(model, tokenizer, *, bits: float, text: Optional[str] = None, tokens: int = 512,
         recent=None, ladder: Sequence[str] = DEFAULT_LADDER, context: int = 1024, label: str = "",
         needles: int = 0) -> dict:
    """The plan document for `model` (see `choose.plan_document`): sensitivities on the first
    `tokens` tokens of `text` (None: the standard-library docstrings; past their ~3k tokens, with
    their modules' members' docstrings: `calibration.long_calibration_text`), then the greedy choice
    within `bits`. recent: None (no window), an `ops.recent.RecentWindow` (that window), or
    "auto" (the best of `window_candidates()`, see `choose.choose_window`); a window's tail is
    counted at `context` tokens. A plan for a context of N tokens (`pagedkv tune --context N`) is
    tokens = context = N: measured on a window as long as the one it serves, bits counted there.
    needles > 0 adds the retrieval sensitivity (`needles`: that many facts hidden in a calibration
    window of min(tokens, needles.MAX_WINDOW) tokens and asked at its end), weighed the same as the
    text's (`needles.combine`)."""
    return tune_budgets(model, tokenizer, budgets=[bits], text=text, tokens=tokens, recent=recent, ladder=ladder,
                        context=context, label=label, needles=needles)[0]


def tune_budgets(model, tokenizer, *, budgets: Sequence[float], text: Optional[str] = None, tokens: int = 512,
                 recent=None, ladder: Sequence[str] = DEFAULT_LADDER, context: int = 1024,
                 label: str = "", needles: int = 0) -> list[dict]:
    """`tune` for several budgets from one measurement (the sensitivities do not depend on the
    budget): one plan document per budget, in order, each equal to `tune`'s for that budget."""
    import torch

    from ..codecs.catalogue import get_codec
    from ..integrations.capture import calibration_ids, calibration_text
    from .choose import choose_window, plan_document
    from .sensitivity import capture, window_errors

    codecs = [get_codec(c) for c in ladder]
    source = STDLIB_TEXT if text is None else "given"
    if text is None and len(tokenizer(calibration_text(), add_special_tokens=False)["input_ids"]) + 1 < tokens:
        from .calibration import long_calibration_text  # a long window: the modules' members' docstrings too

        text, source = long_calibration_text(), LONG_STDLIB_TEXT
    ids = calibration_ids(tokenizer, tokens, text, what=f"--tokens {tokens}")
    layers = capture(model, torch.tensor([ids]))
    dims = [(int(layer[1].shape[0]), int(layer[1].shape[-1])) for layer in layers]
    windows = window_candidates() if isinstance(recent, str) and recent == "auto" else [recent]
    per_window = window_errors(layers, codecs, windows)
    needle_doc = {}
    if needles:
        from . import needles as nd

        n_tokens = min(tokens, nd.MAX_WINDOW)
        nwin, rows = nd.needle_window(lambda s: tokenizer(s, add_special_tokens=False)["input_ids"],
                                      ids[:n_tokens], needles)
        found = nd.needle_errors(model, nwin, rows, codecs)
        per_window = [nd.combine(e, found) for e in per_window]
        needle_doc = {"needles": needles, "needle_tokens": n_tokens,
                      "needle_sensitivity": [{s: {c: float(f"{e:.4g}") for c, e in row[s].items()} for s in ("k", "v")}
                                             for row in found]}
    docs = []
    for bits in budgets:
        window, formats, _, search = choose_window(list(zip(windows, per_window)), codecs, dims, bits, context)
        errors = per_window[windows.index(window)]
        docs.append(plan_document(formats, dims, model=label, bits=bits, text=source, tokens=tokens, recent=window,
                                  errors=errors, context=context, search=search) | needle_doc)
    return docs
