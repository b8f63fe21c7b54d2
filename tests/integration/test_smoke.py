"""End to end in one process: publish -> route -> three consumers -> done."""

from __future__ import annotations

import threading

import sqlalchemy as sa
from sqlalchemy.orm import Session

from outbox import Job, Outbox, publish
from outbox.testing import wait_for

from .helpers import running_relay


def test_publish_route_run(engine, settings):
    ob = Outbox()
    seen: list[tuple[str, int]] = []
    lock = threading.Lock()

    @ob.subscriber("order.placed", consumer="a")
    def a(job: Job) -> None:
        with lock:
            seen.append(("a", job.payload["n"]))

    @ob.subscriber("order.placed", consumer="b", transactional=True)
    def b(job: Job, session: Session) -> None:
        session.execute(sa.text("SELECT 1"))
        with lock:
            seen.append(("b", job.payload["n"]))

    with Session(engine) as s, s.begin():
        for n in range(20):
            publish(s, "order.placed", {"n": n}, key=f"order:{n}")

    with running_relay(ob, settings()):
        wait_for(lambda: len(seen) >= 40, what="40 handler runs")
        def all_done():
            with engine.connect() as c:
                return c.execute(sa.text("SELECT count(*) FROM outbox_jobs WHERE status = 'done'")).scalar() == 40
        wait_for(all_done, what="40 done jobs")
    assert sorted(seen) == sorted([(c, n) for c in "ab" for n in range(20)])
