"""pytest fixtures for applications that use outbox: a migrated database of each test's
own. Registered as the pytest plugin ``outbox`` (entry point ``pytest11``), so installing
the package makes the fixtures available in every test suite; ``-p no:outbox`` turns it
off.

Fixtures (all named ``outbox_*``, so they never clash with an application's own):

* ``outbox_server_url`` (session): the server, as :func:`outbox.testing.server_url` picks
  it: ``OUTBOX_TEST_DATABASE_URL``, else ``OUTBOX_DATABASE_URL``, else an embedded
  PostgreSQL (extra ``embedded``) started on first use;
* ``outbox_template_database_url`` (session): a database on it with outbox's migrations
  applied, made once per test session and dropped at its end;
* ``outbox_database_url`` (per test): a fresh copy of that template (``CREATE DATABASE ...
  TEMPLATE``, a fraction of a second), dropped after the test: each test starts with
  outbox's empty tables and nothing else; add your own tables in the test or a fixture;
* ``outbox_engine`` (per test): a SQLAlchemy engine (psycopg 3) on ``outbox_database_url``,
  disposed after the test.

URLs are strings with the password in clear (for ``create_engine`` and
``OutboxSettings(database_url=...)``). Lazy: importing this module imports nothing but
pytest, and no server is contacted or started until a test asks for one of these fixtures.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    import sqlalchemy as sa


@pytest.fixture(scope="session")
def outbox_server_url() -> str:
    """URL of the PostgreSQL server the tests use (any database on it)."""
    from outbox.testing import server_url

    return server_url()[0].render_as_string(hide_password=False)


@pytest.fixture(scope="session")
def outbox_template_database_url(outbox_server_url: str) -> Iterator[str]:
    """URL of a database with outbox's schema migrated, copied for each test."""
    from outbox.db.engine import parse_url
    from outbox.testing import drop_database, migrated_template

    url = migrated_template(parse_url(outbox_server_url))
    yield url.render_as_string(hide_password=False)
    drop_database(url)


@pytest.fixture
def outbox_database_url(outbox_server_url: str, outbox_template_database_url: str) -> Iterator[str]:
    """URL of a migrated database of this test's own, dropped after it."""
    from outbox.db.engine import parse_url
    from outbox.testing import temporary_database

    template = parse_url(outbox_template_database_url).database
    with temporary_database(parse_url(outbox_server_url), template=template) as url:
        yield url.render_as_string(hide_password=False)


@pytest.fixture
def outbox_engine(outbox_database_url: str) -> Iterator[sa.Engine]:
    """A SQLAlchemy engine on this test's database, disposed after the test."""
    from outbox.db.engine import make_engine

    engine = make_engine(outbox_database_url)
    yield engine
    engine.dispose()
