"""A seeded outbox and a dashboard served on a free port, for the dashboard's HTTP and browser
tests: real PostgreSQL, real uvicorn in a thread."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import sqlalchemy as sa
from sqlalchemy.orm import Session

from outbox import publish
from outbox.relay.router import route_all
from outbox.settings import OutboxSettings

from .helpers import subscribe

HOSTILE = "<script>alert(1)</script>"
CONSUMERS = ("bill", "mail", "ship")
#: A last_error with markup in it, as a handler's exception message could carry.
HOSTILE_ERROR = ("ValueError: <img src=x onerror=alert(2)> refused\nTraceback (most recent call last):\n"
                 "  File \"app.py\", line 3, in handle\n    raise ValueError(...)\n")


@dataclass
class Seed:
    """What :func:`seed` made: event ids, and per consumer the job ids by the status given."""

    events: list[int]
    hostile_event: int
    jobs: dict[str, dict[str, list[int]]] = field(default_factory=dict)


def seed(engine: sa.Engine) -> Seed:
    """Three consumers of ``order.placed`` (bill, mail, ship), six events (the last one's
    payload is :data:`HOSTILE` markup), 18 jobs: mail has 2 done, 2 dead (one with
    :data:`HOSTILE_ERROR`), 1 running, 1 ready; bill has 1 dead, 5 ready; ship 6 ready, one of
    them waiting out a backoff. One relay in the registry."""
    subscribe(engine, "order.placed", CONSUMERS)
    with Session(engine) as s, s.begin():
        events = [publish(s, "order.placed", {"order_id": i, "total_cents": 100 * i}, key=f"order:{i}",
                          headers={"trace": f"t-{i}"}) for i in range(1, 6)]
        hostile = publish(s, "order.placed", {"note": HOSTILE, "order_id": 6}, key="order:6",
                          headers={"x": HOSTILE})
    route_all(engine)
    with engine.begin() as c:
        ids = {(r.consumer, r.event_id): r.id for r in c.execute(sa.text("SELECT id, consumer, event_id FROM outbox_jobs"))}

        def set_(consumer: str, event: int, sql: str, **params: object) -> int:
            job = ids[(consumer, event)]
            c.execute(sa.text(f"UPDATE outbox_jobs SET {sql} WHERE id = :id"), {"id": job, **params})
            return job

        done = "status = 'done', attempts = 1, fence = nextval('outbox_fence_seq'), finished_at = now()"
        dead = ("status = 'dead', attempts = max_attempts, fence = nextval('outbox_fence_seq'), finished_at = now(), "
                "last_error = :error")
        result = Seed(events=events, hostile_event=hostile)
        result.jobs["mail"] = {
            "done": [set_("mail", events[0], done), set_("mail", events[1], done)],
            "dead": [set_("mail", events[2], dead, error=HOSTILE_ERROR),
                     set_("mail", events[3], dead, error="TimeoutError: smtp timed out\nTraceback ...")],
            "running": [set_("mail", events[4], "status = 'running', attempts = 1, fence = nextval('outbox_fence_seq'), "
                                                "lease_until = now() + interval '1 hour', locked_by = 'host-a:1:x'")],
            "ready": [ids[("mail", hostile)]],
        }
        result.jobs["bill"] = {"dead": [set_("bill", events[0], dead, error="KeyError: 'vat'")],
                               "ready": [ids[("bill", e)] for e in [*events[1:], hostile]]}
        result.jobs["ship"] = {
            "backoff": [set_("ship", events[0], "attempts = 1, run_at = now() + interval '1 hour', "
                                                "last_error = 'ConnectionError: carrier down'")],
            "ready": [ids[("ship", e)] for e in [*events, hostile]]}
        c.execute(sa.text("INSERT INTO outbox_relays (id, host, pid, version, consumers, concurrency) "
                          "VALUES ('host-a:1:x', 'host-a', 1, '0.1.0', ARRAY['bill', 'mail', 'ship'], 8)"))
    return result


def statuses(engine: sa.Engine, ids: list[int]) -> list[str]:
    """The status of each job of ``ids``, in that order."""
    with engine.connect() as c:
        found = dict(c.execute(sa.text("SELECT id, status FROM outbox_jobs WHERE id = ANY(:ids)"), {"ids": ids}).all())
    return [found[i] for i in ids]


def paused(engine: sa.Engine, consumer: str) -> bool:
    with engine.connect() as c:
        return c.execute(sa.text("SELECT paused_at IS NOT NULL FROM outbox_consumers WHERE consumer = :c"),
                         {"c": consumer}).scalar() is True


class Clock:
    """A monotonic clock the test moves by hand (``clock.now += 1``), for the dashboard's hold
    on wrong credentials (``create_app(throttle=LoginThrottle(clock=clock))``)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@contextmanager
def served(engine: sa.Engine, **options: object) -> Iterator[str]:
    """The dashboard (``create_app(engine, settings, **options)``) served by uvicorn in a
    thread on a free port of 127.0.0.1; yields its base URL; stops it on exit."""
    import uvicorn

    from outbox.ops.dashboard import create_app

    settings = OutboxSettings(_env_file=None)
    app = create_app(engine, settings, **options)  # type: ignore[arg-type]
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=False, lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="dashboard", daemon=True)
    thread.start()
    try:
        from outbox.testing import wait_for

        wait_for(lambda: server.started, timeout=20, what="the dashboard to start")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(20)
        sock.close()


def attempted(engine: sa.Engine, consumer: str, error: str) -> int:
    """Run two attempts of ``consumer``'s next due job with the relay's statements: the first
    fails with ``error`` (an attempt history entry, ``failed``), the second is done (the row
    itself); returns the job's id."""
    from outbox.db.jobs import claim_jobs, complete_jobs, fail_jobs
    from outbox.relay.outcomes import Failure

    with engine.begin() as c:
        [job] = claim_jobs(c, {consumer: 30.0}, 1, "host-b:2:y")
        fail_jobs(c, [(job, Failure(0.0, False, error))])
    with engine.begin() as c:
        [again] = claim_jobs(c, {consumer: 30.0}, 1, "host-c:3:z")
        assert again.id == job.id
        complete_jobs(c, [again])
    return job.id
