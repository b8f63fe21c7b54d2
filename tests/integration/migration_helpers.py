"""Helpers for the migration tests: the schema as PostgreSQL describes it (:func:`snapshot`),
alembic's diff between the database and ``outbox.db.tables`` (:func:`drift`), the newest
migration and the revision before it (:func:`head_script`, :func:`previous_revision`), and
every job row (:func:`job_rows`)."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import Script, ScriptDirectory

from outbox.db.migrate import alembic_config, head_revision
from outbox.db.tables import VERSION_TABLE, metadata


def drift(engine: sa.Engine) -> list[Any]:
    """alembic's autogenerate diff between the database and ``metadata``, configured as
    ``alembic/env.py`` configures it (plus type and default comparison)."""
    with engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={
            "target_metadata": metadata,
            "version_table": VERSION_TABLE,
            "compare_type": True,
            "compare_server_default": True,
        })
        return compare_metadata(context, metadata)


def snapshot(engine: sa.Engine) -> dict[str, object]:
    """Everything in schema ``public`` that outbox owns, as PostgreSQL describes it."""
    queries = {
        "tables": "SELECT table_name FROM information_schema.tables WHERE table_schema = 'public'",
        "columns": """
            SELECT table_name, column_name, ordinal_position, data_type, is_nullable, column_default,
                   is_identity, identity_generation
            FROM information_schema.columns WHERE table_schema = 'public'""",
        "indexes": "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = 'public'",
        "constraints": """
            SELECT c.conrelid::regclass::text, c.conname, pg_get_constraintdef(c.oid), c.convalidated
            FROM pg_constraint c JOIN pg_namespace n ON n.oid = c.connamespace
            WHERE n.nspname = 'public'""",
        "sequences": """
            SELECT sequencename, data_type::text, start_value, increment_by, cycle
            FROM pg_sequences WHERE schemaname = 'public'""",
        "triggers": """
            SELECT t.tgname, pg_get_triggerdef(t.oid) FROM pg_trigger t
            JOIN pg_class c ON c.oid = t.tgrelid JOIN pg_namespace n ON n.oid = c.relnamespace
            WHERE NOT t.tgisinternal AND n.nspname = 'public'""",
        "functions": """
            SELECT p.proname, pg_get_functiondef(p.oid) FROM pg_proc p
            JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = 'public'""",
        "storage_parameters": """
            SELECT relname, array_to_string(reloptions, ',') FROM pg_class
            WHERE relnamespace = 'public'::regnamespace AND reloptions IS NOT NULL""",
    }
    with engine.connect() as conn:
        return {name: sorted(tuple(r) for r in conn.exec_driver_sql(sql)) for name, sql in queries.items()}


def schema_revision(engine: sa.Engine) -> list[str]:
    """The rows of outbox's version table in schema ``public``."""
    with engine.connect() as conn:
        return list(conn.exec_driver_sql(f"SELECT version_num FROM {VERSION_TABLE}").scalars())


def head_script(scripts: ScriptDirectory | None = None) -> Script:
    """The newest migration (of ``scripts``, default outbox's own): ``.module`` is its loaded
    module, ``.down_revision`` the revision before it."""
    scripts = scripts or ScriptDirectory.from_config(alembic_config())
    script = scripts.get_revision(head_revision())
    assert script is not None
    return script


def previous_revision() -> str:
    """The revision the newest migration upgrades from (one: outbox's history has no merges)."""
    down = head_script().down_revision
    assert isinstance(down, str), f"the newest migration has no single previous revision: {down!r}"
    return down


def job_rows(engine: sa.Engine) -> dict[int, dict[str, Any]]:
    """Every job, each row as a dict of all its columns, by id."""
    with engine.connect() as conn:
        return {r["id"]: dict(r) for r in conn.exec_driver_sql("SELECT * FROM outbox_jobs").mappings()}
