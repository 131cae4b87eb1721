"""The user documentation stays navigable: README.md is a short landing page that starts with the two set-up
commands, and every relative link in it and in docs/*.md resolves to a file (and, where it names one, a
heading) of this checkout.

Links are checked as GitHub renders them: inline ``[text](target)`` and reference ``[label]: target``
links outside fenced code blocks and code spans; a ``#fragment`` must be the anchor of a heading of the
target Markdown file (GitHub's rule: rendered text lowercased, punctuation dropped, spaces to hyphens,
``-1``, ``-2`` for repeats). Absolute URLs (``https:``, ``mailto:``, ...) are not fetched.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 250
# .ci/run and the e2e tests rely on these two set-up commands being README's first code block, in this order.
SETUP_COMMANDS = ("make serve", "make test")

_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
_INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^()\s<>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?([^\s>]+)>?(?:\s+.*)?$")
_HEADING = re.compile(r"^\s{0,3}#{1,6}\s+(.*?)(?:\s+#+)?\s*$")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def _documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _prose_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of the lines outside fenced code blocks."""
    lines, fenced = [], False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append((number, line))
    return lines


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: its rendered text, lowercased, punctuation dropped, spaces to '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link renders as its text
    text = re.sub(r"<[^>]+>", "", text.replace("`", "").replace("*", "")).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@cache
def _anchors(path: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    for _, line in _prose_lines(path):
        match = _HEADING.match(line)
        if match:
            slug = _slug(match.group(1))
            seen[slug] = seen.get(slug, 0) + 1
            if seen[slug] > 1:
                seen[f"{slug}-{seen[slug] - 1}"] = 1
    return frozenset(seen)


def _links(path: Path) -> list[tuple[int, str]]:
    found = []
    for number, line in _prose_lines(path):
        line = _CODE_SPAN.sub("", line)  # `[x](y)` in a code span is text, not a link
        found += [(number, target) for target in _INLINE_LINK.findall(line)]
        match = _REFERENCE_LINK.match(line)
        if match:
            found.append((number, match.group(1)))
    return found


def _broken(path: Path) -> list[str]:
    problems = []
    for number, target in _links(path):
        if _SCHEME.match(target) or target.startswith("//"):
            continue  # an absolute URL
        file_part, _, fragment = target.partition("#")
        dest = (path.parent / unquote(file_part)).resolve() if file_part else path
        where = f"{path.relative_to(ROOT)}:{number}: {target}"
        if not dest.exists():
            problems.append(f"{where}: no such file")
        elif fragment and dest.suffix == ".md" and unquote(fragment).lower() not in _anchors(dest):
            problems.append(f"{where}: no heading with anchor #{fragment} in {dest.relative_to(ROOT)}")
    return problems


@pytest.mark.parametrize("path", _documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    assert path.is_file()
    assert not _broken(path), "broken links:\n" + "\n".join(_broken(path))


def test_readme_is_a_landing_page():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"
    start = next(i for i, line in enumerate(lines) if _FENCE.match(line))
    end = next(i for i in range(start + 1, len(lines)) if _FENCE.match(lines[i]))
    commands = [line.split("#")[0].strip() for line in lines[start + 1:end]]
    assert tuple(commands) == SETUP_COMMANDS, f"README's first code block is {commands}"


def test_checker_catches_broken_links(tmp_path, monkeypatch):
    """The checker itself: a missing file, a missing heading, and links it must leave alone."""
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n## Retries `grpc` and (HTTP)\n\n## Retries `grpc` and (HTTP)\n")
    doc = tmp_path / "docs" / "b.md"
    doc.write_text(
        "[ok](a.md) [ok](a.md#a-page) [ok](a.md#retries-grpc-and-http-1) [ok](#top) [web](https://x.invalid/y)\n"
        "`[code](nowhere.md)`\n```\n[fenced](nowhere.md)\n# not a heading\n```\n# Top\n"
        "[bad](missing.md) [bad](a.md#no-such-heading)\n[ref]: ../nope/\n")
    problems = _broken(doc)
    assert len(problems) == 3, problems
    assert "missing.md: no such file" in problems[0]
    assert "#no-such-heading" in problems[1]
    assert "../nope/" in problems[2]
