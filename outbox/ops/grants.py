"""Least privilege: the GRANTs of the relay role and the publisher role.

Three roles (operations notes, "Roles"), all created by the database administrator:

* the **owner** runs ``outbox-relay migrate``: it creates the schema's tables and so owns
  them (DDL). It is the only role that needs more than the grants below.
* the **relay** role runs ``outbox-relay run`` and the inspecting commands: DML on every
  table of outbox (``SELECT, INSERT, UPDATE, DELETE``), ``SELECT`` on the version table
  (the start-up check of the schema's revision), ``USAGE`` on outbox's sequences (the fence
  sequence: every claim takes ``nextval``), ``EXECUTE`` on ``outbox_publish`` and
  ``outbox_insert_event`` (a fan-in's follow-up is published by the trigger on the jobs,
  as the role completing the job; it could insert the event itself anyway). No DDL, no
  TRUNCATE, no REFERENCES. LISTEN, NOTIFY and advisory locks need no grant. ANALYZE and
  VACUUM of the queue's tables need ownership (or, on PostgreSQL 17 and later, ``MAINTAIN``:
  ``maintain=True`` grants it); without it the relay skips them with one warning
  (:class:`outbox.relay.maintenance.TableUpkeep`).
* the **publisher** role is the application's: ``INSERT`` on the columns of
  ``outbox_events`` publish writes (:data:`PUBLISHER_EVENT_INSERT_COLUMNS`), and ``SELECT``
  on the columns publish reads back, no others: ``id`` (``RETURNING id``), ``topic`` and
  ``dedup_key`` (the look-up of the event holding a ``dedup_key``, and the arbiter of its
  ``ON CONFLICT``), and ``topic, ordered`` of ``outbox_subscriptions`` (whether a keyed
  event takes its key's publish lock). It cannot read any event's payload, headers or key,
  nor see or touch jobs. Nor can it write the columns outbox owns (issue 26): an ``id`` of
  its choosing (``OVERRIDING SYSTEM VALUE`` past the identity: every other publish would
  then fail on the primary key), ``routed_at`` (an event preset routed is never routed) or
  ``created_at``; headers that are not a JSON object are refused for every writer by the
  table's CHECK (migration 0008). Column privileges add to a table-wide grant rather than
  narrow it, so the statements first revoke ``INSERT`` on the table (which the grants of
  outbox before issue 26 gave, and which takes the column grants with it), then grant the
  columns: run them in one transaction (``--apply`` does). The identity column's sequence
  needs no grant (an identity default is drawn without a privilege check), nor do the
  defaults of the columns not granted, the publish lock (``pg_advisory_xact_lock``) or the
  NOTIFY trigger. It may also call the SQL functions ``outbox_publish`` and
  ``outbox_publish_many`` (``EXECUTE``, which migration 0010 takes back from ``PUBLIC``): they
  run with its privileges, the ones above.

Both roles also get ``USAGE`` on the schema. Every name is quoted as an identifier
(``psycopg.sql.Identifier``), so a role may have any name PostgreSQL allows; role names
cannot be bound parameters, which is why these statements are composed here rather than
kept as text in :mod:`outbox.db.queries`. The tables are those of this version of outbox
(:data:`outbox.db.tables.metadata`): run the command again after a ``migrate`` that adds
one. GRANT is idempotent.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import TYPE_CHECKING

from psycopg import sql

from outbox.db import event_rules, tables
from outbox.errors import ConfigurationError
from outbox.settings import check_schema_name

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

    from outbox.settings import OutboxSettings

#: Longest role name PostgreSQL keeps, in bytes (NAMEDATALEN - 1).
MAX_ROLE_NAME_BYTES = 63

#: Columns of ``outbox_events`` the publisher may read (module notes).
PUBLISHER_EVENT_COLUMNS = ("id", "topic", "dedup_key")
#: Columns of ``outbox_events`` the publisher may insert: those publish and publish_many
#: write, every option included (``delay`` is written as ``run_at``). Not ``id``,
#: ``routed_at`` or ``created_at`` (module notes).
PUBLISHER_EVENT_INSERT_COLUMNS = ("topic", "key", "payload", "headers", "run_at", "priority", "dedup_key")
#: Columns of ``outbox_subscriptions`` the publisher may read.
PUBLISHER_SUBSCRIPTION_COLUMNS = ("topic", "ordered")
#: The SQL functions the relay role may call: the fan-in trigger publishes a follow-up with
#: ``outbox_publish`` (which calls ``outbox_insert_event``) with the privileges of the role
#: completing the job (:mod:`outbox.db.fan_in`).
RELAY_FUNCTIONS = tuple(f for f in event_rules.WRITING_FUNCTIONS
                        if f.partition("(")[0] in (event_rules.PUBLISH_FUNCTION, "outbox_insert_event"))
#: The queue's tables ``maintain=True`` grants MAINTAIN on (PostgreSQL 17 and later).
MAINTAINED_TABLES = ("outbox_jobs", "outbox_events")


def check_role_name(value: object, option: str) -> str:
    """Validate a role name given as ``option``: a non-empty ``str`` of at most 63 UTF-8
    bytes without NUL, not ``public`` or ``none`` and not starting with ``pg_`` (names
    PostgreSQL reserves: a grant to ``public`` would reach every role). Any other character
    is fine: names are quoted. Raises ConfigurationError."""
    if not isinstance(value, str) or not value:
        raise ConfigurationError(f"{option}: a role name is needed")
    if "\x00" in value:
        raise ConfigurationError(f"{option}: a role name cannot contain NUL")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise ConfigurationError(f"{option}: {value!r} is not valid Unicode") from None
    if size > MAX_ROLE_NAME_BYTES:
        raise ConfigurationError(f"{option}: role name {value[:20]!r}... is {size} bytes long, PostgreSQL keeps "
                                 f"{MAX_ROLE_NAME_BYTES}")
    if value.lower() in ("public", "none") or value.startswith("pg_"):
        raise ConfigurationError(f"{option}: {value!r} is a name PostgreSQL reserves; name a role of your own")
    return value


def _table(schema: str, name: str) -> sql.Composable:
    return sql.SQL("{}.{}").format(sql.Identifier(schema), sql.Identifier(name))


def _columns(names: Sequence[str]) -> sql.Composable:
    return sql.SQL(", ").join(map(sql.Identifier, names))


def relay_grants(role: str, schema: str = "public", *, maintain: bool = False) -> list[sql.Composable]:
    """The statements that give ``role`` what a relay needs on the outbox in ``schema``
    (module notes); ``maintain`` adds ``MAINTAIN`` on the queue's tables (PostgreSQL 17+)."""
    role_id = sql.Identifier(role)
    every_table = sql.SQL(", ").join(_table(schema, t) for t in sorted(tables.metadata.tables))
    sequences = _sequence_names()
    statements: list[sql.Composable] = [
        sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(sql.Identifier(schema), role_id),
        sql.SQL("GRANT SELECT, INSERT, UPDATE, DELETE ON TABLE {} TO {}").format(every_table, role_id),
        sql.SQL("GRANT SELECT ON TABLE {} TO {}").format(_table(schema, tables.VERSION_TABLE), role_id),
        sql.SQL("GRANT USAGE ON SEQUENCE {} TO {}").format(
            sql.SQL(", ").join(_table(schema, s) for s in sequences), role_id),
    ]
    statements += [sql.SQL("GRANT EXECUTE ON FUNCTION {}.{} TO {}").format(sql.Identifier(schema), sql.SQL(signature),
                                                                          role_id)
                   for signature in RELAY_FUNCTIONS]
    if maintain:
        statements.append(sql.SQL("GRANT MAINTAIN ON TABLE {} TO {}").format(
            sql.SQL(", ").join(_table(schema, t) for t in MAINTAINED_TABLES), role_id))
    return statements


def _sequence_names() -> list[str]:
    """outbox's own sequences (the fence sequence); identity columns' sequences need no grant."""
    return sorted(name for name in tables.relation_names()
                  if name not in tables.metadata.tables and name.endswith("_seq"))


def publisher_grants(role: str, schema: str = "public") -> list[sql.Composable]:
    """The statements that give ``role`` what :func:`outbox.publish` needs on the outbox in
    ``schema``, and nothing more (module notes): the first takes back a table-wide
    ``INSERT`` on the events, so run them in one transaction."""
    role_id = sql.Identifier(role)
    events = _table(schema, tables.events.name)
    return [
        sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(sql.Identifier(schema), role_id),
        sql.SQL("REVOKE INSERT ON TABLE {} FROM {}").format(events, role_id),
        sql.SQL("GRANT INSERT ({}) ON TABLE {} TO {}").format(_columns(PUBLISHER_EVENT_INSERT_COLUMNS), events,
                                                              role_id),
        sql.SQL("GRANT SELECT ({}) ON TABLE {} TO {}").format(_columns(PUBLISHER_EVENT_COLUMNS), events, role_id),
        sql.SQL("GRANT SELECT ({}) ON TABLE {} TO {}").format(
            _columns(PUBLISHER_SUBSCRIPTION_COLUMNS), _table(schema, tables.subscriptions.name), role_id),
        *(sql.SQL("GRANT EXECUTE ON FUNCTION {}.{} TO {}").format(sql.Identifier(schema), sql.SQL(signature), role_id)
          for signature in event_rules.WRITING_FUNCTIONS),
    ]


def grant_statements(relay: str | None, publisher: str | None, schema: str = "public", *,
                     maintain: bool = False) -> list[sql.Composable]:
    """Every statement for the roles given (either may be None), relay first. Raises
    ConfigurationError for an invalid role or schema name, or when neither is given."""
    schema = check_schema_name(schema)
    if relay is None and publisher is None:
        raise ConfigurationError("grants: name a role with --relay, --publisher or both")
    statements: list[sql.Composable] = []
    if relay is not None:
        statements += relay_grants(check_role_name(relay, "--relay"), schema, maintain=maintain)
    if publisher is not None:
        statements += publisher_grants(check_role_name(publisher, "--publisher"), schema)
    return statements


def render(statements: Sequence[sql.Composable]) -> str:
    """The statements as an SQL script, one a line, each ending in ``;``."""
    return "".join(statement.as_string(None) + ";\n" for statement in statements)


def apply(engine: Engine, statements: Sequence[sql.Composable], roles: Sequence[str], *,
          schema: str = "public", maintain: bool = False) -> None:
    """Run ``statements`` in one transaction on ``engine`` (as its role: the owner of
    outbox's tables, or another role that may grant on them). Raises ConfigurationError
    naming a role of ``roles`` that does not exist or ``schema`` (the statements' schema) when
    it holds no outbox tables, or when ``maintain`` (the statements
    grant MAINTAIN) and the server is older than PostgreSQL 17; nothing is granted then.
    Other database errors propagate as SQLAlchemy raises them."""
    from outbox.db import queries

    with engine.begin() as conn:
        if maintain:
            version = conn.execute(queries.server_version_number).scalar_one()
            if version < 170000:
                raise ConfigurationError(f"grants --maintain: the MAINTAIN privilege needs PostgreSQL 17 or later; "
                                         f"this server is {version // 10000}.{version % 10000}: leave --maintain "
                                         "out and let autovacuum (or the owner) ANALYZE and VACUUM")
        found = set(conn.execute(queries.role_names_existing, {"names": list(roles)}).scalars())
        missing = [r for r in roles if r not in found]
        if missing:
            raise ConfigurationError(f"grants: role {missing[0]!r} does not exist; create it first "
                                     f"(CREATE ROLE ... LOGIN PASSWORD '...'), then run this again")
        if not conn.execute(queries.relation_exists, {"schema": schema, "name": "outbox_jobs"}).scalar_one():
            raise ConfigurationError(f"grants: schema {schema!r} holds no outbox tables (no outbox_jobs); "
                                     f"run `outbox-relay migrate --schema {schema}` first, or name the schema "
                                     "outbox was migrated into")
        cursor = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
        for statement in statements:
            cursor.execute(statement)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``outbox-relay grants``."""
    parser.add_argument("--relay", metavar="ROLE", help="the role relays run as: DML on outbox's tables")
    parser.add_argument("--publisher", metavar="ROLE", help="the application's role: publish() only")
    parser.add_argument("--maintain", action="store_true",
                        help="also GRANT MAINTAIN on outbox_jobs and outbox_events to the relay role, so it may "
                             "ANALYZE and VACUUM them (PostgreSQL 17 and later)")
    parser.add_argument("--apply", action="store_true",
                        help="run the GRANTs on the configured database (as its owner) instead of printing them")


def main(args: argparse.Namespace, settings: OutboxSettings, engine: Engine | None) -> int:
    """``outbox-relay grants``: print the GRANTs (no database needed) or, with ``--apply``,
    run them on ``engine``'s database; returns the exit status."""
    schema = settings.schema_name
    statements = grant_statements(args.relay, args.publisher, schema, maintain=args.maintain)
    if not args.apply:
        print(f"-- outbox roles in schema {schema}: run as the owner of outbox's tables (who ran migrate),")
        print("-- in one transaction (psql --single-transaction)")
        print(render(statements), end="")
        return 0
    assert engine is not None
    roles = [r for r in (args.relay, args.publisher) if r is not None]
    apply(engine, statements, roles, schema=schema, maintain=args.maintain)
    print(f"granted: {', '.join(f'{kind} {name}' for kind, name in (('relay', args.relay), ('publisher', args.publisher)) if name)} "
          f"on schema {schema}")
    return 0
