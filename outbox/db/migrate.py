"""Applying and checking outbox's alembic migrations, which ship inside the package
(``outbox/migrations``) so a plain, non-editable install can migrate."""

from __future__ import annotations

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import ProgrammingError

from ..errors import SchemaNotReadyError
from . import queries


def alembic_config(connection: Connection | None = None) -> Config:
    """An alembic :class:`Config` for the packaged migrations; ``connection``, when given,
    is the one the migrations run on."""
    config = Config()
    config.set_main_option("script_location", "outbox:migrations")
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
    transaction. Safe to run again; returns the revision the database is at afterwards."""
    with engine.begin() as connection:
        command.upgrade(alembic_config(connection), revision)
        return connection.execute(queries.schema_revision).scalar_one()


def downgrade(engine: Engine, revision: str) -> None:
    """Migrate the database of ``engine`` down to ``revision`` (``base`` drops everything)."""
    with engine.begin() as connection:
        command.downgrade(alembic_config(connection), revision)


def check_schema(connection: Connection) -> None:
    """Raise :class:`SchemaNotReadyError` unless the database is at this package's head
    revision. Uses (and on failure rolls back) ``connection``'s current transaction."""
    try:
        with connection.begin_nested():
            current = connection.execute(queries.schema_revision).scalar()
    except ProgrammingError:
        current = None
    head = head_revision()
    if current is None:
        raise SchemaNotReadyError("outbox tables are missing; run `outbox-relay migrate`")
    if current != head:
        raise SchemaNotReadyError(
            f"database schema is at revision {current}, this outbox needs {head}; run `outbox-relay migrate`")
