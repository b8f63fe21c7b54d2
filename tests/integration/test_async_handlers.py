"""async def handlers and plain def handlers served by the same worker threads: each runs
once and completes, whichever kind ran on the thread before."""

from __future__ import annotations

import threading

import sqlalchemy as sa
from sqlalchemy.orm import Session

from outbox import Job, Outbox, publish
from outbox.testing import wait_for

from .helpers import running_relay


def test_sync_and_async_handlers_share_worker_threads(engine, settings):
    ob = Outbox()
    calls: list[tuple[str, int]] = []
    lock = threading.Lock()

    @ob.subscriber("t", consumer="async_one")
    async def async_one(job: Job) -> None:
        with lock:
            calls.append(("async", job.event_id))

    class AsyncCallable:
        async def __call__(self, job: Job) -> None:
            with lock:
                calls.append(("async_callable", job.event_id))

    ob.subscriber("t", consumer="async_callable")(AsyncCallable())

    @ob.subscriber("t", consumer="sync_one")
    def sync_one(job: Job) -> None:
        with lock:
            calls.append(("sync", job.event_id))

    with Session(engine) as s, s.begin():
        ids = [publish(s, "t", {"i": i}) for i in range(5)]

    with running_relay(ob, settings(concurrency=1)):  # one thread runs all three kinds in turn
        def finished() -> bool:
            with engine.connect() as conn:
                return conn.execute(sa.text(
                    "SELECT count(*) FROM outbox_jobs WHERE status IN ('done', 'dead')")).scalar() == 15
        wait_for(finished, timeout=30, what="15 finished jobs")
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT consumer, status, attempts FROM outbox_jobs")).all()
    assert {(status, attempts) for _, status, attempts in rows} == {("done", 1)}, rows
    assert sorted(calls) == sorted((kind, i) for kind in ("async", "async_callable", "sync") for i in ids)
