"""Helpers for tests of outbox and of applications using it: a server to test against and
throw-away databases on it.

:func:`server_url` picks the server: ``OUTBOX_TEST_DATABASE_URL``, else
``OUTBOX_DATABASE_URL``, else an embedded PostgreSQL (extra ``embedded``) started in a
temporary folder. :func:`temporary_database` creates a uniquely named database (from a
template, when given) and drops it afterwards, so tests never touch data they did not
create.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from typing import TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import URL

from .db.engine import make_engine, parse_url


def server_url() -> tuple[URL, bool]:
    """The server tests run against, and whether it is the embedded one."""
    url = os.environ.get("OUTBOX_TEST_DATABASE_URL") or os.environ.get("OUTBOX_DATABASE_URL")
    if url:
        return parse_url(url), False
    from .embedded import start_embedded

    data_dir = os.path.join(tempfile.gettempdir(), f"outbox-test-pg-{os.getuid()}")
    return parse_url(start_embedded(data_dir)), True


def _admin(url: URL) -> sa.Engine:
    return sa.create_engine(url, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)


def create_database(server: URL, prefix: str = "outbox_test", template: str | None = None) -> URL:
    """Create a database named ``<prefix>_<random>`` (copied from ``template``) on the
    server of ``server``; returns its URL."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    engine = _admin(server)
    with engine.connect() as conn:
        clause = f' TEMPLATE "{template}"' if template else ""
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"{clause}')
    engine.dispose()
    return server.set(database=name)


def drop_database(url: URL) -> None:
    """Drop the database of ``url`` (terminating its sessions), connecting via ``postgres``."""
    engine = _admin(url.set(database="postgres"))
    with engine.connect() as conn:
        conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{url.database}" WITH (FORCE)')
    engine.dispose()


@contextlib.contextmanager
def temporary_database(server: URL, prefix: str = "outbox_test", template: str | None = None) -> Iterator[URL]:
    """A fresh database for the duration of the ``with`` block, dropped afterwards."""
    url = create_database(server, prefix, template)
    try:
        yield url
    finally:
        drop_database(url)


def migrated_template(server: URL) -> URL:
    """Create a database with outbox's schema migrated, for use as a template; the caller
    drops it with :func:`drop_database`."""
    from .db.migrate import upgrade

    url = create_database(server, "outbox_tpl")
    engine = make_engine(url)
    upgrade(engine)
    engine.dispose()
    return url


T = TypeVar("T")


def wait_for(condition: Callable[[], T], timeout: float = 30.0, interval: float = 0.05, what: str = "condition") -> T:
    """Call ``condition`` every ``interval`` seconds until it returns something truthy and
    return that; raise AssertionError naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
