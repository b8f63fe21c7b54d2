"""Schema qualification of outbox's statements (``queries.in_schema``), schema names and the
per-schema names derived from them; no database needed."""

from __future__ import annotations

import re

import pytest
import sqlalchemy as sa

from outbox.db import queries, tables
from outbox.errors import ConfigurationError
from outbox.settings import OutboxSettings, check_schema_name, default_schema

SCHEMA = "tenant_a"
#: An outbox relation's name wherever it stands as a whole word (inside quotes too).
ANY_REFERENCE = re.compile(r"(?<![\w$])(" + "|".join(sorted(tables.relation_names(), key=len, reverse=True))
                           + r")(?![\w$])")


def test_relation_names_come_from_the_metadata():
    names = tables.relation_names()
    assert set(tables.metadata.tables) <= names
    assert {"outbox_events", "outbox_jobs", "outbox_subscriptions", "outbox_relays", "outbox_fence_seq",
            "outbox_alembic_version", "outbox_notify"} <= names


@pytest.mark.parametrize("name", sorted(queries.statements()))
def test_every_relation_is_qualified_and_nothing_else_changes(name):
    """Each statement in the schema names every outbox relation as ``tenant_a.<name>`` (in
    string literals too: ``nextval('tenant_a.outbox_fence_seq')``), and removing those
    qualifiers gives back the statement exactly as written."""
    original = queries.statements()[name]
    qualified = getattr(queries.in_schema(SCHEMA), name)
    assert f"{SCHEMA}." not in original.text
    assert qualified.text.replace(f"{SCHEMA}.", "") == original.text
    for match in ANY_REFERENCE.finditer(qualified.text):
        before = qualified.text[:match.start()]
        assert before.endswith(f"{SCHEMA}."), f"{name}: unqualified {match.group(1)} at {match.start()}"
    references = len(ANY_REFERENCE.findall(original.text))
    assert qualified.text.count(f"{SCHEMA}.") == references
    assert qualified.compile().params == original.compile().params
    if not references:
        assert qualified is original  # a statement naming no outbox relation is shared by every schema


def test_literals_and_lookalikes():
    s = queries.in_schema(SCHEMA)
    assert "nextval('tenant_a.outbox_fence_seq')" in s.job_claim_many.text
    assert "CAST('tenant_a.outbox_jobs' AS regclass)" in s.job_table_reltuples.text
    assert s.schema_revision.text == "SELECT version_num FROM tenant_a.outbox_alembic_version"
    assert s.job_tables_vacuum.text == "VACUUM (SKIP_LOCKED) tenant_a.outbox_jobs, tenant_a.outbox_events"
    text = 'ix_outbox_jobs_ready j.outbox_jobs outbox_jobs_x xoutbox_jobs "outbox_jobs" outbox_jobs'
    assert queries.relation_pattern().sub(r"s.\1", text) == (
        'ix_outbox_jobs_ready j.outbox_jobs outbox_jobs_x xoutbox_jobs "outbox_jobs" s.outbox_jobs')
    assert s.schema_create.text == "CREATE SCHEMA IF NOT EXISTS tenant_a"


def test_statements_are_made_once_per_schema():
    """The same objects every time, so compiled-statement caches keyed on them keep working."""
    a = queries.in_schema(SCHEMA)
    assert queries.in_schema(SCHEMA) is a
    assert a.job_claim_many is queries.in_schema(SCHEMA).job_claim_many
    assert queries.in_schema("tenant_b").job_claim_many is not a.job_claim_many
    assert "public.outbox_jobs" in queries.in_schema("public").job_claim_many.text
    assert isinstance(a.event_insert, sa.TextClause) and a.schema == SCHEMA
    with pytest.raises(AttributeError):
        a.no_such_statement  # noqa: B018


def test_statements_defined_later_are_covered(monkeypatch):
    """A statement added to queries.py after the schema machinery is qualified too."""
    monkeypatch.setattr(queries, "thing_count", sa.text("SELECT count(*) FROM outbox_jobs"), raising=False)
    assert queries.Statements("tenant_c").thing_count.text == "SELECT count(*) FROM tenant_c.outbox_jobs"


def test_default_schema_is_read_from_the_environment_on_first_use(monkeypatch):
    monkeypatch.setenv("OUTBOX_SCHEMA", "tenant_env")
    default_schema.cache_clear()
    try:
        assert default_schema() == "tenant_env"
        assert queries.in_schema().schema == "tenant_env"
        monkeypatch.setenv("OUTBOX_SCHEMA", "other")
        assert queries.in_schema(None).schema == "tenant_env"  # read once
        assert queries.in_schema("other").schema == "other"  # explicit wins
        monkeypatch.setenv("OUTBOX_SCHEMA", "Not-Valid")
        default_schema.cache_clear()
        with pytest.raises(ConfigurationError, match="Not-Valid"):
            queries.in_schema()
        monkeypatch.delenv("OUTBOX_SCHEMA")
        default_schema.cache_clear()
        assert default_schema() == "public"
    finally:
        default_schema.cache_clear()


@pytest.mark.parametrize("name", ["public", "tenant_a", "_x", "a1", "a" * 49])
def test_valid_schema_names(name):
    assert check_schema_name(name) == name
    assert OutboxSettings(_env_file=None, schema_name=name).schema_name == name


@pytest.mark.parametrize("name", ["", "A", "1a", "a-b", "a.b", 'a"b', "a b", "a" * 50, "order", "user", "select",
                                  "pg_x", "pg_catalog", "information_schema", None, 3])
def test_invalid_schema_names(name):
    with pytest.raises(ConfigurationError, match="schema name"):
        check_schema_name(name)
    if name is not None:  # None: the process default
        with pytest.raises(ConfigurationError):
            queries.in_schema(name)


def test_settings_read_outbox_schema(monkeypatch):
    monkeypatch.setenv("OUTBOX_SCHEMA", "from_env")
    assert OutboxSettings(_env_file=None).schema_name == "from_env"
    assert OutboxSettings(_env_file=None, schema_name="given").schema_name == "given"
    monkeypatch.setenv("OUTBOX_SCHEMA", "Bad")
    with pytest.raises(ValueError, match="schema name 'Bad' is not valid"):
        OutboxSettings(_env_file=None)


def test_channels_and_lock_keys_per_schema():
    assert tables.notify_channel(tables.EVENTS_CHANNEL, "public") == "outbox_events"
    assert tables.notify_channel(tables.JOBS_CHANNEL, "tenant_a") == "tenant_a.outbox_jobs"
    longest = tables.notify_channel(tables.EVENTS_CHANNEL, "a" * 49)
    assert len(longest.encode()) == 63  # PostgreSQL's limit on a channel name
    assert queries.schema_migrate_lock_key("public") == queries.SCHEMA_MIGRATE_LOCK_KEY
    keys = {queries.schema_migrate_lock_key(s) for s in ("public", "a", "b", "tenant_a")}
    assert len(keys) == 4 and all(-2**63 <= k < 2**63 for k in keys)


def test_runtime_code_runs_no_unqualified_statement():
    """Every statement that names an outbox relation is taken from ``queries.in_schema(...)``
    in the package, never as the unqualified module constant (which would follow the
    connection's search_path instead of the configured schema)."""
    from pathlib import Path

    import outbox

    qualified = {name for name, s in queries.statements().items() if ANY_REFERENCE.search(s.text)}
    use = re.compile(r"\bqueries\.(\w+)\b(?!\()")
    offenders = []
    for path in Path(outbox.__file__).parent.rglob("*.py"):
        if path.name == "queries.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            offenders += [f"{path.name}:{number}: queries.{m}" for m in use.findall(code) if m in qualified
                          and "``" not in code and ":data:" not in code]
    assert offenders == []
