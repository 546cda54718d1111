"""What the docs tests read in the project's Markdown: the README's code blocks with the marker
before each (which test runs the block, or why none does), and every relative link with its
#anchor. One parser for both, so the checks and the tests that run a block read the same text."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"

_FENCE = re.compile(r"^```([\w-]*)[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)
# the last non-blank line before a block's opening fence
_MARKER = re.compile(r"^<!-- (?:run in CI by (?P<test>[\w./-]+\.py::\w+)|not run in CI: (?P<reason>\S.*?)) -->$")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_INLINE_CODE = re.compile(r"`[^`\n]*`")


@dataclass(frozen=True)
class CodeBlock:
    """One fenced block: its language tag, text, 1-based line of the opening fence, and its marker:
    the test (`path::function`) that runs it, or the reason it is not run (None: no marker)."""

    lang: str
    text: str
    line: int
    test: Optional[str]
    reason: Optional[str]


def code_blocks(text: str) -> list[CodeBlock]:
    blocks = []
    for m in _FENCE.finditer(text):
        before = [ln.strip() for ln in text[:m.start()].splitlines() if ln.strip()]
        marker = _MARKER.match(before[-1]) if before else None
        blocks.append(CodeBlock(m.group(1), m.group(2), text.count("\n", 0, m.start()) + 1,
                                marker and marker.group("test"), marker and marker.group("reason")))
    return blocks


def readme_block_run_by(test_id: str) -> CodeBlock:
    """The README block whose marker names `test_id` ("tests/test_x.py::test_y"): what that test runs."""
    found = [b for b in code_blocks(README.read_text(encoding="utf-8")) if b.test == test_id]
    if len(found) != 1:
        raise LookupError(f"{len(found)} README code blocks are marked as run by {test_id}, expected 1")
    return found[0]


def shell_commands(block: CodeBlock) -> list[str]:
    """The block's commands: continuation lines joined, blank and comment-only lines dropped."""
    joined = re.sub(r"\\\n\s*", "", block.text)
    return [ln.strip() for ln in joined.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def unmarked_or_unrun(text: str, root: Path = ROOT) -> list[str]:
    """Problems with the code blocks of `text`: a block without a marker, or one whose marker names
    a test that does not exist (file missing or no such function in it)."""
    problems = []
    for b in code_blocks(text):
        if b.test is None and b.reason is None:
            problems.append(f"line {b.line}: code block without a `<!-- run in CI by PATH::TEST -->` "
                            "or `<!-- not run in CI: REASON -->` marker")
        elif b.test is not None:
            path, func = b.test.split("::")
            f = root / path
            if not f.is_file() or not re.search(rf"^def {func}\(", f.read_text(encoding="utf-8"), re.M):
                problems.append(f"line {b.line}: marked as run by {b.test}, which does not exist")
    return problems


def heading_anchors(text: str) -> set[str]:
    """GitHub's anchors for the headings of a Markdown text (code blocks skipped)."""
    anchors, seen = set(), {}
    for m in re.finditer(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", _FENCE.sub("", text), re.M):
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def broken_links(path: Path) -> list[str]:
    """Relative links (and their #anchors) in the Markdown file `path` that do not resolve."""
    text = path.read_text(encoding="utf-8")
    prose = _INLINE_CODE.sub("", _FENCE.sub("", text))
    problems = []
    for target in _LINK.findall(prose):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            problems.append(f"{path.name}: {target}: {file_part} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in heading_anchors(dest.read_text(encoding="utf-8")):
            problems.append(f"{path.name}: {target}: no heading #{anchor} in {dest.name}")
    return problems


def tables(text: str) -> list[list[list[str]]]:
    """The pipe tables of a Markdown text (code blocks skipped): rows of stripped cells, the
    header row first, the |---| row dropped."""
    out, rows = [], []
    for line in _FENCE.sub("", text).splitlines() + [""]:
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not all(re.fullmatch(r":?-+:?", c) for c in cells):
                rows.append(cells)
        elif rows:
            out.append(rows)
            rows = []
    return out
