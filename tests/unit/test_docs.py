"""The documents' structure, checked without a database: the README's size and table of
contents, every page of docs/ leading with an example, every relative link resolving, every
code block in a known language with a known marker (tests/docs_pages.py), and
docs/configuration.md matching OutboxSettings (the generated table is not stale)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from outbox.ops import configdoc
from tests import docs_pages

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def test_configuration_page_is_current():
    try:
        configdoc.check(DOCS / "configuration.md")
    except configdoc.StaleError as exc:
        pytest.fail(f"{exc}")


def test_configuration_page_lists_every_setting_with_its_environment_name():
    page = (DOCS / "configuration.md").read_text(encoding="utf-8")
    for row in configdoc.rows():
        assert f"| `{row.field}` | `{row.env}` |" in page
    assert "| `schema_name` | `OUTBOX_SCHEMA` |" in page


def test_a_stale_page_is_named_with_the_command_that_fixes_it(tmp_path):
    page = tmp_path / "configuration.md"
    page.write_text(f"# Configuration\n\n{configdoc.BEGIN}\n| old | table |\n{configdoc.END}\n", encoding="utf-8")
    with pytest.raises(configdoc.StaleError, match="python -m outbox.ops.configdoc --write docs/configuration.md"):
        configdoc.check(page)
    assert configdoc.main(["--check", str(page)]) == 1
    assert configdoc.main(["--write", str(page)]) == 0
    configdoc.check(page)
    assert page.read_text(encoding="utf-8").startswith("# Configuration\n\n" + configdoc.BEGIN + "\n")


def test_a_page_without_markers_is_refused(tmp_path):
    page = tmp_path / "configuration.md"
    page.write_text("# Configuration\n", encoding="utf-8")
    with pytest.raises(configdoc.StaleError, match="needs one line"):
        configdoc.check(page)


def test_cells_stay_on_one_line_and_escape_pipes():
    assert configdoc.cell("a | b\n c") == "a \\| b c"
    assert configdoc.type_text(int | None) == "int or none"
    assert [configdoc.default_text(v) for v in (None, True, 86_400.0, 0.005, "", "INFO")] == [
        "none", "true", "86400", "0.005", "empty", "`INFO`"]


# The documents' shape (issue 27 item 6): a short README with a table of contents, one page
# per topic in docs/, each leading with an example, every link resolving.

README = ROOT / "README.md"
#: The README's size bound, bytes: a pitch, a table of contents, one example and links.
README_LIMIT = 15 * 1024


def test_readme_is_short():
    size = len(README.read_bytes())
    assert size <= README_LIMIT, f"README.md is {size} bytes, over {README_LIMIT}: move reference text to docs/"


def test_readme_keeps_the_two_command_quick_start_and_the_test_command():
    commands = [line.split("#")[0].strip() for block in docs_pages.blocks(README) if block.language == "bash"
                for line in block.text.splitlines()]
    assert "python3 -m venv .venv && . .venv/bin/activate && pip install -e '.[dev]' && outbox-relay demo" in commands
    assert "pytest" in commands  # .ci/run runs "the README's test command"


def test_readme_table_of_contents_links_resolve():
    text = README.read_text(encoding="utf-8")
    contents = text[text.index("\n## Contents\n"):]
    contents = contents[:contents.index("\n## ", 1)]
    targets = docs_pages.LINK.findall(contents)
    assert len(targets) >= 6
    for target in targets:
        assert target.startswith("#") and target[1:] in docs_pages.anchors(README), target


@pytest.mark.parametrize("page", docs_pages.pages(), ids=lambda p: p.name)
def test_relative_links_resolve(page):
    broken = []
    for target in docs_pages.links(page):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked here
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in docs_pages.anchors(resolved):
            broken.append(f"{target}: no heading with that anchor")
    assert broken == [], f"{page.name}: {broken}"


@pytest.mark.parametrize("page", [p for p in docs_pages.pages() if p.parent == DOCS], ids=lambda p: p.name)
def test_every_page_leads_with_an_example(page):
    """A code block (not a diagram) comes before the page's first section."""
    text = page.read_text(encoding="utf-8")
    first_section = text.find("\n## ")
    first = next((b for b in docs_pages.blocks(page) if b.language != "text"), None)
    assert first is not None, f"{page.name} has no example"
    assert first_section < 0 or text.count("\n", 0, first_section) + 1 > first.line, (
        f"{page.name}: its first example is at line {first.line}, after its first section")


@pytest.mark.parametrize("page", docs_pages.pages(), ids=lambda p: p.name)
def test_every_block_has_a_known_language_and_marker(page):
    for block in docs_pages.blocks(page):
        assert block.language in docs_pages.LANGUAGES, f"{block}: language {block.language!r}"
        assert block.marker in (None, *docs_pages.MARKERS), f"{block}: marker {block.marker!r}"
        if block.marker is not None:
            assert block.argument, f"{block}: a {block.marker} marker says what or why"
        if block.marker == "file":
            assert block.language == "python" and re.fullmatch(r"myapp/\w+\.py", block.argument), block
        if block.marker == "tested-by":
            path, _, name = block.argument.partition("::")
            assert (ROOT / path).exists() and f"def {name}(" in (ROOT / path).read_text(encoding="utf-8"), block


@pytest.mark.parametrize("page", docs_pages.pages(), ids=lambda p: p.name)
def test_python_blocks_compile(page):
    for block in docs_pages.blocks(page):
        if block.language == "python":
            compile(block.text, str(block), "exec")


def test_every_topic_has_its_page():
    for name in ("publishing", "consumers", "ordering", "flow-control", "forwarding", "schedules", "operations",
                 "configuration", "schemas-and-roles", "poolers", "testing", "guarantees", "reliability",
                 "performance", "performance-history", "architecture", "dashboard", "intake", "webhooks",
                 "workflows", "coalescing"):
        assert (DOCS / f"{name}.md").exists(), name
        assert f"docs/{name}.md" in README.read_text(encoding="utf-8") or name == "performance-history", name
