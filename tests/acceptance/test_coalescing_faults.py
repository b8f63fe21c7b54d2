"""Coalescing under SIGKILL (issue 32, docs/coalescing.md): relay processes run
:mod:`tests.acceptance.coalesce_app` (two coalescing consumers, one ordered) while a stream
of events over five keys is published and a relay is killed every second or so, a
replacement started each time. The jobs of a killed relay come back through the reaper:
a marked one (a newer event of its key was routed while it ran) ends superseded, the
others run again. Then :func:`coalesce_app.check`: one job per (event, consumer), every run
found its job running under its own claim, no older event of a key claimed after a newer
one, the newest event of every key done for both consumers; the relays left exit 0 on
SIGTERM and log no traceback and no deadlock.

Size: ``OUTBOX_FAULT_EVENTS`` events (default 300), as the fault suite."""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL

from outbox.testing import wait_for

from . import coalesce_app
from .relays import Fleet

EVENTS = int(os.environ.get("OUTBOX_FAULT_EVENTS", "300"))
DURATION = max(6.0, EVENTS / 50)
LEASE = 3.0
FLAGS = ("--default-lease", str(LEASE), "--reap-interval", "0.3", "--concurrency", "4", "--poll-interval", "1",
         "--backoff-base", "0.02", "--backoff-cap", "0.1", "--reconnect-max", "1", "--shutdown-grace", "3",
         "--route-batch", "10")


@pytest.fixture
def fleet(tmp_path: Path, db_url: URL, engine: sa.Engine) -> Iterator[Fleet]:
    coalesce_app.create_tables(engine)
    fleet = Fleet(tmp_path, db_url.render_as_string(hide_password=False), app="tests.acceptance.coalesce_app:app",
                  base_flags=FLAGS, env={"CO_WORK_MS": "30"})
    try:
        yield fleet
    finally:
        fleet.cleanup()


@pytest.mark.slow
def test_sigkill_while_coalescing_keeps_only_the_newest_and_never_a_superseded_job(fleet: Fleet,
                                                                                  engine: sa.Engine) -> None:
    for _ in range(3):
        fleet.start()
    published: list[int] = []
    publisher = threading.Thread(
        target=lambda: published.extend(coalesce_app.publish_stream(engine, EVENTS, DURATION)), daemon=True)
    publisher.start()
    rng = random.Random(32)
    kills = 0
    held_at_kill = 0
    while publisher.is_alive():
        time.sleep(rng.uniform(0.6, 1.4))
        alive = [r for r in fleet.alive() if r.started()] or fleet.alive()
        with engine.connect() as c:
            holding = [r for r in alive if c.execute(sa.text(
                "SELECT count(*) FROM outbox_jobs WHERE status = 'running' AND locked_by LIKE :p"),
                {"p": f"%:{r.pid}:%"}).scalar_one()]
        victim = rng.choice(holding or alive)
        held_at_kill += victim in holding
        fleet.kill(victim)
        kills += 1
        fleet.start(wait=False)
    publisher.join()
    assert len(published) == EVENTS and kills >= 5
    try:
        wait_for(lambda: coalesce_app.drained(engine, published), timeout=60 + EVENTS / 10, interval=0.2,
                 what="the work to drain")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {coalesce_app.progress(engine)}\n{fleet.logs()[-6000:]}") from None
    fleet.check_count()
    wait_for(lambda: all(r.started() for r in fleet.alive()), timeout=30, what="every relay to be up")
    fleet.terminate_all()
    logs = fleet.logs()
    for bad in ("Traceback", "deadlock detected"):
        assert bad not in logs, f"{bad!r} in a relay log:\n{logs[max(0, logs.find(bad) - 1000):][:4000]}"
    counts = coalesce_app.check(engine, published)
    with engine.connect() as c:
        superseded_at_retry = c.execute(sa.text(
            "SELECT count(*) FROM outbox_jobs WHERE status = 'superseded' AND attempts > 0")).scalar_one()
    print(f"{kills} kills ({held_at_kill} of a relay holding jobs), jobs {counts}, "
          f"{superseded_at_retry} superseded after an attempt")
    assert held_at_kill > 0, "no kill hit a relay holding jobs"
