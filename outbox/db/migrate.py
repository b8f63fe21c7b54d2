"""Applying and checking outbox's alembic migrations. In the repository they live in the
top-level ``alembic/`` folder next to ``alembic.ini``; the wheel ships the same files inside
the package as ``outbox/migrations`` (a setuptools package-dir mapping), so a plain,
non-editable install can migrate (:func:`migrations_dir`).

Migrations may run at once from many places (every replica's start-up runs ``outbox-relay
migrate``). Each upgrade or downgrade is one transaction whose first statement takes a
transaction-scoped advisory lock (``queries.schema_migrate_lock``, key
``queries.schema_migrate_lock_key(schema)``): the others wait for it, then read the version table
afresh (each statement of a READ COMMITTED transaction sees what committed before it
began), find the schema at the revision they want and change nothing. Without the lock two
of them created the version table at the same moment and one failed with a unique
violation. A migration that fails rolls back entirely and releases the lock.

Schemas: every function takes ``schema`` (None: ``OUTBOX_SCHEMA``, else ``public``;
:func:`outbox.settings.default_schema`). Everything outbox creates, the version table
included, goes into that schema, created if missing (``CREATE SCHEMA`` needs the CREATE
privilege on the database; a schema that exists needs only CREATE on it). The lock key is
the schema's own, so two schemas migrate independently. A downgrade to ``base`` drops
outbox's tables and leaves the schema and its (empty) version table.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import psycopg
from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from sqlalchemy import text
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import OperationalError, ProgrammingError

from outbox.db import queries
from outbox.errors import SchemaNotReadyError
from outbox.resources import shipped_dir

log = logging.getLogger(__name__)

#: SQLSTATEs after which :func:`run_with_short_locks` tries its statement again:
#: lock_not_available (the lock timeout) and deadlock_detected.
LOCK_RETRIED = {"55P03": "lock timeout", "40P01": "deadlock"}


def migrations_dir() -> Path:
    """The folder of outbox's migration scripts (:mod:`outbox.resources`: ``outbox/migrations``
    in an installed package, the repository's ``alembic/`` in a checkout)."""
    return shipped_dir("migrations", "alembic", "env.py")


def alembic_config(connection: Connection | None = None, schema: str | None = None) -> Config:
    """An alembic :class:`Config` for outbox's migrations (:func:`migrations_dir`);
    ``connection``, when given, is the one the migrations run on; ``schema`` the schema they
    run in (None: the process default)."""
    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    if connection is not None:
        config.attributes["connection"] = connection
    config.attributes["schema"] = schema
    return config


def head_revision() -> str:
    """The newest migration revision shipped with this version of outbox."""
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None, "outbox ships no migrations"
    return head


def upgrade(engine: Engine, revision: str = "head", *, schema: str | None = None) -> str:
    """Migrate outbox's tables in ``schema`` (None: the process default) of the database of
    ``engine`` to ``revision`` (default: newest), creating the schema if missing, in one
    transaction holding the schema's migration lock (see the module notes): safe to run
    again, and from many processes at once, which take turns. Returns the revision the
    schema is at afterwards. Database errors propagate as SQLAlchemy raises them (the
    command line translates them); nothing is changed then. Raises
    :class:`~outbox.errors.ConfigurationError` for an invalid schema name."""
    statements = queries.in_schema(schema)
    with engine.begin() as connection:
        _lock(connection, statements.schema)
        command.upgrade(alembic_config(connection, statements.schema), revision)
        current: str = connection.execute(statements.schema_revision).scalar_one()
        return current


def downgrade(engine: Engine, revision: str, *, schema: str | None = None) -> None:
    """Migrate outbox's tables in ``schema`` down to ``revision`` (``base`` drops them all;
    the schema itself stays), in one transaction holding the schema's migration lock, like
    :func:`upgrade`."""
    statements = queries.in_schema(schema)
    with engine.begin() as connection:
        _lock(connection, statements.schema)
        command.downgrade(alembic_config(connection, statements.schema), revision)


def _lock(connection: Connection, schema: str) -> None:
    """Take ``schema``'s migration lock in ``connection``'s transaction, saying so when it must wait."""
    key = {"key": queries.schema_migrate_lock_key(schema)}
    if not connection.execute(queries.schema_migrate_lock_try, key).scalar_one():
        log.info("another migration of schema %s holds the migration lock (advisory lock %d); waiting for it",
                 schema, key["key"])
        connection.execute(queries.schema_migrate_lock, key)


def check_schema(connection: Connection, schema: str | None = None) -> None:
    """Raise :class:`SchemaNotReadyError` (naming the schema) unless outbox's tables in
    ``schema`` (None: the process default) are at this package's head revision. Uses (and
    on failure rolls back) ``connection``'s current transaction. Any other database error (a
    role that may not read the version table, say) propagates as SQLAlchemy raises it."""
    statements = queries.in_schema(schema)
    try:
        with connection.begin_nested():
            current = connection.execute(statements.schema_revision).scalar()
    except ProgrammingError as exc:
        if not isinstance(exc.orig, (psycopg.errors.UndefinedTable, psycopg.errors.InvalidSchemaName)):
            raise
        current = None
    head = head_revision()
    migrate = migrate_command(statements.schema)
    if current is None:
        raise SchemaNotReadyError(f"outbox tables are missing in schema {statements.schema}; run `{migrate}`")
    if current != head:
        raise SchemaNotReadyError(f"outbox schema {statements.schema} is at revision {current}, "
                                  f"this outbox needs {head}; run `{migrate}`")


def migrate_command(schema: str) -> str:
    """The command that migrates ``schema``, for messages: ``outbox-relay migrate`` for
    ``public``, else with ``--schema``."""
    return "outbox-relay migrate" + ("" if schema == "public" else f" --schema {schema}")


def run_with_short_locks(connection: Connection, statement: str, *, revision: str, lock_timeout: str,
                         retry_pause: float, attempts: int) -> None:
    """Run the DDL ``statement`` on a migration's ``connection``, waiting at most
    ``lock_timeout`` (text with a unit, ``'2s'``) for its locks.

    A statement that takes an ACCESS EXCLUSIVE lock waits for every transaction using the
    table and, while waiting, queues every new statement on it behind itself. So it runs in
    a savepoint with a transaction-local ``lock_timeout``; on a lock timeout or a deadlock
    (:data:`LOCK_RETRIED`) the savepoint gives back what it took, the queue moves for
    ``retry_pause`` seconds and the statement is tried again, up to ``attempts`` times in
    all, each retry logged as a WARNING naming ``revision``. After the last attempt the
    error propagates (SQLAlchemy's ``OperationalError``), and the migration fails having
    changed nothing. On success the session's own ``lock_timeout`` is put back for whatever
    runs after it in the transaction; the locks taken are kept until the migration commits
    (a released savepoint's locks belong to its transaction). Any other database error
    propagates at once. (Migration 0007's notes, where the rule was first written.)"""
    before = connection.execute(queries.lock_timeout_get).scalar_one()
    for attempt in range(1, attempts + 1):
        savepoint = connection.begin_nested()
        try:
            connection.execute(queries.lock_timeout_set_local, {"timeout": lock_timeout})
            connection.execute(text(statement))
        except OperationalError as exc:
            savepoint.rollback()
            sqlstate = getattr(exc.orig, "sqlstate", None)
            if sqlstate not in LOCK_RETRIED or attempt == attempts:
                raise
            log.warning("migration %s: %s on attempt %d of %d (lock_timeout %s), trying again in %gs: %s",
                        revision, LOCK_RETRIED[sqlstate], attempt, attempts, lock_timeout, retry_pause, statement)
            time.sleep(retry_pause)
        else:
            savepoint.commit()
            break
    connection.execute(queries.lock_timeout_set_local, {"timeout": before})
