"""The opt-in approximate attention paths as one setting that every front door carries.

`AttentionParams` has three switches that trade exactness for speed (each off by default, each
with a stated, tested bound: see its docstring): `int8_scores` (integer q.k on 2/3/4/5-bit table
keys, decode), `bf16_dots` (bf16 products: the CPU prefill tile, and decode scores over bf16 /
fp8 keys) and `sparse_v_threshold`
(skip V rows whose weight is below it). A front door builds its own AttentionParams per call
(the transformers drop-in from the HF attention call, the vLLM backend from the layer), so the
user's choice travels as an `Approximation` given once to the front door, which applies it to
every AttentionParams it builds: `PagedKVCache(..., approx=...)`, vLLM's
`{"pagedkv": {"approx": ...}}`, `pagedkv eval / generate --approx ...`.

The text form is the same everywhere: "exact" (or ""), or a comma list of the switches by their
AttentionParams names, `int8_scores`, `bf16_dots`, `sparse_v_threshold=T` (0 < T < 1), e.g.
"int8_scores,bf16_dots". It changes no stored byte: a cache's format and prefix keys are the
same with or without it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Union

from .errors import ConfigError

if TYPE_CHECKING:  # torch-free at import: the CLI checks settings before torch loads
    from .ops.batch import AttentionParams

_FLAGS = ("int8_scores", "bf16_dots")
_ACCEPTED = "'exact', or a comma list of int8_scores, bf16_dots, sparse_v_threshold=T (0 < T < 1)"


@dataclass(frozen=True)
class Approximation:
    """Which approximate paths a front door permits in the attention calls it makes.

    int8_scores / bf16_dots / sparse_v_threshold: as in `AttentionParams` (a backend without
    such a path computes exactly). The default, `Approximation()`, is exact."""

    int8_scores: bool = False
    bf16_dots: bool = False
    sparse_v_threshold: float = 0.0

    def __post_init__(self) -> None:
        for name in _FLAGS:
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"approx {name} must be True or False, got {getattr(self, name)!r}")
        t = self.sparse_v_threshold
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (0.0 <= t < 1.0) or math.isnan(t):
            raise ConfigError(f"approx sparse_v_threshold must be a number in [0, 1), got {t!r}")
        object.__setattr__(self, "sparse_v_threshold", float(t))

    @property
    def exact(self) -> bool:
        return self == Approximation()

    @property
    def name(self) -> str:
        """The text form `parse` reads back ("exact" when nothing is permitted)."""
        items = [n for n in _FLAGS if getattr(self, n)]
        if self.sparse_v_threshold:
            items.append(f"sparse_v_threshold={self.sparse_v_threshold:g}")
        return ",".join(items) or "exact"

    def apply(self, params: "AttentionParams") -> "AttentionParams":
        """`params` with these switches set (the same object when exact: nothing to change)."""
        if self.exact:
            return params
        return replace(params, int8_scores=self.int8_scores, bf16_dots=self.bf16_dots,
                       sparse_v_threshold=self.sparse_v_threshold)

    @staticmethod
    def parse(value: Union[None, str, "Approximation"]) -> "Approximation":
        """None / "" / "exact" -> exact; "int8_scores,bf16_dots,sparse_v_threshold=0.001" -> those;
        an Approximation as it is. ConfigError naming the bad item and the accepted forms."""
        if value is None or isinstance(value, Approximation):
            return value or Approximation()
        if not isinstance(value, str):
            raise ConfigError(f"approx must be a string ({_ACCEPTED}), got {value!r}")
        items = [x.strip() for x in value.split(",") if x.strip()]
        if items == ["exact"] or not items:
            return Approximation()
        kw: dict = {}
        for item in items:
            name, eq, arg = item.partition("=")
            name = name.strip()
            if name in kw:
                raise ConfigError(f"approx {value!r} names {name} twice")
            if name in _FLAGS and not eq:
                kw[name] = True
            elif name == "sparse_v_threshold" and eq:
                try:
                    kw[name] = float(arg)
                except ValueError:
                    raise ConfigError(f"approx {item!r}: the threshold must be a number, got {arg!r}") from None
                if not 0.0 < kw[name] < 1.0:
                    raise ConfigError(f"approx {item!r}: the threshold must be in (0, 1)")
            else:
                raise ConfigError(f"approx {value!r}: unknown item {item!r}; accepted: {_ACCEPTED}")
        return Approximation(**kw)
