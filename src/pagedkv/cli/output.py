"""Printing results: a rich table for people, JSON for programs."""

from __future__ import annotations

import json
import sys
from typing import Any, Sequence

from rich.console import Console
from rich.table import Table


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2)
    sys.stdout.write("\n")


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    table = Table(title=title, title_justify="left")
    for col in columns:
        table.add_column(col, justify="left" if col in ("name", "format", "codec") else "right")
    for row in rows:
        table.add_row(*[_fmt(v) for v in row])
    Console(width=max(120, Console().width)).print(table)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if v == 0:
            return "0"
        if abs(v) < 1e-2 or abs(v) >= 1e5:
            return f"{v:.3e}"
        return f"{v:.4g}"
    return str(v)
