"""Small helpers shared by the router, job, handler and fencing tests: subscriptions,
events, routed jobs, reading job rows back, a relay running in the test's process, and an
``outbox-relay`` process started and stopped as an operator would, all on a real PostgreSQL."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from outbox import Outbox, publish_many
from outbox.relay.relay import Relay, register_subscriptions
from outbox.relay.router import route_all
from outbox.settings import OutboxSettings


def subscribe(engine: sa.Engine, topic: str, consumers: Iterable[str], **options: Any) -> Outbox:
    """A registry with one no-op lease-mode subscriber per consumer on ``topic``, written
    to ``outbox_subscriptions``."""
    ob = Outbox()
    for consumer in consumers:
        ob.subscriber(topic, consumer=consumer, **options)(lambda job: None)
    register_subscriptions(engine, ob, OutboxSettings(_env_file=None))
    return ob


def publish_events(engine: sa.Engine, topic: str, payloads: Iterable[dict[str, Any]]) -> list[int]:
    """Publish ``payloads`` on ``topic`` in one committed transaction; returns the event ids."""
    with Session(engine) as s, s.begin():
        return publish_many(s, [(topic, p) for p in payloads])


def routed_jobs(engine: sa.Engine, topic: str, consumers: Iterable[str], n: int = 1, **options: Any) -> list[int]:
    """Subscribe ``consumers`` to ``topic``, publish ``n`` events and route them; returns
    the ids of the ready jobs created, in id order."""
    consumers = list(consumers)
    subscribe(engine, topic, consumers, **options)
    publish_events(engine, topic, [{"n": i} for i in range(n)])
    route_all(engine)
    with engine.connect() as c:
        return list(c.execute(sa.text("SELECT id FROM outbox_jobs ORDER BY id")).scalars())


def statuses(engine: sa.Engine, consumer: str) -> dict[str, int]:
    """Jobs of ``consumer`` per status: ``{"done": 20, "dead": 1}``."""
    with engine.connect() as c:
        return dict(c.execute(sa.text("SELECT status, count(*) FROM outbox_jobs WHERE consumer = :c GROUP BY status"),
                              {"c": consumer}).all())


def job_row(conn: sa.Connection | sa.Engine, job_id: int) -> dict[str, Any]:
    """Every column of job ``job_id`` as a dict."""
    if isinstance(conn, sa.Engine):
        with conn.connect() as c:
            return job_row(c, job_id)
    return dict(conn.execute(sa.text("SELECT * FROM outbox_jobs WHERE id = :id"), {"id": job_id}).mappings().one())


def expire_lease(conn: sa.Connection, job_id: int) -> None:
    """Move job ``job_id``'s lease into the past (in ``conn``'s transaction)."""
    conn.execute(sa.text("UPDATE outbox_jobs SET lease_until = now() - interval '1 second' WHERE id = :id"),
                 {"id": job_id})


def db_now(conn: sa.Connection) -> Any:
    """The database clock in ``conn``'s transaction (``now()``: the transaction's start)."""
    return conn.execute(sa.text("SELECT now()")).scalar_one()


@contextlib.contextmanager
def running_relay(registry: Outbox, settings: OutboxSettings, **parts: Any) -> Iterator[Relay]:
    """A relay of ``registry`` (``Relay(registry, settings, **parts)``: ``route``, ``work``,
    ``maintain``, ``schedule``, ``worker_id``) started in this process for the block, and
    stopped as on SIGTERM when the block ends, however it ends. The relay stays readable
    after the block (its ``stats`` are final then)."""
    relay = Relay(registry, settings, **parts)
    relay.start()
    try:
        yield relay
    finally:
        relay.stop()


@contextlib.contextmanager
def running_relays(n: int, registry: Outbox, settings: OutboxSettings, **parts: Any) -> Iterator[list[Relay]]:
    """``n`` relays of ``registry`` alike (``Relay(registry, settings, **parts)`` each), all
    built, then started in turn for the block; the ones started are stopped in the same
    order when the block ends, however it ends."""
    relays = [Relay(registry, settings, **parts) for _ in range(n)]
    started: list[Relay] = []
    try:
        for relay in relays:
            relay.start()
            started.append(relay)
        yield relays
    finally:
        for relay in started:
            relay.stop()


@contextlib.contextmanager
def relay_process(argv: list[str], *, env: dict[str, str], timeout: float, cwd: Path | None = None,
                  what: str = "the relay") -> Iterator[tuple[subprocess.Popen[str], list[str]]]:
    """Start ``argv`` (an ``outbox-relay`` run) and wait until it logs "relay started"
    (asserting it did within ``timeout`` seconds, naming ``what`` and the log's end); yield
    the process and its stderr lines as they come. On leaving: SIGTERM, then a kill after
    ``timeout`` seconds. The caller asserts the exit status (``process.returncode``)."""
    process = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    started = threading.Event()

    def read() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            lines.append(line)
            if "relay started" in line:
                started.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + timeout
        while not started.wait(0.1) and process.poll() is None and time.monotonic() < deadline:
            pass
        assert started.is_set(), f"{what} did not start: {''.join(lines)[-3000:]}"
        yield process, lines
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        reader.join(5)
