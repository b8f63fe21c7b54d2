"""outbox.testing.DatabaseCopies: databases made ahead on a thread, handed out once each,
dropped when given back, or at close when never taken."""

from __future__ import annotations

import uuid

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL

from outbox.db.engine import make_engine
from outbox.errors import ConfigurationError
from outbox.testing import DatabaseCopies, wait_for


def _databases(server: URL, prefix: str) -> set[str]:
    """Names of the databases on ``server`` made with ``prefix`` (a prefix of this test's own)."""
    engine = make_engine(server)
    try:
        with engine.connect() as c:
            return set(c.execute(sa.text("SELECT datname FROM pg_database WHERE starts_with(datname, :p)"),
                                 {"p": prefix + "_"}).scalars())
    finally:
        engine.dispose()


def _tables(url: URL) -> set[str]:
    engine = make_engine(url)
    try:
        with engine.connect() as c:
            return set(c.execute(sa.text("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")).scalars())
    finally:
        engine.dispose()


def test_copies_are_made_ahead_handed_out_once_and_all_dropped(server: tuple[URL, bool], template: URL) -> None:
    prefix = f"outbox_copies_{uuid.uuid4().hex[:8]}"
    copies = DatabaseCopies(server[0], template=template.database, prefix=prefix, ahead=2)
    try:
        wait_for(lambda: len(_databases(server[0], prefix)) == 2, timeout=30, what="two copies made ahead")
        first, second, third = copies.take(), copies.take(), copies.take()
        assert len({first.database, second.database, third.database}) == 3
        assert {first.database, second.database, third.database} <= _databases(server[0], prefix)
        assert "outbox_jobs" in _tables(third) and _tables(third) == _tables(template)  # copies of the template
        wait_for(lambda: len(_databases(server[0], prefix)) == 5, timeout=30, what="two more made ahead")
        copies.give_back(first)  # dropped at once
        assert first.database not in _databases(server[0], prefix)
        assert second.database in _databases(server[0], prefix)
        copies.give_back(second)
    finally:
        copies.close()
    assert _databases(server[0], prefix) == {third.database}  # taken, not given back: still the caller's
    copies.give_back(third)
    assert _databases(server[0], prefix) == set()
    with pytest.raises(ConfigurationError, match="after close"):
        copies.take()


def test_without_a_template_the_databases_have_no_tables(server: tuple[URL, bool]) -> None:
    prefix = f"outbox_copies_{uuid.uuid4().hex[:8]}"
    copies = DatabaseCopies(server[0], prefix=prefix, ahead=0)
    try:
        url = copies.take()  # none made ahead: made at once
        assert _databases(server[0], prefix) == {url.database}
        assert _tables(url) == set()
        copies.give_back(url)
    finally:
        copies.close()
    assert _databases(server[0], prefix) == set()
