"""The README, CONTRIBUTING.md and docs/*.md read as the tests of the documents need them:
their fenced code blocks (language, text, line, the marker written just above), their
links and their headings' anchors.

A block's marker is an HTML comment on the line right above its opening fence; it says how
tests/integration/test_docs_examples.py treats the block:

- no marker: the block runs (python: executed; bash: each command run; sql: executed;
  json: parsed; text: a diagram or an output, not run);
- ``<!-- file: myapp/jobs.py -->``: a python block that is a module of the examples'
  application, written to that path before any block runs;
- ``<!-- pytest: ... -->``: a python block defining ``test_*`` functions, which are called
  (an ``outbox_engine`` argument gets the page's database);
- ``<!-- fragment-of: WHAT; WHY -->``: part of a larger program that cannot run alone
  (python: compiled only);
- ``<!-- not-run: WHY -->``: not run, for the reason given;
- ``<!-- tested-by: tests/path.py::test_name -->``: run by that test;
- ``<!-- output-of: COMMAND -->``: the output of an ``outbox-relay`` command, compared with
  what the command prints now.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

#: Marker kinds a block may carry.
MARKERS = ("file", "pytest", "fragment-of", "not-run", "tested-by", "output-of")
#: Languages a block may be written in.
LANGUAGES = ("python", "bash", "sql", "json", "text")

FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
MARKER = re.compile(r"^\s*<!--\s*([a-z-]+):\s*(.*?)\s*-->\s*$")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*$")


@dataclass(frozen=True)
class Block:
    """One fenced code block of a page."""

    page: Path
    line: int  # of the opening fence, from 1
    language: str
    text: str  # without the fences, dedented by the fence's indentation
    marker: str | None  # the marker's kind, or None
    argument: str  # what follows the marker's colon

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def pages() -> list[Path]:
    """The README, CONTRIBUTING.md, then every page of docs/ by name."""
    return [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted(DOCS.glob("*.md"))]


def blocks(page: Path) -> list[Block]:
    """The fenced code blocks of ``page``, in order."""
    lines = page.read_text(encoding="utf-8").splitlines()
    found, index = [], 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if not opening:
            index += 1
            continue
        indent, language = opening.group(1), opening.group(2)
        end = index + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        body = [line[len(indent):] if line.startswith(indent) else line.lstrip() for line in lines[index + 1:end]]
        above = lines[index - 1] if index > 0 else ""
        marker = MARKER.match(above)
        found.append(Block(page, index + 1, language, "\n".join(body) + "\n",
                           marker.group(1) if marker else None, marker.group(2) if marker else ""))
        index = end + 1
    return found


def outside_code(page: Path, *, inline: bool = True) -> str:
    """The text of ``page`` with its code blocks taken out, and its inline code too unless
    ``inline`` is false."""
    kept, inside = [], False
    for line in page.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line) or (inside and line.strip() == "```"):
            inside = not inside
            continue
        if not inside:
            kept.append(re.sub(r"`[^`]*`", "", line) if inline else line)
    return "\n".join(kept)


def links(page: Path) -> list[str]:
    """The targets of the Markdown links and images of ``page``, outside code."""
    return LINK.findall(outside_code(page))


def slug(title: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but ``-`` and ``_`` dropped,
    spaces as ``-``."""
    text = re.sub(r"[`*]", "", title).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of ``page``'s headings (outside code), GitHub's way (a repeated one gets
    ``-1``, ``-2``...)."""
    seen: dict[str, int] = {}
    for line in outside_code(page, inline=False).splitlines():
        heading = HEADING.match(line)
        if heading:
            base = slug(heading.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
    found = set()
    for base, count in seen.items():
        found.add(base)
        found.update(f"{base}-{n}" for n in range(1, count))
    return found
