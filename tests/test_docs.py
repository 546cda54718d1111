"""The README and the manual in docs/ stay usable: every relative link and #anchor resolves, and
every code block of the README is either run by a named test (which reads the block from the
README, see helpers/markdown.py) or marked as not run in CI with the reason."""

from __future__ import annotations

import pytest

from helpers.markdown import README, ROOT, broken_links, tables, unmarked_or_unrun

DOCS = sorted([README, ROOT / "benchmarks" / "README.md", *(ROOT / "docs").glob("*.md")])


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    assert broken_links(path) == []


def test_every_readme_code_block_is_run_by_a_test_or_marked():
    assert unmarked_or_unrun(README.read_text(encoding="utf-8")) == []


def test_the_checks_catch_a_broken_link_and_an_unmarked_block(tmp_path):
    # the checks above must be able to fail: a missing file, a missing anchor, an unmarked block
    # and a block marked as run by a test that does not exist are each reported
    (tmp_path / "other.md").write_text("# A heading\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#a-heading) [gone](missing.md) [bad anchor](other.md#nope) "
                    "[self](#title) `[code](not-a-link.md)`\n\n# Title\n", encoding="utf-8")
    assert broken_links(page) == ["page.md: missing.md: missing.md does not exist",
                                  "page.md: other.md#nope: no heading #nope in other.md"]
    text = ("<!-- not run in CI: needs a GPU -->\n```sh\nrun-on-gpu\n```\n\n```sh\nunmarked\n```\n\n"
            "<!-- run in CI by tests/test_docs.py::test_no_such_test -->\n```sh\nx\n```\n")
    assert unmarked_or_unrun(text) == [
        "line 6: code block without a `<!-- run in CI by PATH::TEST -->` or `<!-- not run in CI: REASON -->` marker",
        "line 11: marked as run by tests/test_docs.py::test_no_such_test, which does not exist"]


def _table_with(text, *headers):
    """The one table of `text` whose header row holds `headers`, as {first cell: {header: cell}}."""
    (found,) = [t for t in tables(text) if set(headers) <= set(t[0])]
    return {row[0].strip("`*"): dict(zip(found[0], (c.strip("*") for c in row))) for row in found[1:]}


def test_readme_headline_numbers_are_the_manuals_measured_ones():
    # the README's headline table quotes one measured run; docs/quality.md holds that run's table
    # with its stamp: every number the README shows must be the manual's, so neither drifts alone
    headline = _table_with(README.read_text(encoding="utf-8"), "KV cache", "tokens in 8 GiB")
    measured = _table_with((ROOT / "docs" / "quality.md").read_text(encoding="utf-8"), "format", "max ctx @ 8 GiB")
    assert len(headline) >= 5
    for fmt, row in headline.items():
        assert fmt in measured, f"README headline row {fmt} is not in docs/quality.md's default-list table"
        m = measured[fmt]
        assert (row["bits/elem"], row["KL vs bf16"], row["PPL"]) == (m["bits/elem"], m["KL vs bf16"], m["PPL"]), fmt
        assert row["tokens in 8 GiB"] == m["max ctx @ 8 GiB"], fmt
