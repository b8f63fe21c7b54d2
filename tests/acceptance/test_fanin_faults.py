"""Fan-in under SIGKILL (issue 32): relay processes run the two-step workflow of
:mod:`tests.acceptance.fanin_app` (``fanin.order`` -> three consumers -> ``fanin.fulfilled``
-> two consumers -> ``fanin.closed``) while one of them is killed at random points and
replaced, again and again; half the relays delete done jobs (``retention_done = 0``), half
keep them. When the work has drained: for every event of both steps, exactly one follow-up
if every listed job of it ended done, none otherwise (a job dead by its handler's rule, or
by the kills on its every attempt), each recorded once in ``outbox_fanin_fired`` with its
follow-up; no relay log shows a deadlock or a traceback.

Size: ``OUTBOX_FAULT_EVENTS`` orders (default 300), as the fault suite."""

from __future__ import annotations

import os
import random
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL
from sqlalchemy.orm import Session

from outbox import publish_many
from outbox.testing import wait_for

from . import fanin_app
from .relays import Fleet

EVENTS = int(os.environ.get("OUTBOX_FAULT_EVENTS", "300"))
DURATION = max(6.0, EVENTS / 50)
DRAIN = 90 + EVENTS / 10
BASE_FLAGS = ("--default-lease", "2", "--reap-interval", "0.3", "--concurrency", "4", "--poll-interval", "1",
              "--backoff-base", "0.05", "--backoff-cap", "0.3", "--reconnect-max", "1", "--shutdown-grace", "3")


@pytest.fixture
def fleet(tmp_path: Path, db_url: URL) -> Iterator[Fleet]:
    fleet = Fleet(tmp_path, db_url.render_as_string(hide_password=False), app="tests.acceptance.fanin_app:app",
                  base_flags=BASE_FLAGS)
    try:
        yield fleet
    finally:
        fleet.cleanup()


def _publish(engine: sa.Engine, stop_after: float) -> list[int]:
    """Publish ``EVENTS`` orders in batches of 1..5 over ``stop_after`` seconds; their ids."""
    ids: list[int] = []
    rng = random.Random(5)
    t0 = time.monotonic()
    n = 0
    while n < EVENTS:
        size = min(rng.randint(1, 5), EVENTS - n)
        with Session(engine) as s, s.begin():
            ids += publish_many(s, [(fanin_app.ORDER, {"n": n + i}, f"customer:{(n + i) % 13}")
                                    for i in range(size)])
        n += size
        time.sleep(max(0.0, t0 + stop_after * n / EVENTS - time.monotonic()))
    return ids


def _settled(engine: sa.Engine) -> bool:
    with engine.connect() as c:
        return not c.execute(sa.text(
            "SELECT EXISTS (SELECT 1 FROM outbox_events WHERE routed_at IS NULL) "
            "OR EXISTS (SELECT 1 FROM outbox_jobs WHERE status IN ('ready', 'running', 'pending'))")).scalar_one()


def _check_step(engine: sa.Engine, topic: str, listed: tuple[str, ...], follow_topic: str) -> tuple[int, int]:
    """Every event on ``topic``: one follow-up on ``follow_topic`` if no job of ``listed`` is
    anything but done (a job deleted by its completion is done: nothing else deletes one
    here), else none; returns (events fired, events held back)."""
    with engine.connect() as c:
        events = c.execute(sa.text("SELECT id, key, payload FROM outbox_events WHERE topic = :t"),
                           {"t": topic}).all()
        unfinished = set(c.execute(sa.text(
            "SELECT DISTINCT j.event_id FROM outbox_jobs j JOIN outbox_events e ON e.id = j.event_id "
            "WHERE e.topic = :t AND j.consumer = ANY (CAST(:c AS text[])) AND j.status <> 'done'"),
            {"t": topic, "c": list(listed)}).scalars())
        follows = c.execute(sa.text("SELECT id, key, payload, headers FROM outbox_events WHERE topic = :t"),
                            {"t": follow_topic}).all()
        records = dict(((r.event_id, r.name), r.follow_event_id) for r in c.execute(sa.text(
            "SELECT event_id, name, follow_event_id FROM outbox_fanin_fired WHERE name = :n"), {"n": follow_topic}))
    per_event = Counter(f.headers["fan_in_event_id"] for f in follows)
    by_event = {f.headers["fan_in_event_id"]: f for f in follows}
    problems = []
    for e in events:
        want = 0 if e.id in unfinished else 1
        if per_event[e.id] != want:
            problems.append(f"event {e.id}: {per_event[e.id]} follow-ups, expected {want}")
        elif want:
            f = by_event[e.id]
            if (f.key, f.payload, records.get((e.id, follow_topic))) != (e.key, e.payload, f.id):
                problems.append(f"event {e.id}: follow-up {f.id} ({f.key}, {f.payload}) or its record is wrong")
    assert set(per_event) <= {e.id for e in events}, "a follow-up of an event not on the topic"
    assert not problems, f"{len(problems)} wrong: {problems[:10]}"
    return len(events) - len(unfinished), len(unfinished)


@pytest.mark.slow
def test_fan_in_under_repeated_sigkill(fleet: Fleet, engine: sa.Engine) -> None:
    for i in range(3):
        fleet.start(*(("--retention-done", "0") if i % 2 else ()))
    published: list[int] = []
    publisher = threading.Thread(target=lambda: published.extend(_publish(engine, DURATION)))
    publisher.start()
    rng = random.Random(7)
    kills = max(8, int(DURATION / 1.5))
    t0 = time.monotonic()
    for i in range(kills):
        time.sleep(max(0.0, t0 + DURATION / (kills + 1) * (i + rng.uniform(0.6, 1.4)) - time.monotonic()))
        victim = rng.choice([r for r in fleet.alive() if r.started()] or fleet.alive())
        fleet.kill(victim)
        fleet.start(*(("--retention-done", "0") if rng.random() < 0.5 else ()), wait=False)
    publisher.join()
    assert len(published) == EVENTS
    wait_for(lambda: _settled(engine), timeout=DRAIN, interval=0.3, what="the workflow to settle")
    fleet.check_count()
    wait_for(lambda: all(r.started() for r in fleet.alive()), timeout=30, what="every relay to be up")
    fleet.terminate_all()
    logs = fleet.logs()
    for bad in ("Traceback", "deadlock detected"):
        assert bad not in logs, f"{bad!r} in a relay log"
    fired, held = _check_step(engine, fanin_app.ORDER, fanin_app.FIRST, fanin_app.FULFILLED)
    closed, held_second = _check_step(engine, fanin_app.FULFILLED, fanin_app.SECOND, fanin_app.CLOSED)
    print(f"{kills} kills; step 1: {fired} fired, {held} held back; step 2: {closed} fired, {held_second} held back")
    assert held >= sum(fanin_app.expected_dead(n) for n in range(EVENTS)), "crm's refusals hold their orders back"
    assert fired > EVENTS // 2 and closed > fired // 2
