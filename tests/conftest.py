"""Fixtures: a real PostgreSQL (OUTBOX_TEST_DATABASE_URL / OUTBOX_DATABASE_URL, else the
embedded one), one migrated template database per run, and a fresh copy of it per test,
dropped afterwards. The copies (and the empty databases) are made ahead on a thread of
their own (outbox.testing.DatabaseCopies): a test does not wait for its CREATE DATABASE.
They are dropped at the end of the test, before the teardown of the fixtures it asked for
first (a role with privileges in the database is dropped after it).

Two workers (pytest-xdist, ``-n 2`` in pyproject.toml's addopts) run the tests, each with
its own template and copies (and, without a server in the environment, its own embedded
server). A test that restarts the server (``needs_server_restart``) or measures rates and
delays under load (``alone``) runs with no other test running: see
:func:`pytest_runtest_protocol`."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from hypothesis import settings as hypothesis_settings
from sqlalchemy.engine import URL

from outbox.db.engine import make_engine
from outbox.settings import OutboxSettings
from outbox.testing import DatabaseCopies, drop_database, migrated_template, server_url

# Hypothesis profiles (tests/hypothesis_profiles.py: each property test's count is scaled by
# the profile's max_examples over 100). Chosen with HYPOTHESIS_PROFILE=ci or hypothesis' own
# --hypothesis-profile=ci (which wins); dev when neither is given.
# - dev: a twentieth of every count, for the inner loop (publish's differential tests draw
#   100 to 150 examples instead of 2,000 to 3,000).
# - ci: a quarter of every count, what .ci/run selects. CI must stay under 15 minutes and
#   took 914 s drawing every count: about 165 s of it the unit suite's property tests (CI's
#   figure), and more the two model-based tests (test_lifecycle_model, test_ordering_model).
#   Measured on 2 cores shared with five other sessions (2026-12-03): the unit suite's
#   property tests took 177 s thorough, 46 s ci, 8 s dev; the model tests with the jsonb
#   numbers test 700 s thorough, 193 s ci. A quarter
#   takes about three minutes off CI (near 12 minutes, under the 13 aimed at, with room for
#   new tests); half would leave it near 13.7.
# - thorough: every count as written, on demand (before changing publish's encoding, the
#   runner's statements or the ordering rules, run it on the files that test them).
hypothesis_settings.register_profile("dev", max_examples=5)
hypothesis_settings.register_profile("ci", max_examples=25, print_blob=True)
hypothesis_settings.register_profile("thorough", max_examples=100, print_blob=True)
hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


@pytest.fixture(scope="session")
def server() -> tuple[URL, bool]:
    return server_url()


@pytest.fixture(scope="session")
def embedded(server: tuple[URL, bool]) -> bool:
    return server[1]


@pytest.fixture(scope="session")
def template(server: tuple[URL, bool]) -> Iterator[URL]:
    url = migrated_template(server[0])
    yield url
    drop_database(url)


@pytest.fixture(scope="session")
def template_copies(server: tuple[URL, bool], template: URL) -> Iterator[DatabaseCopies]:
    copies = DatabaseCopies(server[0], template=template.database)
    yield copies
    copies.close()


@pytest.fixture(scope="session")
def empty_databases(server: tuple[URL, bool]) -> Iterator[DatabaseCopies]:
    copies = DatabaseCopies(server[0], ahead=1)
    yield copies
    copies.close()


@pytest.fixture
def db_url(template_copies: DatabaseCopies) -> Iterator[URL]:
    """A migrated database of this test's own."""
    url = template_copies.take()
    yield url
    template_copies.give_back(url)


@pytest.fixture
def empty_db_url(empty_databases: DatabaseCopies) -> Iterator[URL]:
    """A database of this test's own with no tables at all."""
    url = empty_databases.take()
    yield url
    empty_databases.give_back(url)


@pytest.fixture
def engine(db_url: URL) -> Iterator[sa.Engine]:
    engine = make_engine(db_url, pool_size=10)
    yield engine
    engine.dispose()


@pytest.fixture
def settings(db_url: URL) -> Callable[..., OutboxSettings]:
    """Build settings pointing at this test's database; keyword arguments override."""

    def build(**overrides) -> OutboxSettings:
        base = dict(database_url=db_url.render_as_string(hide_password=False), poll_interval=0.2,
                    reap_interval=0.2, shutdown_grace=2.0, backoff_base=0.05, backoff_cap=0.2)
        return OutboxSettings(_env_file=None, **{**base, **overrides})

    return build


def pytest_report_header(config) -> str:
    url = os.environ.get("OUTBOX_TEST_DATABASE_URL") or os.environ.get("OUTBOX_DATABASE_URL")
    if url:
        from outbox.db.engine import redact

        return f"outbox: testing against {redact(url)} (from the environment)"
    return "outbox: testing against an embedded PostgreSQL (OUTBOX_DATABASE_URL is not set)"


# ------------------------------------------------------------------ tests that run alone


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    """Around each test's setup, call and teardown on a pytest-xdist worker: the test holds
    the run's lock file shared, or exclusive when it is marked ``alone`` or
    ``needs_server_restart``, so such a test starts only once every other worker's test has
    ended, and none starts until it ends. Taking either lock first passes a gate (a second
    lock file, held by an exclusive taker from its wait to its end): a worker that finishes
    a test cannot take the shared lock again ahead of one waiting to run alone (flock has
    no queue). Without workers (``-n 0``, ``-p no:xdist``) tests run one at a time anyway."""
    if not hasattr(item.config, "workerinput"):  # not a pytest-xdist worker
        yield
        return
    alone = item.get_closest_marker("alone") is not None or item.get_closest_marker("needs_server_restart") is not None
    shared = item.config._tmp_path_factory.getbasetemp().parent  # type: ignore[attr-defined]  # the run's folder
    with _locked(shared / "outbox-tests.gate", fcntl.LOCK_EX, hold=alone), \
            _locked(shared / "outbox-tests.lock", fcntl.LOCK_EX if alone else fcntl.LOCK_SH):
        yield


@contextlib.contextmanager
def _locked(path: Path, mode: int, hold: bool = True) -> Iterator[None]:
    """Hold ``path``'s flock in ``mode`` for the block (``hold`` false: only pass it, taking
    and releasing it at once)."""
    with open(path, "a") as file:
        fcntl.flock(file, mode)
        if not hold:
            fcntl.flock(file, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(file, fcntl.LOCK_UN)
