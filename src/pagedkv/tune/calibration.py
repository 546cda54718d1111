"""The calibration text of `pagedkv tune`: standard-library docstrings, never the eval text.

`integrations.capture.calibration_text` (the module docstrings of a fixed list of modules, ~3k
tokens) serves the default 512-token measurement. A plan for a long context (`--context N`)
measures on a window of N tokens, so `long_calibration_text` continues it with the docstrings of
those modules' public classes, functions and methods, in sorted order (~22k tokens of SmolLM2's
tokenizer): the same first part, then more text of the same kind. Deterministic for a given
Python. The eval's text (`pydoc_data.topics`: the language reference's topics) is not in it.
"""

from __future__ import annotations

import importlib
import inspect


def _public(obj) -> list:
    names = getattr(obj, "__all__", None) if inspect.ismodule(obj) else None
    return sorted(names or (n for n in vars(obj) if not n.startswith("_")))


def long_calibration_text() -> str:
    """`calibration_text()`, then per module of its list the docstrings of its public classes and
    functions and of each class's public methods, each headed by its dotted name, joined by blank lines."""
    from ..integrations.capture import CALIBRATION_MODULES, calibration_text

    parts = [calibration_text()]
    for name in CALIBRATION_MODULES:
        mod = importlib.import_module(name)
        for attr in _public(mod):
            obj = getattr(mod, attr, None)
            if not (inspect.isclass(obj) or inspect.isroutine(obj)):
                continue
            members = [(f"{name}.{attr}", obj)]
            if inspect.isclass(obj):
                members += [(f"{name}.{attr}.{m}", getattr(obj, m, None)) for m in _public(obj)]
            for dotted, member in members:
                doc = inspect.getdoc(member) if inspect.isclass(member) or inspect.isroutine(member) else None
                if doc:
                    parts.append(f"{dotted}\n\n{doc}")
    return "\n\n".join(parts)
