"""`tunedB` / `tunedB@N` format labels of `pagedkv eval`: the plan `pagedkv tune --bits B` (with
`--context N`) makes for the model being evaluated (defaults of `pagedkv.tune.tune_budgets`: the
standard-library docstrings as calibration text, never the eval text; the high-precision window
searched). `tunedB`: measured on 512 calibration tokens, the window's tail counted at the eval's
window length. `tunedB@N` (N tokens, or Nk = N x 1024): the plan for a context of N tokens,
measured on a calibration window of N tokens, its tail counted at N. Made once per run for every
tuned label of one context together (one measurement, one plan per budget) and evaluated as a
plan file. Deterministic, so `tuned3.5@8k` names the same plan as `pagedkv tune --bits 3.5
--context 8k` for that model.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import replace
from typing import Optional, Sequence

from ..errors import ConfigError


def resolve_tuned(model, tokenizer, choices: Sequence, context: int, directory: Optional[str] = None) -> list:
    """`choices` with every tuned label replaced by its plan (a plan-file FormatChoice keeping the
    label); `context`: the eval's window length (where a `tunedB` plan counts its tail). The plans
    are written to `directory` (default: a new temporary one)."""
    from .choice import parse_choice

    groups: dict = {}
    for c in choices:
        if c.tune_bits is not None:
            groups.setdefault(c.tune_context, set()).add(c.tune_bits)
    if not groups:
        return list(choices)
    if tokenizer is None:
        raise ConfigError("tuned<B> formats need the model's tokenizer (the calibration text is tokenized)")
    from ..tune import check_context, for_context, tune_budgets
    from ..tune.choose import write_plan

    out = directory or tempfile.mkdtemp(prefix="pagedkv-tuned-")
    paths = {}
    for n, budgets in sorted(groups.items(), key=lambda kv: kv[0] or 0):
        budgets = sorted(budgets)
        if n is not None:
            check_context(model.config, n, f"tuned<B>@{n}:")
        kw = dict(context=context) if n is None else for_context(n)
        docs = tune_budgets(model, tokenizer, budgets=budgets, recent="auto", label="eval", **kw)
        for bits, doc in zip(budgets, docs):
            paths[bits, n] = os.path.join(out, f"tuned{bits:g}" + ("" if n is None else f"@{n}") + ".json")
            write_plan(paths[bits, n], doc)
    return [c if c.tune_bits is None else replace(parse_choice(paths[c.tune_bits, c.tune_context]), label=c.label)
            for c in choices]
