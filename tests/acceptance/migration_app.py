"""The application of the live-migration test (tests/acceptance/test_migration_live.py). Relays of
the previous release (the source tree before the newest migration, first on ``PYTHONPATH``)
and of this one run it (``--app tests.acceptance.migration_app:app``, a factory), and the test's
client of the previous release publishes, pauses and cancels with it (``python -m
tests.acceptance.migration_app``, :func:`serve`). It uses only outbox's public API,
``outbox.admin`` and ``outbox.db.engine.make_engine``, so both releases can run it.

Consumers; every lease-mode run is recorded in ``mig_runs``, one row committed per execution
(job, event, consumer, key, fence, attempt, and whether the lease was lost by its end):

* ``work_lease`` (``mig.work``, lease mode): records its run, nothing else.
* ``work_tx`` (``mig.work``, transactional): in the job's transaction, one row in
  ``mig_tx_log`` and :func:`outbox.fenced_write` of ``mig_effects`` (event id -> fence), so
  both commit with the completion, exactly once, or not at all.
* ``holder`` (``mig.hold``, lease mode, 12 s lease, so heartbeats every 4 s) and ``seq``
  (``mig.seq``, the same, ordered per key): an event whose payload names a ``gate`` holds its
  job until the test opens it (row ``open:<gate>`` in ``mig_flags``): jobs running, and an
  ordered key's later job pending, across the upgrade. Other events run at once.
* ``slow_tx`` (``mig.slow``, transactional, 300 s lease: the transaction's idle timeout): publishes a follow-up event on
  ``mig.work`` (payload ``{"follow_up_of": <event id>}``) in the job's transaction, says so
  (``holding:<gate>``, committed apart), then waits for its gate before its fenced write and
  the completion: while it waits its transaction holds a lock on ``outbox_events``, as a
  handler that publishes and then works does.
* ``poison`` (``mig.poison``): :class:`~outbox.PermanentError`, dead at once.
* ``later`` (``mig.later``, lease mode): paused by the test, so its jobs stay ready across the
  upgrade; records its run.

:data:`TABLES` creates the test's tables. Nothing is read at import time; the handlers
reach the database through ``OUTBOX_DATABASE_URL``, as the relay does.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

import outbox
from outbox import Job, Outbox, PermanentError, admin, fenced_write, publish
from outbox.db.engine import make_engine

log = logging.getLogger("tests.migration_app")

#: topic -> the consumers subscribed to it.
SUBSCRIBERS = {
    "mig.work": {"work_lease", "work_tx"},
    "mig.hold": {"holder"},
    "mig.seq": {"seq"},
    "mig.slow": {"slow_tx"},
    "mig.poison": {"poison"},
    "mig.later": {"later"},
}
LEASE_MODE = {"work_lease", "holder", "seq", "poison", "later"}
TRANSACTIONAL = {"work_tx", "slow_tx"}

TABLES = """
CREATE TABLE mig_runs (id bigserial PRIMARY KEY, job_id bigint NOT NULL, event_id bigint NOT NULL,
    consumer text NOT NULL, key text, fence bigint NOT NULL, attempt int NOT NULL, lease_lost boolean NOT NULL,
    pid int NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE TABLE mig_tx_log (id bigserial PRIMARY KEY, job_id bigint NOT NULL, event_id bigint NOT NULL,
    consumer text NOT NULL, fence bigint NOT NULL);
CREATE TABLE mig_effects (event_id bigint PRIMARY KEY, consumer text NOT NULL, fence bigint NOT NULL);
CREATE TABLE mig_flags (name text PRIMARY KEY);
"""

effects = sa.Table(
    "mig_effects", sa.MetaData(),
    sa.Column("event_id", sa.BigInteger, primary_key=True, autoincrement=False),
    sa.Column("consumer", sa.Text, nullable=False),
    sa.Column("fence", sa.BigInteger, nullable=False),
)

_engine: sa.Engine | None = None

#: Longest a gated handler waits for its gate, seconds (then it fails: the test is stuck).
GATE_WAIT = 120.0


def engine() -> sa.Engine:
    """The handlers' own engine on ``OUTBOX_DATABASE_URL``, made on first use."""
    global _engine
    if _engine is None:
        _engine = make_engine(os.environ["OUTBOX_DATABASE_URL"], pool_size=4, application_name="migration-app")
    return _engine


def flag(name: str) -> None:
    with engine().begin() as conn:
        conn.execute(sa.text("INSERT INTO mig_flags (name) VALUES (:n) ON CONFLICT DO NOTHING"), {"n": name})


def wait_gate(job: Job) -> None:
    """Return once the test opened the gate the job's payload names (none: at once)."""
    gate = job.payload.get("gate") if isinstance(job.payload, dict) else None
    if gate is None:
        return
    deadline = time.monotonic() + GATE_WAIT
    while time.monotonic() < deadline:
        with engine().connect() as conn:
            if conn.execute(sa.text("SELECT 1 FROM mig_flags WHERE name = :n"), {"n": f"open:{gate}"}).first():
                return
        time.sleep(0.05)
    raise RuntimeError(f"gate {gate} was never opened")


def record(job: Job) -> None:
    """One committed row in ``mig_runs`` for this execution."""
    with engine().begin() as conn:
        conn.execute(sa.text(
            "INSERT INTO mig_runs (job_id, event_id, consumer, key, fence, attempt, lease_lost, pid)"
            " VALUES (:job, :event, :consumer, :key, :fence, :attempt, :lost, :pid)"),
            {"job": job.id, "event": job.event_id, "consumer": job.consumer, "key": job.key, "fence": job.fence,
             "attempt": job.attempt, "lost": job.lease_lost, "pid": os.getpid()})


def held(job: Job) -> None:
    wait_gate(job)
    record(job)


def transactional_effect(job: Job, session: Session) -> None:
    session.execute(sa.text("INSERT INTO mig_tx_log (job_id, event_id, consumer, fence)"
                            " VALUES (:job, :event, :consumer, :fence)"),
                    {"job": job.id, "event": job.event_id, "consumer": job.consumer, "fence": job.fence})
    fenced_write(session, effects, key={"event_id": job.event_id}, values={"consumer": job.consumer},
                 fence=job.fence)


def slow(job: Job, session: Session) -> None:
    publish(session, "mig.work", {"follow_up_of": job.event_id})
    flag(f"holding:{job.payload['gate']}")
    wait_gate(job)
    transactional_effect(job, session)


def poison(job: Job) -> None:
    record(job)
    raise PermanentError(f"event {job.event_id} cannot be handled")


def app() -> Outbox:
    """The registry (module notes)."""
    log.info("migration_app: outbox from %s", Path(outbox.__file__).parent)
    ob = Outbox()
    ob.subscriber("mig.work", consumer="work_lease")(record)
    ob.subscriber("mig.work", consumer="work_tx", transactional=True)(transactional_effect)
    ob.subscriber("mig.hold", consumer="holder", lease=12.0)(held)
    ob.subscriber("mig.seq", consumer="seq", lease=12.0, ordered=True)(held)
    ob.subscriber("mig.slow", consumer="slow_tx", lease=300.0, transactional=True)(slow)
    ob.subscriber("mig.poison", consumer="poison")(poison)
    ob.subscriber("mig.later", consumer="later")(record)
    return ob


# ----------------------------------------------------------------- the test's client


def publish_events(topic: str, payloads: list[Any], key: str | None) -> list[int]:
    """Publish each payload on ``topic`` in a transaction of its own, in order."""
    ids = []
    for payload in payloads:
        with Session(engine()) as s, s.begin():
            ids.append(publish(s, topic, payload, key=key))
    return ids


class Stream:
    """A thread committing one transaction after another until stopped, each publishing an
    event on ``mig.work`` and one on ``mig.seq`` (key ``s<n % 3>``), ``pause`` seconds
    apart; ``ids`` holds the events committed, ``error`` the publish that failed (it stops)."""

    def __init__(self, pause: float) -> None:
        self.pause = pause
        self.ids: list[int] = []
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stream", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        n = 0
        try:
            while not self._stop.is_set():
                with Session(engine()) as s, s.begin():
                    ids = [publish(s, "mig.work", {"n": n, "stream": True}),
                           publish(s, "mig.seq", {"n": n}, key=f"s{n % 3}")]
                self.ids += ids
                n += 1
                self._stop.wait(self.pause)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            self.error = repr(exc)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)


def serve() -> None:
    """The test's client of this release: one JSON command per line of stdin, one JSON reply
    per line of stdout, ``{"outbox": <package>, ...}``, or ``{"error": ...}`` when the command
    failed. Commands (``op``): ``pause`` (``consumer``; :func:`outbox.admin.pause`),
    ``publish`` (``batches``: ``[[topic, [payload, ...], key or null], ...]``, one transaction
    per event; replies ``ids`` per batch), ``cancel`` (``ids``; :func:`outbox.admin.cancel`,
    replies ``cancelled`` and ``requested``), ``stream_start`` (``pause``: seconds),
    ``stream_count`` (``count``, ``error``) and ``stream_stop`` (``ids``, ``error``)."""
    stream: Stream | None = None
    package = str(Path(outbox.__file__).parent)
    print(json.dumps({"outbox": package}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        reply: dict[str, Any] = {}
        try:
            if op == "pause":
                with engine().begin() as conn:
                    admin.pause(conn, command["consumer"])
            elif op == "publish":
                reply["ids"] = [publish_events(topic, payloads, key) for topic, payloads, key in command["batches"]]
            elif op == "cancel":
                result = admin.cancel(engine(), command["ids"])
                reply.update(cancelled=result.cancelled, requested=result.requested)
            elif op == "stream_start":
                stream = Stream(command["pause"])
            elif op == "stream_count":
                assert stream is not None
                reply.update(count=len(stream.ids), error=stream.error)
            elif op == "stream_stop":
                assert stream is not None
                stream.stop()
                reply.update(ids=stream.ids, error=stream.error)
            else:
                raise ValueError(f"unknown command {op!r}")
        except Exception as exc:  # noqa: BLE001 - reported to the test
            reply = {"error": repr(exc)}
        print(json.dumps({"outbox": package, **reply}), flush=True)


if __name__ == "__main__":
    serve()
