"""Engines, URL handling and the one place database errors are translated.

A URL given as ``postgresql://`` or ``postgres://`` (libpq style) is used with the
psycopg 3 driver. Secrets never leave this module in clear text: every message that
names a URL names it through :func:`redact` (:mod:`outbox.redaction`, the one rule for every
URL outbox shows: the userinfo password and secret query parameters such as ``password=``
and ``sslpassword=``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import psycopg
import sqlalchemy as sa
from sqlalchemy.engine import URL, Engine, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, OperationalError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from outbox.errors import (
    ConfigurationError,
    DatabaseStatementError,
    DatabaseUnavailableError,
    SchemaNotReadyError,
)
from outbox.redaction import redact

__all__ = ["describe", "is_disconnect", "make_async_engine", "make_engine", "parse_url", "redact", "translate_errors"]


def parse_url(url: str | URL) -> URL:
    """Parse ``url`` and select the psycopg 3 driver.

    Raises :class:`ConfigurationError` (secrets redacted) when it is not a PostgreSQL URL.
    """
    if isinstance(url, URL):
        parsed = url
    else:
        if not isinstance(url, str) or not url.strip():
            raise ConfigurationError("database URL is empty; set OUTBOX_DATABASE_URL or --database-url")
        try:
            parsed = make_url(url.strip())
        except (ArgumentError, ValueError):  # ValueError: a port that is not a number
            raise ConfigurationError(f"database URL is malformed: {redact(url)}") from None
    if parsed.get_backend_name() not in {"postgresql", "postgres"}:
        raise ConfigurationError(
            f"database URL must be a PostgreSQL URL (postgresql://...), got {redact(parsed)}")
    if parsed.drivername in {"postgresql", "postgres", "postgresql+psycopg2"}:
        parsed = parsed.set(drivername="postgresql+psycopg")
    elif parsed.drivername != "postgresql+psycopg":
        raise ConfigurationError(
            f"database URL driver {parsed.drivername!r} is not supported; use postgresql+psycopg://")
    return parsed


def make_engine(url: str | URL, *, pool_size: int = 5, max_overflow: int | None = None,
                application_name: str = "outbox", prepared_statements: bool = True) -> Engine:
    """A SQLAlchemy engine on psycopg 3 with pre-ping (dead connections after a server
    restart are replaced, not handed out) and a short connect timeout (5 seconds).

    The pool keeps up to ``pool_size`` connections and opens up to ``max_overflow`` more
    (default: ``pool_size``) while all of them are in use; a checkout beyond that waits up to
    30 seconds and then raises :class:`sqlalchemy.exc.TimeoutError` (SQLAlchemy docs,
    "QueuePool"). The engine sends no startup ``options`` of its own, so it connects
    through poolers that refuse them (PgBouncer: "unsupported startup parameter: options");
    a URL's own query parameters, ``?options=-csearch_path%3Dapp`` included, are passed to
    the driver unchanged. Settings a relay needs per transaction are set with ``SET LOCAL``
    inside it (:mod:`outbox.relay.transaction`).

    ``prepared_statements=False`` turns psycopg's automatic prepared statements off on every
    connection of the engine (``prepare_threshold=None``; psycopg docs, "Prepared
    statements"): behind a pooler in transaction mode without prepared-statement support
    (PgBouncer before 1.21, or ``max_prepared_statements = 0``) a statement prepared on one
    server connection is missing on the next, or its name collides with another client's
    (``DuplicatePreparedStatement``). Raises :class:`ConfigurationError` for a malformed URL,
    or query parameters SQLAlchemy refuses (``?port=abc``).
    """
    parsed = parse_url(url)
    with _refused_options(parsed):
        return sa.create_engine(parsed, **_engine_options(pool_size, max_overflow, application_name,
                                                          prepared_statements))


def make_async_engine(url: str | URL, *, pool_size: int = 5, max_overflow: int | None = None,
                      application_name: str = "outbox", prepared_statements: bool = True) -> AsyncEngine:
    """The :class:`~sqlalchemy.ext.asyncio.AsyncEngine` twin of :func:`make_engine`: the
    same URL handling, pool, pre-ping, timeouts and options, on psycopg 3's async
    connections. Its pool belongs to the event loop that first uses it (SQLAlchemy docs,
    "Using multiple asyncio event loops"): use one per event loop. Raises
    :class:`ConfigurationError` for a malformed URL, or query parameters SQLAlchemy refuses."""
    parsed = parse_url(url)
    with _refused_options(parsed):
        return create_async_engine(parsed, **_engine_options(pool_size, max_overflow, application_name,
                                                             prepared_statements))


@contextlib.contextmanager
def _refused_options(url: URL) -> Iterator[None]:
    """Turn SQLAlchemy's refusal of the URL's query while building an engine (``?port=abc``:
    "Received non-integer port arguments") into :class:`ConfigurationError`, URL redacted."""
    try:
        yield
    except ArgumentError as exc:
        raise ConfigurationError(f"database URL {redact(url)} is not usable: {exc}") from exc


def _engine_options(pool_size: int, max_overflow: int | None, application_name: str,
                    prepared_statements: bool) -> dict[str, Any]:
    """Keyword arguments of ``create_engine`` / ``create_async_engine`` for both makers."""
    connect_args: dict[str, object] = {"connect_timeout": 5, "application_name": application_name}
    if not prepared_statements:
        connect_args["prepare_threshold"] = None
    return {"pool_size": pool_size, "max_overflow": pool_size if max_overflow is None else max_overflow,
            "pool_pre_ping": True, "pool_recycle": 1800, "connect_args": connect_args}


def is_disconnect(exc: BaseException) -> bool:
    """True when ``exc`` means the connection or the server went away (worth a retry)."""
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return True
    return isinstance(exc, (OperationalError, psycopg.OperationalError))


def describe(exc: BaseException) -> str:
    """One readable line for a database error, without the SQL text or parameters."""
    orig = getattr(exc, "orig", None) or exc
    message = str(orig).strip().splitlines()[0] if str(orig).strip() else type(orig).__name__
    return f"{type(orig).__name__}: {message}"


@contextlib.contextmanager
def translate_errors(url: str | URL, schema: str = "public") -> Iterator[None]:
    """Turn connection failures into :class:`DatabaseUnavailableError`, a URL whose options
    the driver refuses into :class:`ConfigurationError`, missing tables (or a missing
    ``schema``, the one outbox's tables are expected in) into :class:`SchemaNotReadyError`
    naming the schema, and any other failed statement into :class:`DatabaseStatementError`,
    with readable one-line messages; the cause is kept."""
    try:
        yield
    except OperationalError as exc:
        raise DatabaseUnavailableError(f"cannot reach the database at {redact(url)}: {describe(exc)}") from exc
    except DBAPIError as exc:
        if exc.statement is None:  # refused before any statement: an option of the URL is wrong
            raise ConfigurationError(f"database URL {redact(url)} is not usable: {describe(exc)}") from exc
        message = str(exc.orig)
        if (isinstance(exc, sa.exc.ProgrammingError) and "does not exist" in message
                and ("outbox_" in message or f'schema "{schema}"' in message)):
            from outbox.db.migrate import migrate_command

            raise SchemaNotReadyError(f"outbox tables are missing in schema {schema} of {redact(url)}; "
                                      f"run `{migrate_command(schema)}`") from exc
        raise DatabaseStatementError(f"database error in {redact(url)}: {describe(exc)}") from exc
