"""`pagedkv tune`: a per-layer, per-side codec plan under an average-bits budget.

`sensitivity` measures, on calibration text that is not the eval text (standard-library
docstrings, `integrations.vllm.fit.calibration_text`, unless --text is given), how much each
layer's attention output moves when only its keys or only its values are stored in each codec
of the ladder (with the statistics the cache would fit). `choose` picks per layer a K and a V
codec by a greedy knapsack on those errors (best error drop per bit first) within the budget and
writes the plan file, which `pagedkv.formats.read_plan` reads wherever a format is accepted.
"""

from __future__ import annotations

from typing import Optional, Sequence

DEFAULT_LADDER = ("turbo2", "turbo3", "turbo4", "turbo5", "q8_0")
STDLIB_TEXT = "stdlib-docstrings"


def tune(model, tokenizer, *, bits: float, text: Optional[str] = None, tokens: int = 512,
         recent=None, ladder: Sequence[str] = DEFAULT_LADDER, context: int = 1024, label: str = "") -> dict:
    """The plan document for `model` (see `choose.plan_document`): sensitivities on the first
    `tokens` tokens of `text` (None: the standard-library docstrings), then the greedy choice
    within `bits` (recent: an `ops.recent.RecentWindow` or None, counted at `context` tokens)."""
    import torch

    from ..codecs.catalogue import get_codec
    from ..errors import ConfigError
    from ..integrations.vllm.fit import calibration_text
    from .choose import choose, plan_document
    from .sensitivity import capture, side_errors

    codecs = [get_codec(c) for c in ladder]
    source = STDLIB_TEXT if text is None else "given"
    ids = tokenizer(calibration_text() if text is None else text, add_special_tokens=False)["input_ids"]
    bos = getattr(tokenizer, "bos_token_id", None)
    ids = ([int(bos)] if bos is not None else []) + list(ids)
    if len(ids) < tokens:
        raise ConfigError(f"--tokens {tokens}: the calibration text has only {len(ids)} tokens")
    layers = capture(model, torch.tensor([ids[:tokens]]))
    dims = [(int(k.shape[0]), int(k.shape[-1])) for _, k, _ in layers]
    errors = side_errors(layers, codecs)
    formats = choose(errors, codecs, dims, bits, recent, context)
    return plan_document(formats, dims, model=label, bits=bits, text=source, tokens=tokens, recent=recent,
                         errors=errors)
