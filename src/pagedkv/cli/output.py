"""Printing results: a rich table for people, JSON for programs.

Numbers in a table column share one notation: integers (and integral floats) as integers,
other floats with the same number of decimals down the column, enough for 4 significant digits
of its smallest non-zero value (at most 6, no trailing zeros shared by the whole column;
scientific notation only when a value would vanish)."""

from __future__ import annotations

import json
import math
import sys
from typing import Any, Callable, Optional, Sequence

from rich.console import Console
from rich.table import Table


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2)
    sys.stdout.write("\n")


def print_then_plot(show: Callable[[], None], plot: Optional[str], draw: Callable[[str], None],
                    log: Callable[[str], None]) -> None:
    """show() the results (table or JSON, flushed), then draw(plot) when a plot file was asked
    for: a plot that fails never loses a finished run's numbers."""
    show()
    sys.stdout.flush()
    if plot:
        draw(plot)
        log(f"plot written to {plot}")


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    table = Table(title=title, title_justify="left")
    for col in columns:
        table.add_column(col, justify="left" if col in ("name", "format", "codec") else "right")
    fmts = [column_formatter([row[i] for row in rows if i < len(row)]) for i in range(len(columns))]
    for row in rows:
        table.add_row(*[fmts[i](v) for i, v in enumerate(row)])
    Console(width=max(120, Console().width)).print(table)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def column_formatter(values: Sequence[Any]) -> Callable[[Any], str]:
    """A function printing the values of one column in one notation (see the module doc)."""
    floats = [abs(v) for v in values if isinstance(v, float) and math.isfinite(v)]
    fractional = [v for v in floats if v != int(v)]
    if not fractional:
        def fmt(v):
            if isinstance(v, float) and math.isfinite(v) and v == int(v):
                return str(int(v))
            return str(v)
        return fmt
    smallest = min(v for v in fractional if v > 0)
    decimals = min(6, max(0, 3 - math.floor(math.log10(smallest))))
    nums = [v for v in values if _is_number(v) and math.isfinite(v)]
    decimals = next(d for d in range(decimals + 1)  # no trailing zeros the whole column shares
                    if all(round(v, d) == round(v, decimals) for v in nums))
    scientific = smallest < 1e-6

    def fmt(v):
        if not _is_number(v) or (isinstance(v, float) and not math.isfinite(v)):
            return str(v)
        if v == 0:
            return "0"
        if scientific:
            return f"{v:.3e}"
        return f"{v:.{decimals}f}"
    return fmt
