"""The package's shape (shared/DESIGN.md): imports point one way, and modules stay small.

Order, top to bottom: cli -> bench / eval -> integrations -> cache -> offload -> ops ->
formats / codecs; alloc and codecs import nothing above them. Every import counts, also one
inside a function (a lazy import is still an edge of the graph).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "pagedkv"

# rank of each top-level part of the package: a module may import parts of rank <= its own
RANK = {"errors": 0, "private": 0, "safe_io": 0, "heap": 0, "defaults": 0, "timing": 0, "codecs": 0, "alloc": 0, "formats": 1, "spec": 1, "ops": 2, "approx": 2, "options": 2, "offload": 3,
        "cache": 4, "integrations": 5, "eval": 6, "bench": 6, "tune": 6, "cli": 7}
MAX_LINES = 400
# known back-edges, each to be removed by its owner (listed so no new one slips in):
# the vLLM converter reuses the GGUF -> safetensors writer of eval (belongs below both)
KNOWN_BACK_EDGES: set = set()


def _part(module: str) -> str:
    return module.split(".")[0]


def _edges():
    """(module path relative to pagedkv/, imported module relative to pagedkv, line)."""
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).with_suffix("")
        package = list(rel.parts[:-1])
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package[:len(package) - (node.level - 1)]
                    parts = base + (node.module.split(".") if node.module else [])
                    targets = [".".join(parts)] if parts else [a.name for a in node.names]
                elif node.module and node.module.startswith("pagedkv."):
                    targets = [node.module[len("pagedkv."):]]
                else:
                    continue
            elif isinstance(node, ast.Import):
                targets = [a.name[len("pagedkv."):] for a in node.names
                           if a.name.startswith("pagedkv.")]
            else:
                continue
            for t in targets:
                yield rel, t, node.lineno


def test_imports_point_one_way():
    bad = []
    for rel, target, line in _edges():
        src, dst = rel.parts[0], _part(target)
        if src not in RANK or dst not in RANK:
            continue
        if src != dst and RANK[dst] > RANK[src] and (str(rel) + ".py", target) not in KNOWN_BACK_EDGES:
            bad.append(f"{rel}.py:{line} imports {target} ({src} may not import {dst})")
    assert not bad, "\n".join(bad)


def test_offload_never_sees_the_cache_or_the_model():
    bad = [f"{rel}.py:{line} imports {target}" for rel, target, line in _edges()
           if rel.parts[0] == "offload" and _part(target) in ("cache", "integrations", "eval", "bench")]
    assert not bad, "\n".join(bad)


def test_modules_are_small():
    big = {str(p.relative_to(SRC)): n for p in SRC.rglob("*.py")
           if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not big, f"modules over {MAX_LINES} lines: {big}"
