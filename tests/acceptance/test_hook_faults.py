"""Failure hooks when relays die: a relay SIGKILLed while its on_dead hook runs leaves the
call leased; another relay makes it again once the lease (twice ``hook_timeout``) runs out
(at least once: the hook sees ``call == 2``), the job's status never changes, and no call is
left behind. Relays are ``outbox-relay run`` processes (:mod:`tests.acceptance.relays`)."""

from __future__ import annotations

import signal
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL
from sqlalchemy.orm import Session

from outbox import publish
from outbox.testing import wait_for
from tests.acceptance.relays import Fleet

APP = '''
"""A consumer that always fails (dead at attempt 1) and an on_dead hook that writes each of
its calls to table ``hook_runs`` and, on its first call, hangs (the test kills its relay then)."""
import os
import time

import sqlalchemy as sa

from outbox import JobFailure, Outbox
from outbox.db.engine import make_engine

ob = Outbox()
_engine = None


def record(failure: JobFailure, phase: str) -> None:
    global _engine
    if _engine is None:
        _engine = make_engine(os.environ["OUTBOX_DATABASE_URL"], pool_size=2, application_name="hook-app")
    with _engine.begin() as c:
        c.execute(sa.text("INSERT INTO hook_runs (job_id, call, phase, pid) VALUES (:j, :c, :p, :pid)"),
                  {"j": failure.job_id, "c": failure.call, "p": phase, "pid": os.getpid()})


@ob.subscriber("doomed", consumer="doomed", max_attempts=1)
def doomed(job) -> None:
    raise RuntimeError("always")


@ob.on_dead("doomed")
def alert(failure: JobFailure) -> None:
    record(failure, "start")
    if failure.call == 1:
        time.sleep(600)  # the relay is killed meanwhile
    record(failure, "end")
'''


@pytest.fixture
def fleet(tmp_path: Path, db_url: URL, engine: sa.Engine) -> Iterator[Fleet]:
    (tmp_path / "hookapp.py").write_text(textwrap.dedent(APP))
    with engine.begin() as c:
        c.execute(sa.text("CREATE TABLE hook_runs (id bigserial PRIMARY KEY, job_id bigint, call int, phase text, pid int)"))
    fleet = Fleet(tmp_path, db_url.render_as_string(hide_password=False), app="hookapp:ob",
                  base_flags=("--poll-interval", "0.2", "--reap-interval", "0.2"),
                  env={"OUTBOX_HOOK_TIMEOUT": "1"})
    try:
        yield fleet
    finally:
        fleet.cleanup()


def runs(engine: sa.Engine) -> list[tuple]:
    with engine.connect() as c:
        return [tuple(r) for r in c.execute(sa.text("SELECT job_id, call, phase, pid FROM hook_runs ORDER BY id"))]


@pytest.mark.slow
def test_a_relay_killed_during_a_hook_leaves_the_call_to_another_relay(engine, fleet):
    first = fleet.start()
    with Session(engine) as s, s.begin():
        publish(s, "doomed", {"order": 4})
    wait_for(lambda: runs(engine), timeout=30, what="the hook's first call")
    [(job_id, call, phase, pid)] = runs(engine)
    assert (call, phase, pid) == (1, "start", first.pid)
    fleet.kill(first)  # SIGKILL, in the middle of the hook
    second = fleet.start()
    wait_for(lambda: len(runs(engine)) == 3, timeout=30, what="the second relay's call")
    assert runs(engine)[1:] == [(job_id, 2, "start", second.pid), (job_id, 2, "end", second.pid)]
    with engine.connect() as c:
        wait_for(lambda: c.execute(sa.text("SELECT count(*) FROM outbox_hook_calls")).scalar() == 0, timeout=10,
                 what="the call deleted")
        assert c.execute(sa.text("SELECT status, attempts FROM outbox_jobs WHERE id = :id"), {"id": job_id}).one() == (
            "dead", 1)
    second.signal(signal.SIGTERM)
    assert second.proc.wait(20) == 0, second.log
    assert runs(engine)[1:] == [(job_id, 2, "start", second.pid), (job_id, 2, "end", second.pid)]  # not called again
