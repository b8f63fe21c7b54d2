"""The application of the coalescing tests with real relays (``--app
tests.acceptance.coalesce_app:app``; in-process, ``app(url)``), its publisher and the check
both tests end with (docs/coalescing.md).

Two consumers of topic ``co.state``, both ``coalesce=True``: ``latest`` (unordered) and
``latest_ordered`` (ordered per key). Their handler notes each run in ``co_runs`` as its
first step, on an autocommit connection of its own: consumer, key, event, job, the claim's
fence and attempt, and the job's row as the handler found it (status, fence); then it
works ``CO_WORK_MS`` milliseconds (default 20) and fails its first attempt for one event in
four, so retries meet newer events of their key. The publisher commits one event per
transaction, in order, over a few keys, faster than the handlers run a key, so most events
are superseded.

:func:`check`, once everything is drained:

* every routed event has exactly one job per consumer, and nothing waits or runs;
* every run found its job running under its own claim: no claim took a superseded job and
  nothing superseded a running one;
* only the newest runs: per (consumer, key), claims come in event order (a claim's fence is
  drawn when it is made: no job of an older event is claimed after one of a newer event);
* the newest event of every key ran to done, for both consumers;
* coalescing happened (superseded jobs) and every superseded job names a newer event.

Nothing is read at import time.
"""

from __future__ import annotations

import os
import random
import time
from collections import defaultdict
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from outbox import Job, Outbox, publish
from outbox.db.engine import make_engine

TOPIC = "co.state"
CONSUMERS = ("latest", "latest_ordered")
KEYS = 5

metadata = sa.MetaData()
runs = sa.Table(
    "co_runs", metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
    sa.Column("consumer", sa.Text, nullable=False),
    sa.Column("key", sa.Text, nullable=False),
    sa.Column("event_id", sa.BigInteger, nullable=False),
    sa.Column("job_id", sa.BigInteger, nullable=False),
    sa.Column("fence", sa.BigInteger, nullable=False),
    sa.Column("attempt", sa.Integer, nullable=False),
    sa.Column("status_seen", sa.Text, nullable=True),
    sa.Column("fence_seen", sa.BigInteger, nullable=True),
    sa.Column("at", sa.DateTime(timezone=True), nullable=False, server_default=sa.text("clock_timestamp()")),
)


def create_tables(engine: Engine) -> None:
    metadata.create_all(engine)


def app(url: str | None = None) -> Outbox:
    """The registry; its handlers note their runs in ``co_runs`` of the database at ``url``
    (default ``OUTBOX_DATABASE_URL``, as the relay process has it)."""
    engine = make_engine(url or os.environ["OUTBOX_DATABASE_URL"], pool_size=8, application_name="test-app")
    work = float(os.environ.get("CO_WORK_MS", "20")) / 1000
    note = sa.text(
        "INSERT INTO co_runs (consumer, key, event_id, job_id, fence, attempt, status_seen, fence_seen)"
        " SELECT :consumer, :key, :event, :job, :fence, :attempt, j.status, j.fence"
        " FROM (SELECT 1) one LEFT JOIN outbox_jobs j ON j.id = :job")

    def run(job: Job) -> None:
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
            c.execute(note, {"consumer": job.consumer, "key": job.key, "event": job.event_id, "job": job.id,
                             "fence": job.fence, "attempt": job.attempt})
        time.sleep(work)
        if job.payload["n"] % 4 == 0 and job.attempt == 1:
            raise RuntimeError("the first attempt of every fourth event fails")

    ob = Outbox()
    ob.subscriber(TOPIC, consumer="latest", coalesce=True, max_attempts=50)(run)
    ob.subscriber(TOPIC, consumer="latest_ordered", coalesce=True, ordered=True, max_attempts=50)(run)
    return ob


def publish_stream(engine: Engine, events: int, duration: float, seed: int = 32) -> list[int]:
    """Publish ``events`` events on :data:`TOPIC`, one committed transaction each, in order,
    spread over ``duration`` seconds, each of a key drawn from ``k0``..``k4``; returns their ids."""
    rng = random.Random(seed)
    ids = []
    start = time.monotonic()
    for n in range(events):
        with Session(engine) as s, s.begin():
            ids.append(publish(s, TOPIC, {"n": n}, key=f"k{rng.randrange(KEYS)}"))
        time.sleep(max(0.0, start + duration * (n + 1) / events - time.monotonic()))
    return ids


def drained(engine: Engine, ids: list[int]) -> bool:
    """Every event of ``ids`` routed and no job waiting or running."""
    with engine.connect() as c:
        unrouted = c.execute(sa.text("SELECT count(*) FROM outbox_events WHERE routed_at IS NULL AND id = ANY(:ids)"),
                             {"ids": ids}).scalar_one()
        live = c.execute(sa.text("SELECT count(*) FROM outbox_jobs WHERE status IN ('ready', 'pending', 'running')"))
        return unrouted == 0 and live.scalar_one() == 0


def progress(engine: Engine) -> dict[str, Any]:
    with engine.connect() as c:
        return dict(c.execute(sa.text("SELECT status, count(*) FROM outbox_jobs GROUP BY status")).all())


def check(engine: Engine, ids: list[int]) -> dict[str, int]:
    """The invariants of the module notes; raises AssertionError naming the first broken
    one. Returns the job counts per status."""
    with engine.connect() as c:
        jobs = c.execute(sa.text(
            "SELECT j.id, j.event_id, j.consumer, j.status, j.superseded_by, e.key FROM outbox_jobs j"
            " JOIN outbox_events e ON e.id = j.event_id")).all()
        noted = c.execute(sa.select(runs)).all()
    by_pair = defaultdict(list)
    for j in jobs:
        by_pair[(j.event_id, j.consumer)].append(j)
    missing = [(e, c) for e in ids for c in CONSUMERS if len(by_pair[(e, c)]) != 1]
    assert not missing, f"(event, consumer) pairs without exactly one job: {missing[:10]}"
    counts: dict[str, int] = defaultdict(int)
    for j in jobs:
        counts[j.status] += 1
    assert set(counts) <= {"done", "superseded"}, f"jobs left unfinished or dead: {dict(counts)}"
    assert counts["superseded"] > 0, f"nothing was coalesced: {dict(counts)}"
    bad = [j for j in jobs if j.status == "superseded" and not (j.superseded_by and j.superseded_by > j.event_id)]
    assert not bad, f"superseded jobs naming no newer event: {bad[:5]}"
    wrong = [r for r in noted if (r.status_seen, r.fence_seen) != ("running", r.fence)]
    assert not wrong, f"runs that found their job other than running under their claim: {wrong[:5]}"
    claims: dict[tuple[str, str], list[Any]] = defaultdict(list)
    for r in noted:
        claims[(r.consumer, r.key)].append(r)
    for (consumer, key), seen in claims.items():
        seen.sort(key=lambda r: r.fence)
        for before, after in zip(seen, seen[1:]):
            assert before.event_id <= after.event_id, (
                f"{consumer} {key}: event {after.event_id} claimed (fence {after.fence}) after newer event "
                f"{before.event_id} (fence {before.fence})")
    status = {(j.event_id, j.consumer): j.status for j in jobs}
    with engine.connect() as c:
        newest = c.execute(sa.text("SELECT key, max(id) FROM outbox_events WHERE id = ANY(:ids) GROUP BY key"),
                           {"ids": ids}).all()
    for key, event in newest:
        for consumer in CONSUMERS:
            assert status[(event, consumer)] == "done", f"{consumer} {key}: newest event {event} is not done"
    return dict(counts)
