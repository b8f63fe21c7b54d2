"""The documents' structure, checked without a database: docs/configuration.md matches
OutboxSettings (the generated table is not stale)."""

from __future__ import annotations

from pathlib import Path

import pytest

from outbox.ops import configdoc

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
