"""Alembic environment of outbox's own migrations (version table ``outbox_alembic_version``,
so it can live beside an application's alembic history)."""

from __future__ import annotations

from alembic import context

from outbox.db.tables import metadata

VERSION_TABLE = "outbox_alembic_version"


def run_migrations_online() -> None:
    connection = context.config.attributes.get("connection")
    if connection is None:
        from outbox.db.engine import make_engine

        engine = make_engine(context.config.get_main_option("sqlalchemy.url"))
        with engine.connect() as connection:
            _run(connection)
        engine.dispose()
    else:
        _run(connection)


def _run(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=metadata,
        version_table=VERSION_TABLE,
        transaction_per_migration=False,
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    context.configure(url=context.config.get_main_option("sqlalchemy.url"), target_metadata=metadata,
                      version_table=VERSION_TABLE, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
else:
    run_migrations_online()
