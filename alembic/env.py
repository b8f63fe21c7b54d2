"""Alembic environment of outbox's own migrations (version table ``outbox_alembic_version``,
so it can live beside an application's alembic history).

Schema: the migrations run in outbox's schema, ``config.attributes["schema"]`` (set by
:func:`outbox.db.migrate.alembic_config`), else ``OUTBOX_SCHEMA``, else ``public``. The
schema is created when missing, then ``SET LOCAL search_path`` to it alone for the rest of
the migration's transaction, so the scripts name everything unqualified and create it
there; the version table is placed in it explicitly (``version_table_schema``).
"""

from __future__ import annotations

from alembic import context

from outbox.db import queries
from outbox.db.tables import VERSION_TABLE, metadata
from outbox.settings import check_schema_name, default_schema


def _schema() -> str:
    schema = context.config.attributes.get("schema")
    return default_schema() if schema is None else check_schema_name(schema)


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
    schema = _schema()
    context.configure(
        connection=connection,
        target_metadata=metadata,
        version_table=VERSION_TABLE,
        version_table_schema=schema,
        transaction_per_migration=False,
    )
    with context.begin_transaction():
        if not connection.execute(queries.schema_exists, {"schema": schema}).scalar_one():
            connection.execute(queries.in_schema(schema).schema_create)
        connection.execute(queries.schema_search_path_set_local, {"schema": schema})
        context.run_migrations()


if context.is_offline_mode():
    _offline_schema = _schema()
    context.configure(url=context.config.get_main_option("sqlalchemy.url"), target_metadata=metadata,
                      version_table=VERSION_TABLE, version_table_schema=_offline_schema, literal_binds=True)
    with context.begin_transaction():
        context.execute(queries.in_schema(_offline_schema).schema_create)
        context.execute(f"SET LOCAL search_path TO {_offline_schema}")
        context.run_migrations()
else:
    run_migrations_online()
