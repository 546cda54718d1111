"""`pagedkv formats`: every codec and KV format with bits/element and block bytes."""

from __future__ import annotations

import argparse

from ..defaults import BLOCK_SIZE
from ..errors import ConfigError
from .output import print_json, print_table


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("formats", help="list codecs and KV formats with their sizes")
    p.add_argument("names", nargs="*", metavar="NAME", help="only these codecs / formats (aliases ok)")
    p.add_argument("--block-size", type=int, default=BLOCK_SIZE, help=f"default {BLOCK_SIZE}")
    p.add_argument("--kv-heads", type=int, default=3, help="default: the embedded model's 3")
    p.add_argument("--head-dim", type=int, default=64, help="default: the embedded model's 64")
    p.add_argument("--json", action="store_true")
    return p


def _codec_row(c, bs, h, d) -> dict:
    return {
        "name": c.name,
        "bits_per_element": c.bits_per_element,
        "code_bits": c.code_bits,
        "group_size": c.group_size,
        "scale_type": c.scale_type.value,
        "rotated": c.rotated,
        "values": c.values.value,
        "block_bytes": c.block_bytes(bs, h, d),
        "description": c.description,
    }


def _format_row(f, bs, h, d) -> dict:
    return {
        "name": f.name,
        "k_codec": f.k.name,
        "v_codec": f.v.name,
        "bits_per_element": f.bits_per_element,
        "k_block_bytes": f.k_block_bytes(bs, h, d),
        "v_block_bytes": f.v_block_bytes(bs, h, d),
    }


def run(args) -> int:
    from ..codecs.catalogue import CODECS, get_codec
    from ..formats import all_formats, parse_format

    bs, h, d = args.block_size, args.kv_heads, args.head_dim
    for label, value in (("--block-size", bs), ("--kv-heads", h), ("--head-dim", d)):
        if value <= 0:
            raise ConfigError(f"{label} must be a positive integer, got {value}")
    if args.names:
        formats = [parse_format(n) for n in args.names]
        codecs = [get_codec(n) for n in args.names if n.strip().lower() in CODECS]
    else:
        formats = list(all_formats())
        codecs = list(CODECS.values())
    for f in formats:
        f.check_head_dim(d)
    out = {
        "block_size": bs,
        "kv_heads": h,
        "head_dim": d,
        "codecs": [_codec_row(c, bs, h, d) for c in codecs],
        "formats": [_format_row(f, bs, h, d) for f in formats],
    }
    if args.json:
        print_json(out)
        return 0
    dims = f"block_size {bs}, {h} kv heads, head_dim {d}"
    if codecs:
        print_table(
            f"Codecs ({dims})",
            ["name", "bits/elem", "group", "scale", "rotated", "block bytes", "description"],
            [[r["name"], r["bits_per_element"], r["group_size"] or "-", r["scale_type"],
              "yes" if r["rotated"] else "no", r["block_bytes"], r["description"]] for r in out["codecs"]],
        )
    print_table(
        f"KV formats ({dims}; bytes of one K block and one V block of one layer)",
        ["name", "K codec", "V codec", "bits/elem", "K block bytes", "V block bytes"],
        [[r["name"], r["k_codec"], r["v_codec"], r["bits_per_element"], r["k_block_bytes"],
          r["v_block_bytes"]] for r in out["formats"]],
    )
    return 0
