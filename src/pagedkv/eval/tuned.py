"""`tunedB` format labels of `pagedkv eval`: the plan `pagedkv tune --bits B` makes for the model
being evaluated (defaults of `pagedkv.tune.tune_budgets`: the standard-library docstrings as
calibration text, never the eval text; the high-precision window searched), made once per run
for every tuned label together (one measurement, one plan per budget) and evaluated as a plan
file. Deterministic, so `tuned3.5` names the same plan as `pagedkv tune --bits 3.5` for that model.
"""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import replace
from typing import Optional, Sequence

from ..errors import ConfigError

_TUNED = re.compile(r"^tuned(?P<bits>\d+(?:\.\d+)?)$")


def tuned_bits(spec: str) -> Optional[float]:
    """B for a label `tunedB` (e.g. tuned3.5), else None."""
    m = _TUNED.match(spec.strip().lower())
    return float(m["bits"]) if m else None


def resolve_tuned(model, tokenizer, choices: Sequence, context: int, directory: Optional[str] = None) -> list:
    """`choices` with every tuned label replaced by its plan (a plan-file FormatChoice keeping the
    label); the plans are written to `directory` (default: a new temporary one)."""
    from .runner import parse_choice

    budgets = sorted({c.tune_bits for c in choices if c.tune_bits is not None})
    if not budgets:
        return list(choices)
    if tokenizer is None:
        raise ConfigError("tuned<B> formats need the model's tokenizer (the calibration text is tokenized)")
    from ..tune import tune_budgets
    from ..tune.choose import write_plan

    docs = tune_budgets(model, tokenizer, budgets=budgets, recent="auto", context=context, label="eval")
    out = directory or tempfile.mkdtemp(prefix="pagedkv-tuned-")
    paths = {}
    for bits, doc in zip(budgets, docs):
        paths[bits] = os.path.join(out, f"tuned{bits:g}.json")
        write_plan(paths[bits], doc)
    return [c if c.tune_bits is None else replace(parse_choice(paths[c.tune_bits]), label=c.label) for c in choices]
