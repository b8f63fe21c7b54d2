"""outbox.db.include_object: an application's own alembic autogenerate, run against a
database that ``outbox-relay migrate`` migrated, proposes nothing about outbox's tables
(and without the hook proposes to drop them, which is the problem the hook solves)."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from outbox.db import include_object
from outbox.db.tables import metadata as outbox_metadata
from outbox.db.tables import table_names

app_metadata = sa.MetaData()
orders = sa.Table(  # the application's own table, with an index of its own
    "orders", app_metadata,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("customer", sa.Text, nullable=False, index=True),
    sa.Column("fence", sa.BigInteger, nullable=False),
)


def _diff(engine: sa.Engine, metadata: sa.MetaData, **opts: Any) -> list[Any]:
    with engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={"compare_type": True, **opts})
        return compare_metadata(context, metadata)


@pytest.fixture
def app_engine(engine: sa.Engine) -> sa.Engine:
    """The test's database, migrated by outbox, plus the application's own table."""
    app_metadata.create_all(engine)
    return engine


def test_autogenerate_with_the_hook_proposes_nothing_for_outbox(app_engine):
    assert _diff(app_engine, app_metadata, include_object=include_object) == []


def test_autogenerate_without_the_hook_proposes_dropping_outbox_tables(app_engine):
    diff = _diff(app_engine, app_metadata)
    removed = {entry[1].name for entry in diff if isinstance(entry, tuple) and entry[0] == "remove_table"}
    assert removed == table_names()  # every table of outbox, its version table included


def test_the_hook_still_reports_the_applications_own_changes(app_engine):
    changed = sa.MetaData()
    sa.Table("orders", changed, sa.Column("id", sa.Integer, primary_key=True),
             sa.Column("customer", sa.Text, nullable=False, index=True),
             sa.Column("fence", sa.BigInteger, nullable=False), sa.Column("note", sa.Text))
    sa.Table("refunds", changed, sa.Column("id", sa.Integer, primary_key=True))
    diff = _diff(app_engine, changed, include_object=include_object)
    assert sorted((entry[0], entry[1].name if entry[0] == "add_table" else entry[3].name) for entry in diff) == [
        ("add_column", "note"), ("add_table", "refunds")]


def test_an_app_that_includes_outbox_metadata_sees_no_difference_either(app_engine):
    """The other recipe (outbox's tables in the app's target_metadata) with the hook: still
    nothing to do, and no outbox object is compared."""
    diff = _diff(app_engine, [app_metadata, outbox_metadata], include_object=include_object)
    assert diff == []


def test_the_hook_decides_by_name_whatever_the_schema():
    other = sa.MetaData(schema="tenant_a")
    jobs = sa.Table("outbox_jobs", other, sa.Column("id", sa.BigInteger, primary_key=True),
                    sa.Index("ix_outbox_jobs_ready", "id"))
    mine = sa.Table("jobs", other, sa.Column("id", sa.BigInteger, primary_key=True))
    assert include_object(jobs, "outbox_jobs", "table", True, None) is False
    assert include_object(jobs.c.id, "id", "column", True, None) is False
    assert include_object(next(iter(jobs.indexes)), "ix_outbox_jobs_ready", "index", True, None) is False
    assert include_object(sa.Sequence("outbox_fence_seq", schema="tenant_a"), "outbox_fence_seq",
                          "sequence", True, None) is False
    assert include_object(mine, "jobs", "table", True, None) is True
    assert include_object(mine.c.id, "id", "column", True, None) is True
