"""Django: publish in the ORM's transaction, and lease-mode handlers that use the ORM.

Needs ``pip install 'outbox-relay[django]'``: Django 4.2 or later on its PostgreSQL backend
with psycopg 3 (Django prefers psycopg 3 when it is installed, and outbox depends on it).

Publishing. :func:`publish` and :func:`publish_many` write the event on Django's own
connection for the database alias ``using`` (``django.db.connections[using]``, the psycopg
3 ``Connection`` under it), through :func:`outbox.publish.publish`. So the event is a row of
the caller's transaction, with the same guarantee as on a SQLAlchemy session:

* inside ``transaction.atomic()`` the event commits with the ORM's writes of the block, or
  rolls back with them; in a nested block (a SAVEPOINT) rolled back, it is gone while the
  outer block goes on and commits the rest;
* outside any atomic block Django is in autocommit mode, so the event commits when the call
  returns, as a ``save()`` there does. Each call then runs in an atomic block of its own, so
  the statements of one call (a ``publish_many`` of several batches, a ``dedup_key``
  look-up) commit together or not at all.

The event is not deferred with ``transaction.on_commit()``, on purpose: a callback runs in
the process after the commit, so a crash, a kill or a failed statement between the commit
and the callback loses the event while the order it announces is saved, which is the loss
an outbox exists to prevent. Written as a row of the transaction, the event exists exactly
when the ORM's writes do; the relay delivers it (at least once) after the commit, woken by
the NOTIFY PostgreSQL sends then. Work that must follow the commit belongs in a handler.

The statements go through the psycopg connection, not Django's cursor, with Django's rules
around them: a block already broken by an earlier error raises Django's
``TransactionManagementError``, the connection is opened (and health-checked) as Django
opens it, and database errors are raised as Django's (``django.db.DatabaseError`` and its
subclasses, the psycopg error as ``__cause__``), marking the connection as Django does, so
its checks for an unusable connection see them. Django's query log (``DEBUG``) and
``connection.execute_wrapper()`` do not see them. Bad events raise
:class:`~outbox.errors.InvalidEventError` before anything is sent, the block still usable.

A database alias whose backend is not PostgreSQL (SQLite, MySQL), or is PostgreSQL through
another driver (psycopg2, a third-party backend), is refused with
:class:`~outbox.errors.ConfigurationError` before anything is sent: publish speaks psycopg
3 only, and a connection of its own would be a second transaction, not the caller's.

Handlers. The relay imports a handler module (``outbox-relay --app shop.jobs:ob``), which
calls :func:`setup` before importing models, so that Django is configured and its apps
loaded. The relay runs ``def`` handlers in long-lived worker threads; Django keeps one
connection per alias per thread and closes the unusable or obsolete ones (after an error
that broke them, or older than ``CONN_MAX_AGE``) only around each HTTP request, through
``close_old_connections``. A relay serves no requests: without that call a connection the
server closed (a restart, a failover, ``idle_session_timeout``) would fail every later job
of its thread. :func:`orm_handler` wraps a handler in ``close_old_connections()`` before
and after each job, as a request is. With ``CONN_MAX_AGE = 0`` (Django's default) each job
then opens and closes its own connection; set it to keep one per worker thread across
jobs (up to the relay's ``concurrency`` connections, beside the relay's own pool).
``async def`` handlers are refused by :func:`orm_handler`: they run on an event loop, where
Django refuses synchronous ORM calls.

Transactional handlers on Django's connection are not provided. The relay's transactional
mode gives the handler a SQLAlchemy ``Session`` on a connection of its own pool, and issues
the fenced completion (the statement that marks the job done only while this worker's fence
still holds) in that session's transaction; ORM writes made in such a handler would go
through Django's connection, another transaction, committed whether or not the completion
is. To give them the exactly-once effect of that mode, the relay would have to run the
handler's transaction on Django's connection of the worker thread: open an atomic block on
it, run the handler, issue the fenced completion on that same connection, and roll the
block back when the fence no longer holds or an operator cancelled the job, with what the
mode does around it (READ COMMITTED, retries of serialization failures and deadlocks, the
server ending a transaction left idle past the lease). Until then, use lease mode with
idempotent ORM writes: ``get_or_create`` on a unique key, or an update filtered on a
``fence`` column, ``Model.objects.filter(pk=..., fence__lt=job.fence).update(...,
fence=job.fence)``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import datetime
from typing import Any, ParamSpec, TypeVar

import psycopg

from outbox.db.event_rules import DEFAULT_MAX_PAYLOAD_BYTES
from outbox.errors import ConfigurationError
from outbox.publish import publish as publish_on
from outbox.publish import publish_many as publish_many_on

try:
    import django  # type: ignore[import-untyped]  # Django ships no type hints
    from django.core.exceptions import ImproperlyConfigured  # type: ignore[import-untyped]
    from django.db import (  # type: ignore[import-untyped]
        DEFAULT_DB_ALIAS,
        close_old_connections,
        connections,
        transaction,
    )
    from django.utils.connection import ConnectionDoesNotExist  # type: ignore[import-untyped]
except ModuleNotFoundError as exc:
    if exc.name is None or exc.name.partition(".")[0] != "django":
        raise
    raise ImportError("outbox.contrib.django needs Django 4.2 or later: pip install 'outbox-relay[django]'",
                      name=exc.name) from exc

P = ParamSpec("P")
R = TypeVar("R")

_SETUP_LOCK = threading.Lock()


def publish(
    topic: str,
    payload: Any,
    key: str | None = None,
    headers: Mapping[str, Any] | None = None,
    *,
    using: str = DEFAULT_DB_ALIAS,
    run_at: datetime | None = None,
    delay: float | None = None,
    dedup_key: str | None = None,
    priority: int | None = None,
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
    schema: str | None = None,
) -> int:
    """Write one event on Django's connection for the database alias ``using`` (default
    ``"default"``), in the caller's ``transaction.atomic()`` block: it commits or rolls back
    with the block's ORM writes. Outside any atomic block it commits when the call returns
    (Django's autocommit mode). Returns the event id. Never deferred with ``on_commit``
    (module notes).

    ``topic``, ``payload``, ``key``, ``headers`` and the options ``run_at``, ``delay``,
    ``dedup_key``, ``priority``, ``max_payload_bytes`` and ``schema`` mean what they mean
    for :func:`outbox.publish`.

    Raises :class:`~outbox.errors.InvalidEventError` for a bad event and
    :class:`~outbox.errors.ConfigurationError` for an alias missing from ``DATABASES`` or
    whose backend is not PostgreSQL on psycopg 3, both before anything is sent (the block
    stays usable); :class:`~outbox.errors.SchemaNotReadyError` when outbox's tables are
    missing; Django's ``TransactionManagementError`` inside an atomic block an earlier error
    broke; other database errors as Django's ``DatabaseError`` subclasses.
    """
    with _psycopg_connection(using) as conn:
        return publish_on(conn, topic, payload, key, headers, run_at=run_at, delay=delay,
                          dedup_key=dedup_key, priority=priority, max_payload_bytes=max_payload_bytes, schema=schema)


def publish_many(
    events: Iterable[Mapping[str, Any] | tuple[Any, ...]],
    *,
    using: str = DEFAULT_DB_ALIAS,
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
    schema: str | None = None,
) -> list[int]:
    """Write many events on Django's connection for the database alias ``using``, in the
    caller's atomic block as :func:`publish` does (outside any, they commit together when
    the call returns). Returns their ids in the order of ``events``.

    ``events`` yields mappings (``topic``, ``payload`` and optionally ``key``, ``headers``,
    ``run_at``, ``delay``, ``dedup_key``, ``priority``) or tuples ``(topic, payload[, key[,
    headers]])``, as for :func:`outbox.publish_many`: one bad event raises
    :class:`~outbox.errors.InvalidEventError` naming its index, and none is written. Raises
    what :func:`publish` raises otherwise.
    """
    with _psycopg_connection(using) as conn:
        return publish_many_on(conn, events, max_payload_bytes=max_payload_bytes, schema=schema)


def setup(settings_module: str | None = None) -> None:
    """Configure Django for a handler module the relay imports, once per process: set
    ``DJANGO_SETTINGS_MODULE`` to ``settings_module`` (a dotted module name) unless the
    environment already names one (as Django's ``manage.py`` does), then call
    ``django.setup()`` unless Django's apps are loaded already. Call it before importing
    models. Raises :class:`~outbox.errors.ConfigurationError` when no settings module is
    named and Django is not configured otherwise; an error importing the settings module
    propagates."""
    if settings_module is not None:
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", settings_module)
    from django.apps import apps  # type: ignore[import-untyped]

    with _SETUP_LOCK:
        if apps.ready:
            return
        try:
            django.setup()
        except ImproperlyConfigured as exc:
            raise ConfigurationError(f"outbox.contrib.django.setup: Django is not configured ({exc}); pass the "
                                     "settings module, setup('mysite.settings'), or set DJANGO_SETTINGS_MODULE") from exc


def orm_handler(handler: Callable[P, R]) -> Callable[P, R]:
    """Wrap a ``def`` handler so that each job runs between two calls of Django's
    ``close_old_connections()``, as each HTTP request does: the worker thread's connections
    broken by an error (the server restarted, the handler's statement failed) or older than
    ``CONN_MAX_AGE`` are closed before the job and again after it, whether it returned or
    raised (module notes). Keeps the handler's name, signature and module, so
    ``@ob.subscriber(...)`` above ``@orm_handler`` sees the handler itself.

    Meant for lease mode; a transactional handler may be wrapped too, but its ORM writes
    are not part of the job's transaction (module notes). Raises
    :class:`~outbox.errors.ConfigurationError` for an ``async def`` handler: Django refuses
    synchronous ORM calls on an event loop.
    """
    if inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(getattr(handler, "__call__", None)):  # noqa: B004
        raise ConfigurationError(
            f"orm_handler: {getattr(handler, '__qualname__', handler)!r} is async def; Django refuses synchronous "
            "ORM calls on an event loop: write the handler as a plain def (the relay runs it in a worker thread)")

    @functools.wraps(handler)
    def run_with_fresh_connections(*args: P.args, **kwargs: P.kwargs) -> R:
        close_old_connections()
        try:
            return handler(*args, **kwargs)
        finally:
            close_old_connections()

    return run_with_fresh_connections


@contextlib.contextmanager
def _psycopg_connection(using: str) -> Iterator[psycopg.Connection[Any]]:
    """The psycopg 3 connection under Django's connection for ``using``, opened and checked
    as Django's cursors do, inside the caller's atomic block or, when there is none, one of
    its own; database errors raised in the block come out as Django's."""
    connection = _postgresql_connection(using)
    connection.close_if_health_check_failed()
    connection.ensure_connection()
    connection.validate_thread_sharing()
    connection.validate_no_broken_transaction()
    raw = connection.connection
    if not isinstance(raw, psycopg.Connection):
        raise ConfigurationError(
            f"outbox.contrib.django: database alias {using!r} connects through "
            f"{type(raw).__module__}.{type(raw).__qualname__}, not psycopg 3; outbox publishes on a psycopg 3 "
            "Connection only: use ENGINE 'django.db.backends.postgresql' with psycopg 3 installed (Django 4.2 or "
            "later picks it over psycopg2)")
    atomic = contextlib.nullcontext() if connection.in_atomic_block else transaction.atomic(using=using)
    with atomic, connection.wrap_database_errors:
        yield raw


def _postgresql_connection(using: str) -> Any:
    """Django's connection (a ``DatabaseWrapper``) for ``using``, refused unless its vendor
    is PostgreSQL; no connection is opened."""
    try:
        connection = connections[using]
    except ConnectionDoesNotExist as exc:
        raise ConfigurationError(f"outbox.contrib.django: no database alias {using!r} in DATABASES") from exc
    if connection.vendor != "postgresql":
        raise ConfigurationError(
            f"outbox.contrib.django: database alias {using!r} is {connection.vendor} "
            f"(ENGINE {connection.settings_dict.get('ENGINE')!r}); outbox publishes on PostgreSQL only, "
            "through Django's 'django.db.backends.postgresql' backend on psycopg 3")
    return connection
