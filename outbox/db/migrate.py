"""Applying and checking outbox's alembic migrations. In the repository they live in the
top-level ``alembic/`` folder next to ``alembic.ini``; the wheel ships the same files inside
the package as ``outbox/migrations`` (a setuptools package-dir mapping), so a plain,
non-editable install can migrate (:func:`migrations_dir`).

Migrations may run at once from many places (every replica's start-up runs ``outbox-relay
migrate``). Each upgrade or downgrade is one transaction whose first statement takes a
transaction-scoped advisory lock (``queries.schema_migrate_lock``, key
``queries.SCHEMA_MIGRATE_LOCK_KEY``): the others wait for it, then read the version table
afresh (each statement of a READ COMMITTED transaction sees what committed before it
began), find the schema at the revision they want and change nothing. Without the lock two
of them created the version table at the same moment and one failed with a unique
violation. A migration that fails rolls back entirely and releases the lock.
"""

from __future__ import annotations

import logging
from pathlib import Path

import psycopg
from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import ProgrammingError

from ..errors import SchemaNotReadyError
from ..resources import shipped_dir
from . import queries

log = logging.getLogger("outbox.migrate")


def migrations_dir() -> Path:
    """The folder of outbox's migration scripts (:mod:`outbox.resources`: ``outbox/migrations``
    in an installed package, the repository's ``alembic/`` in a checkout)."""
    return shipped_dir("migrations", "alembic", "env.py")


def alembic_config(connection: Connection | None = None) -> Config:
    """An alembic :class:`Config` for outbox's migrations (:func:`migrations_dir`);
    ``connection``, when given, is the one the migrations run on."""
    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    if connection is not None:
        config.attributes["connection"] = connection
    return config


def head_revision() -> str:
    """The newest migration revision shipped with this version of outbox."""
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None, "outbox ships no migrations"
    return head


def upgrade(engine: Engine, revision: str = "head") -> str:
    """Migrate the database of ``engine`` to ``revision`` (default: newest), in one
    transaction holding the migration lock (see the module notes): safe to run again, and
    from many processes at once, which take turns. Returns the revision the database is at
    afterwards. Database errors propagate as SQLAlchemy raises them (the command line
    translates them); nothing is changed then."""
    with engine.begin() as connection:
        _lock(connection)
        command.upgrade(alembic_config(connection), revision)
        current: str = connection.execute(queries.schema_revision).scalar_one()
        return current


def downgrade(engine: Engine, revision: str) -> None:
    """Migrate the database of ``engine`` down to ``revision`` (``base`` drops everything),
    in one transaction holding the migration lock, like :func:`upgrade`."""
    with engine.begin() as connection:
        _lock(connection)
        command.downgrade(alembic_config(connection), revision)


def _lock(connection: Connection) -> None:
    """Take the migration lock in ``connection``'s transaction, saying so when it must wait."""
    if not connection.execute(queries.schema_migrate_lock_try).scalar_one():
        log.info("another migration holds the migration lock (advisory lock %d); waiting for it",
                 queries.SCHEMA_MIGRATE_LOCK_KEY)
        connection.execute(queries.schema_migrate_lock)


def check_schema(connection: Connection) -> None:
    """Raise :class:`SchemaNotReadyError` unless the database is at this package's head
    revision. Uses (and on failure rolls back) ``connection``'s current transaction. Any
    other database error (a role that may not read the version table, say) propagates as
    SQLAlchemy raises it."""
    try:
        with connection.begin_nested():
            current = connection.execute(queries.schema_revision).scalar()
    except ProgrammingError as exc:
        if not isinstance(exc.orig, psycopg.errors.UndefinedTable):
            raise
        current = None
    head = head_revision()
    if current is None:
        raise SchemaNotReadyError("outbox tables are missing; run `outbox-relay migrate`")
    if current != head:
        raise SchemaNotReadyError(
            f"database schema is at revision {current}, this outbox needs {head}; run `outbox-relay migrate`")
