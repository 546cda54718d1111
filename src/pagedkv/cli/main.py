"""The `pagedkv` command line: one sub-command per module, errors on one line, no traceback."""

from __future__ import annotations

import argparse
import importlib
import sys

from ..errors import PagedKVError

# sub-command name -> module under pagedkv.cli defining `add_parser(subparsers)` and `run(args)`.
COMMANDS = {
    "formats": "formats_cmd",
    "codecs": "codecs_cmd",
    "eval": "eval_cmd",
    "generate": "generate_cmd",
    "plan": "plan_cmd",
    "bench": "bench",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedkv",
        description="Paged, compressed KV cache: formats, evaluation, planning, benchmarks.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module in COMMANDS.items():
        mod = importlib.import_module(f"pagedkv.cli.{module}")
        p = mod.add_parser(sub)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except PagedKVError as exc:
        print(f"pagedkv {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"pagedkv {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
