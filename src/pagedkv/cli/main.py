"""The `pagedkv` command line: one sub-command per module, errors on one line, no traceback.

Bad input (a `PagedKVError` from any layer, or an argument argparse refuses) prints one line on
stderr, `pagedkv CMD: error: ...`, and exits with status 2; Ctrl-C prints one line and exits with
130 wherever it lands (start-up included); a failing read or write of a file (OSError) or running
out of memory prints one line and exits with 1. Parsing imports no torch: each sub-command module
imports what it needs in `run`, so `pagedkv --help` and argument errors take well under a second.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from typing import NoReturn, Optional

from ..errors import PagedKVError

# sub-command name -> module under pagedkv.cli defining `add_parser(subparsers)` and `run(args)`.
COMMANDS = {
    "formats": "formats_cmd",
    "codecs": "codecs_cmd",
    "eval": "eval_cmd",
    "generate": "generate_cmd",
    "plan": "plan_cmd",
    "tune": "tune_cmd",
    "bench": "bench",
}
_NEGATIVE = re.compile(r"^-[0-9.]")


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: `pagedkv eval: error: argument --windows: invalid int value: 'x'`."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="pagedkv",
        description="Paged, compressed KV cache: formats, evaluation, planning, benchmarks.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in COMMANDS.items():
        mod = importlib.import_module(f"pagedkv.cli.{module}")
        p = mod.add_parser(sub)
        p.set_defaults(_run=mod.run)
    return parser


def _value_options(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string (of every sub-command) that takes a value."""
    out: set[str] = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for p in action.choices.values():
                out |= _value_options(p)
        elif action.option_strings and action.nargs != 0:
            out |= set(action.option_strings)
    return out


def _join_negative_values(argv: list[str], options: set[str]) -> list[str]:
    """`--memory -5GiB` -> `--memory=-5GiB`, so that the value reaches the option's own check
    (argparse otherwise takes '-5GiB' for an option and says 'expected one argument')."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] in options and i + 1 < len(argv) and _NEGATIVE.match(argv[i + 1]):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def _import_numpy_before_torch() -> None:
    """torch's C module imports numpy and swallows whatever that import raises, a Ctrl-C included
    (a `pagedkv eval` interrupted while torch loaded ran to its end, exit 0); with numpy imported
    first, where an interrupt raises as usual, torch finds it loaded and that window is gone."""
    try:
        import numpy  # noqa: F401
    except ImportError:
        pass


def main(argv: Optional[list[str]] = None) -> int:
    command = "pagedkv"
    try:
        parser = build_parser()
        argv = list(sys.argv[1:] if argv is None else argv)
        args = parser.parse_args(_join_negative_values(argv, _value_options(parser)))
        command = " ".join(["pagedkv", args.command] + ([args.target] if getattr(args, "target", None) else []))
        _import_numpy_before_torch()
        return int(args._run(args) or 0)
    except PagedKVError as exc:
        print(f"{command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{command}: interrupted", file=sys.stderr)
        return 130
    except MemoryError:
        print(f"{command}: error: out of memory; try smaller sizes", file=sys.stderr)
        return 1
    except OSError as exc:
        if exc.errno == 32:  # EPIPE: the reader of our output went away (`pagedkv ... | head`)
            return 0
        print(f"{command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
