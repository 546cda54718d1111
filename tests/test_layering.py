"""The package's shape (shared/DESIGN.md): imports point one way, no module imports itself
through others (no circles), and modules and classes stay small.

Order, top to bottom: cli -> bench / eval / tune -> integrations -> cache -> offload -> ops /
options -> spec / formats -> codecs; alloc and codecs import nothing above them. Every import
counts for the order, also one inside a function (a lazy import is still an edge of the graph).
For circles, the imports that run on import count (a lazy one included); one under `if
TYPE_CHECKING:` names a type for annotations only, one under `if __name__ == "__main__":` runs
only as a script: neither can close a circle.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "pagedkv"

# rank of each top-level part of the package: a module may import parts of rank <= its own
RANK = {"errors": 0, "private": 0, "safe_io": 0, "compose": 0, "heap": 0, "defaults": 0, "timing": 0, "codecs": 0, "alloc": 0, "formats": 1, "spec": 1, "ops": 2, "approx": 2, "options": 2, "offload": 3,
        "cache": 4, "integrations": 5, "eval": 6, "bench": 6, "tune": 6, "cli": 7}
MAX_LINES = 400
MAX_CLASS_LINES = 400  # a class spread over mixin files counts all of its bases' lines
# circles allowed: vLLM's backend / impl pair (vLLM's own idiom: the backend class names its impl)
KNOWN_CIRCLES = [{"integrations.vllm.backend", "integrations.vllm.impl"}]
# known back-edges, each to be removed by its owner (listed so no new one slips in):
# the vLLM converter reuses the GGUF -> safetensors writer of eval (belongs below both)
KNOWN_BACK_EDGES: set = set()


def _part(module: str) -> str:
    return module.split(".")[0]


def _modules() -> set:
    return {".".join(p.relative_to(SRC).with_suffix("").parts) for p in SRC.rglob("*.py")}


def _is_main_test(test) -> bool:
    return (isinstance(test, ast.Compare) and getattr(test.left, "id", None) == "__name__"
            and any(getattr(c, "value", None) == "__main__" for c in test.comparators))


def _type_checking_lines(tree) -> set:
    """Line numbers of the statements under `if TYPE_CHECKING:` or `if __name__ == "__main__":`
    (never run on import)."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and (getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING"
                                         or _is_main_test(node.test)):
            for sub in node.body:
                lines.update(range(sub.lineno, (sub.end_lineno or sub.lineno) + 1))
    return lines


def _runtime_graph() -> dict:
    """module -> the modules its executed imports load (`from . import x` loads module x; `from
    .pkg import name` loads pkg.name when that is a module, else pkg's __init__)."""
    mods = _modules()

    def resolve(name: str):
        return name if name in mods else f"{name}.__init__" if f"{name}.__init__" in mods else None

    graph: dict = {m: set() for m in mods}
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).with_suffix("")
        src = ".".join(rel.parts)
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_checking_lines(tree)
        package = list(rel.parts[:-1])
        for node in ast.walk(tree):
            if node.lineno in skip if hasattr(node, "lineno") else False:
                continue
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package[:len(package) - (node.level - 1)]
                elif node.module and node.module.startswith("pagedkv."):
                    base = []
                else:
                    continue
                mod = base + (node.module.split(".")[node.level == 0:] if node.module else [])
                for a in node.names:
                    target = resolve(".".join(mod + [a.name])) or resolve(".".join(mod))
                    if target and target != src:
                        graph[src].add(target)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("pagedkv.") and (t := resolve(a.name[len("pagedkv."):])):
                        graph[src].add(t)
    return graph


def _circles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(comp)
    return out


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


def test_no_import_circles():
    circles = [sorted(c) for c in _circles(_runtime_graph()) if c not in KNOWN_CIRCLES]
    assert not circles, "import circles (each module reaches the others and itself):\n" + "\n".join(map(str, circles))


def test_the_circle_finder_finds_one():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(graph) == [{"a", "b", "c"}]
    assert _circles({"a": {"b"}, "b": set()}) == []


def _class_lines() -> dict:
    """Class name -> lines of its body plus those of every base class defined in the package
    (a class split into mixins across files is measured whole). Names are module.Class."""
    classes, bases = {}, {}
    short: dict = {}
    for path in sorted(SRC.rglob("*.py")):
        mod = ".".join(path.relative_to(SRC).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                key = f"{mod}.{node.name}"
                classes[key] = node.end_lineno - node.lineno + 1
                bases[key] = [getattr(b, "id", getattr(b, "attr", None)) for b in node.bases]
                short.setdefault(node.name, []).append(key)

    def total(key, seen):
        n = classes[key]
        for b in bases[key]:
            for base in short.get(b, []):  # a base of that name in the package (mixins are unique names)
                if base not in seen:
                    seen.add(base)
                    n += total(base, seen)
        return n

    return {k: total(k, {k}) for k in classes}


# classes over the budget today, each to be split into objects it calls by its owner (issue 30.2)
KNOWN_BIG_CLASSES = {"offload.disk.DiskTier"}
# classes whose methods are spread over mixins today, each to hold objects it calls instead
KNOWN_MIXED_CLASSES: set = set()


def test_classes_are_small():
    sizes = _class_lines()
    big = {k: n for k, n in sizes.items() if n > MAX_CLASS_LINES and k not in KNOWN_BIG_CLASSES}
    assert not big, f"classes over {MAX_CLASS_LINES} lines with their mixins: {big}"


def _is_interface(fn) -> bool:
    """A method with no code: a docstring, `pass`, `...` or `raise NotImplementedError`."""
    body = [b for b in fn.body if not (isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant))]
    return all(isinstance(b, ast.Pass) or (isinstance(b, ast.Raise) and "NotImplementedError" in ast.unparse(b))
               for b in body)


def _mixins() -> dict:
    """module.Class -> the in-package bases it is assembled from that are mixins: a class defined
    in another module, with methods that carry code but no `__init__` of its own (nor a
    dataclass's), and never
    instantiated in the package (it exists only to lend methods, reading state a subclass owns:
    the trail a reader follows from `Class(...)` is lost in another file)."""
    defs, calls = {}, set()
    for path in sorted(SRC.rglob("*.py")):
        mod = ".".join(path.relative_to(SRC).with_suffix("").parts)
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                methods = [f for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
                defs.setdefault(node.name, []).append(dict(
                    mod=mod, bases=[getattr(b, "id", getattr(b, "attr", None)) for b in node.bases],
                    code=any(not _is_interface(f) for f in methods),
                    init=any(f.name == "__init__" for f in methods)  # a dataclass has one too
                    or any("dataclass" in ast.unparse(d) for d in node.decorator_list)))
            elif isinstance(node, ast.Call):
                calls.add(getattr(node.func, "id", getattr(node.func, "attr", None)))
    out = {}
    for name, entries in defs.items():
        for d in entries:
            mixed = [b for b in d["bases"] for base in defs.get(b, [])
                     if base["mod"] != d["mod"] and base["code"] and not base["init"] and b not in calls]
            if mixed:
                out[f"{d['mod']}.{name}"] = mixed
    return out


def test_classes_are_objects_not_mixins():
    mixed = {k: v for k, v in _mixins().items() if k not in KNOWN_MIXED_CLASSES}
    assert not mixed, f"classes assembled from mixins in other files (hold them as objects instead): {mixed}"


def test_the_mixin_finder_finds_one(tmp_path, monkeypatch):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "parts.py").write_text("class Storage:\n    def grow(self):\n        self.n += 1\n\n"
                                  "class Api:\n    def get(self):\n        raise NotImplementedError\n")
    (pkg / "whole.py").write_text("from .parts import Api, Storage\n\n"
                                  "class Whole(Storage, Api):\n    def __init__(self):\n        self.n = 0\n")
    monkeypatch.setattr(sys.modules[__name__], "SRC", pkg)
    assert _mixins() == {"whole.Whole": ["Storage"]}  # Api is an interface: no code
    (pkg / "user.py").write_text("from .parts import Storage\n\ns = Storage()\n")
    assert _mixins() == {}  # a class instantiated on its own is an object, not a mixin
