"""Composition helper: a class that holds its parts as objects names some of their methods as
its own (`calls`), so a reader following a call lands on the one implementation."""

from __future__ import annotations

import functools


def calls(part: str, method):
    """A method that calls `method` of the object in attribute `part` (the part owns the state
    and the code; the name, signature and docstring are that method's)."""
    name = method.__name__

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        return getattr(getattr(self, part), name)(*args, **kwargs)

    return call
