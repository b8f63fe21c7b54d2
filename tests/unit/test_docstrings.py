"""Docstrings and ``help(outbox)`` read whole from an installed package: no docstring points
to a path of the repository (``docs/architecture.md``, ``tests/...``, a README), which a
plain install does not have; they cite the design notes by name, and the package says once
where they ship (``outbox.docs_dir()``)."""

from __future__ import annotations

import ast
import pydoc
import re
from pathlib import Path

import outbox

PACKAGE = Path(outbox.__file__).resolve().parent
REPO = PACKAGE.parent

#: A path into the repository's own folders, a Markdown file other than the documents the
#: package ships (outbox.docs_dir()), or the README.
REPOSITORY_PATH = re.compile(r"(?<![\w.:/-])(?:docs|tests|bench|\.ci)/"
                             r"|\b(?!(?:architecture|dashboard|forwarding|performance|reliability)\.md\b)[\w./-]+\.md\b|\bREADME\b")


def _sources() -> list[Path]:
    # The migrations move to a top-level alembic/ and ship inside the package from there
    # (issue 9): checked where they live.
    files = [p for p in PACKAGE.rglob("*.py") if "migrations" not in p.relative_to(PACKAGE).parts]
    if (REPO / "alembic").is_dir():
        files += (REPO / "alembic").rglob("*.py")
    return sorted(files)


def _docstrings(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in [tree, *ast.walk(tree)]:
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                found.append((getattr(node, "lineno", 1), doc))
    return found


def test_no_docstring_names_a_repository_path():
    sources = _sources()
    assert PACKAGE / "publish.py" in sources and len(sources) > 20
    offenders = [f"{path.relative_to(REPO)}:{line}: {match[0]!r}"
                 for path in sources for line, doc in _docstrings(path)
                 for match in REPOSITORY_PATH.finditer(doc)]
    assert offenders == []


def test_the_pattern_catches_what_it_is_for():
    for bad in ("see docs/architecture.md", "(docs/performance.md, finding 1)", "tests/acceptance/workload.py",
                "the README", "CHANGES.md"):
        assert REPOSITORY_PATH.search(bad), bad
    for fine in ("PostgreSQL docs, \"Transaction Isolation\"", "architecture notes, \"Statements\"", "architecture.md",
                 "outbox.docs_dir()", "https://example.org/x"):
        assert not REPOSITORY_PATH.search(fine), fine


def test_help_outbox_states_the_guarantees_and_where_the_notes_are():
    text = pydoc.render_doc(outbox, renderer=pydoc.plaintext)
    for words in ("Transactional publish", "At-least-once delivery", "Fencing", "Exactly-once effects",
                  "database clock", "docs_dir", "architecture.md"):
        assert words in text, words
    for name in ("architecture.md", "forwarding.md", "performance.md", "reliability.md"):
        assert (outbox.docs_dir() / name).is_file(), name
