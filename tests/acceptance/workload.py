"""The fault suite's workload: an application module the relays run
(``--app tests.acceptance.workload:app``, a factory), the publisher that feeds it and the invariant
checker every scenario ends with (issue 3, section 1).

Three consumers of topic ``wl.order``, each showing one guarantee:

* ``ledger`` (lease mode, 8 attempts): records each run in ``wl_runs`` (start and end,
  autocommit), works a few milliseconds, then writes ``wl_ledger`` with
  :func:`outbox.fenced_write` on its own autocommit connection. Being at-least-once it may
  write the same row several times; each write must carry a higher fence than the last.
* ``invoice`` (transactional, 5 attempts): reads the domain row and writes ``wl_invoices``
  with ``fenced_write`` in the transaction that completes the job, so the write commits
  exactly once per done job. Some events (``n % 7 == 3``) wait inside that transaction
  before writing, so a paused relay is likely to hold one open; some (``n % 13 == 4``)
  raise :class:`~outbox.PermanentError` after writing, so the write must roll back.
* ``flaky`` (lease mode, 3 attempts): ``n % 10 == 0`` raises ``PermanentError`` (dead at
  once), ``n % 10 == 1`` always fails transiently (dead after 3 attempts), other
  ``n % 3 == 0`` fail on their first attempt only. Events published with
  ``crash_last=True`` fail until their last attempt, then hold the job until the relay is
  killed (the "crash on the last attempt" scenario).

* ``sequence`` (transactional, ordered per key, 8 attempts): every event carries the key
  ``acct:<n % 50>``; the handler appends the event to its key's sequence in
  ``wl_sequence`` (its position: one more than the key's events applied so far) with
  ``fenced_write`` in the transaction that completes the job. Some events (``n % 11 == 5``)
  fail their first attempt, so a retry must hold its key's later events back. The check:
  every key's applied sequence is its events in commit order (the publisher commits one
  transaction at a time, in ``n`` order), with no gap and nothing applied twice.

* ``to_stream`` (a forwarder, 8 attempts), only when the scenario made a JetStream stream
  and named it in ``WL_STREAM``: each event goes to ``<stream>.wl.order``. The check: the
  stream holds exactly one message per event (``Outbox-Event-Id``, ``Nats-Msg-Id``
  ``to_stream:<event id>``), whatever the faults made the relays re-send, none for an event
  of a rolled-back transaction, each body the event's ``payload::text`` byte for byte. Where
  NATS is unreachable or nats-py is missing the forwarder is left out and the report says
  the section was skipped.

* ``to_kafka`` (a forwarder, 8 attempts), only when the scenario started a Kafka-protocol
  broker (``tests.acceptance.kafka_broker``) and named its topic in ``WL_KAFKA_TOPIC`` (on
  ``WL_KAFKA_BOOTSTRAP``). Kafka is at-least-once across producer sessions (a relay killed
  after the acknowledgement, another relay's re-send), so the check is: every event whose
  job is done has a record, every record is of a committed event (none of a rolled-back
  transaction), its body the event's ``payload::text`` byte for byte and its
  ``Outbox-Idempotency-Key`` ``to_kafka:<event id>``; copies beyond the first are counted,
  and may come only from jobs handed out more than once. Where the broker cannot run the
  forwarder is left out and the report says so.

The fenced tables carry an ``AFTER`` row trigger (it fires only for a write that was
applied, not for an ``ON CONFLICT`` that did nothing) that appends the write to
``wl_fence_history`` in the writing transaction and raises if it lowered or kept the
stored fence; a handler that meets that error records it in
``wl_violations`` (autocommit) before failing. So "no fenced row was ever overwritten by a
lower fence" is checked by the database, not inferred.

The relays' environment tunes the handlers: ``WL_WORK_MS`` (mean handler time, default
10), ``WL_SLOW_MS`` (wait of slow invoices, default 300) and ``WL_HOLD=1`` (ledger runs of
events published with ``hold`` seconds wait that long, until their lease is lost).
Nothing is read at import time.
"""

from __future__ import annotations

import json
import os
import random
import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from outbox import Job, Outbox, PermanentError, fenced_write, publish_many
from outbox.db.engine import make_engine

TOPIC = "wl.order"
CONSUMERS = ("flaky", "invoice", "ledger", "sequence")
#: The forwarding consumer (JetStream), declared only when the scenario gave it a stream.
FORWARDER = "to_stream"
#: The forwarding consumer (Kafka), declared only when the scenario gave it a topic.
KAFKA_FORWARDER = "to_kafka"
#: Keys of the ordered consumer: event ``n`` belongs to ``acct:<n % KEYS>``.
KEYS = 50
LEASE_MODE = ("flaky", "ledger")

# ------------------------------------------------------------------------ tables

metadata = sa.MetaData()

domain = sa.Table(  # the application's own rows, written with each event
    "wl_domain", metadata,
    sa.Column("n", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("batch", sa.Integer, nullable=False),
)
rolled_back = sa.Table(  # events whose transaction (or savepoint) was rolled back on purpose
    "wl_rolled_back", metadata,
    sa.Column("n", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("how", sa.Text, nullable=False),
)
runs = sa.Table(
    "wl_runs", metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
    sa.Column("consumer", sa.Text, nullable=False),
    sa.Column("job_id", sa.BigInteger, nullable=False),
    sa.Column("event_id", sa.BigInteger, nullable=False),
    sa.Column("n", sa.Integer, nullable=False),
    sa.Column("attempt", sa.Integer, nullable=False),
    sa.Column("fence", sa.BigInteger, nullable=False),
    sa.Column("pid", sa.Integer, nullable=False),
    sa.Column("phase", sa.Text, nullable=False),  # start | slow | end
    sa.Column("at", sa.DateTime(timezone=True), nullable=False, server_default=sa.text("clock_timestamp()")),
)
ledger_rows = sa.Table(
    "wl_ledger", metadata,
    sa.Column("event_id", sa.BigInteger, primary_key=True, autoincrement=False),
    sa.Column("n", sa.Integer, nullable=False),
    sa.Column("job_id", sa.BigInteger, nullable=False),
    sa.Column("fence", sa.BigInteger, nullable=False),
)
invoices = sa.Table(
    "wl_invoices", metadata,
    sa.Column("event_id", sa.BigInteger, primary_key=True, autoincrement=False),
    sa.Column("n", sa.Integer, nullable=False),
    sa.Column("job_id", sa.BigInteger, nullable=False),
    sa.Column("fence", sa.BigInteger, nullable=False),
)
sequence_rows = sa.Table(  # the ordered consumer's effects: position of each event in its key
    "wl_sequence", metadata,
    sa.Column("event_id", sa.BigInteger, primary_key=True, autoincrement=False),
    sa.Column("key", sa.Text, nullable=False),
    sa.Column("n", sa.Integer, nullable=False),
    sa.Column("position", sa.Integer, nullable=False),
    sa.Column("job_id", sa.BigInteger, nullable=False),
    sa.Column("fence", sa.BigInteger, nullable=False),
)
fence_history = sa.Table(  # every applied write to a fenced table, in its own transaction
    "wl_fence_history", metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
    sa.Column("tbl", sa.Text, nullable=False),
    sa.Column("event_id", sa.BigInteger, nullable=False),
    sa.Column("old_fence", sa.BigInteger),
    sa.Column("new_fence", sa.BigInteger, nullable=False),
)
stale_writes = sa.Table(  # fenced writes refused because a newer fence wrote first
    "wl_stale_writes", metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
    sa.Column("consumer", sa.Text, nullable=False),
    sa.Column("job_id", sa.BigInteger, nullable=False),
    sa.Column("fence", sa.BigInteger, nullable=False),
    sa.Column("pid", sa.Integer, nullable=False),
)
violations = sa.Table(  # a fenced write that lowered a fence (must stay empty)
    "wl_violations", metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
    sa.Column("detail", sa.Text, nullable=False),
)

FENCE_GUARD_DDL = (
    """
    CREATE FUNCTION wl_fence_guard() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        IF TG_OP = 'UPDATE' AND NEW.fence <= OLD.fence THEN
            RAISE EXCEPTION 'WL fence regression on % event %: % -> %',
                TG_TABLE_NAME, NEW.event_id, OLD.fence, NEW.fence;
        END IF;
        INSERT INTO wl_fence_history (tbl, event_id, old_fence, new_fence)
        VALUES (TG_TABLE_NAME, NEW.event_id, CASE WHEN TG_OP = 'UPDATE' THEN OLD.fence END, NEW.fence);
        RETURN NULL;
    END $$
    """,
    "CREATE TRIGGER wl_ledger_guard AFTER INSERT OR UPDATE ON wl_ledger"
    " FOR EACH ROW EXECUTE FUNCTION wl_fence_guard()",
    "CREATE TRIGGER wl_invoices_guard AFTER INSERT OR UPDATE ON wl_invoices"
    " FOR EACH ROW EXECUTE FUNCTION wl_fence_guard()",
    "CREATE TRIGGER wl_sequence_guard AFTER INSERT OR UPDATE ON wl_sequence"
    " FOR EACH ROW EXECUTE FUNCTION wl_fence_guard()",
)


def create_tables(engine: Engine) -> None:
    """Create the workload's tables and the fence guard in ``engine``'s database."""
    metadata.create_all(engine)
    with engine.begin() as conn:
        for statement in FENCE_GUARD_DDL:
            conn.execute(sa.text(statement))


# ------------------------------------------------------------------ the handlers

_lock = threading.Lock()
_side: dict[str, Engine] = {}


def side_engine() -> Engine:
    """An autocommit engine on ``OUTBOX_DATABASE_URL`` for records that must outlive the
    handler's transaction; made on first use."""
    with _lock:
        if "engine" not in _side:
            engine = make_engine(os.environ["OUTBOX_DATABASE_URL"], pool_size=8, application_name="wl-app")
            _side["engine"] = engine.execution_options(isolation_level="AUTOCOMMIT")
        return _side["engine"]


def _env_ms(name: str, default: float) -> float:
    return float(os.environ.get(name, default)) / 1000.0


def _key_story(engine: Engine, key: str) -> str:
    """What happened to the ordered consumer's jobs of ``key``, for a failed ordering
    check: each job (event id, n, status, attempts, fence, routed, created, finished, its
    attempts' history) and each recorded run (attempt,
    fence, process, phase, database time), in time order."""
    with engine.connect() as conn:
        jobs = conn.execute(sa.text(
            "SELECT j.id, j.event_id, e.payload->>'n' AS n, j.status, j.attempts, j.fence, e.routed_at, j.created_at,"
            " j.finished_at, j.history"
            " FROM outbox_jobs j JOIN outbox_events e ON e.id = j.event_id"
            " WHERE j.consumer = 'sequence' AND e.key = :key ORDER BY j.event_id"), {"key": key}).all()
        runs_ = conn.execute(sa.text(
            "SELECT n, job_id, attempt, fence, pid, phase, at FROM wl_runs"
            " WHERE consumer = 'sequence' AND job_id = ANY(:ids) ORDER BY at, id"), {"ids": [j.id for j in jobs]}).all()
    lines = [f"key {key}'s sequence jobs:"] + [f"  {tuple(j)}" for j in jobs]
    lines += ["its runs:"] + [f"  {tuple(r)}" for r in runs_]
    return "\n".join(lines)


def record(job: Job, phase: str) -> None:
    with side_engine().connect() as conn:
        conn.execute(runs.insert().values(
            consumer=job.consumer, job_id=job.id, event_id=job.event_id, n=job.payload["n"],
            attempt=job.attempt, fence=job.fence, pid=os.getpid(), phase=phase))


def _work(job: Job) -> None:
    """About ``WL_WORK_MS`` of work (0.5x..1.5x); wakes early if the lease is lost."""
    mean = _env_ms("WL_WORK_MS", 10)
    job.wait_lease_lost(random.uniform(0.5 * mean, 1.5 * mean))


def _guarded(job: Job, write: Any) -> bool:
    """Run a fenced write; record a refused one in ``wl_stale_writes`` and a fence
    regression (the guard trigger fired) in ``wl_violations`` before re-raising it."""
    try:
        applied = write()
    except DBAPIError as exc:
        if "WL fence regression" in str(exc.orig):
            with side_engine().connect() as conn:
                conn.execute(violations.insert().values(detail=str(exc.orig).splitlines()[0]))
        raise
    if not applied:
        with side_engine().connect() as conn:
            conn.execute(stale_writes.insert().values(
                consumer=job.consumer, job_id=job.id, fence=job.fence, pid=os.getpid()))
    return applied


class Transient(Exception):
    """A failure worth retrying (the remote side asked to try again later)."""


def ledger(job: Job) -> None:
    """At-least-once: every run that gets this far writes the ledger row, fenced."""
    record(job, "start")
    hold = job.payload.get("hold")
    if hold and os.environ.get("WL_HOLD") == "1":
        job.wait_lease_lost(hold)  # stays in flight until released (SIGTERM) or the time is up
    else:
        _work(job)
    values = {"n": job.payload["n"], "job_id": job.id}

    def write() -> bool:
        with side_engine().connect() as conn:
            return fenced_write(conn, ledger_rows, key={"event_id": job.event_id}, values=values, fence=job.fence)

    _guarded(job, write)
    record(job, "end")


def invoice(job: Job, session: Session) -> None:
    """Exactly-once effect: the invoice commits with the job's fenced completion."""
    n = job.payload["n"]
    record(job, "start")
    session.execute(sa.select(domain.c.batch).where(domain.c.n == n)).scalar_one()
    if n % 7 == 3:
        record(job, "slow")
        time.sleep(_env_ms("WL_SLOW_MS", 300))  # inside the open transaction, like a slow query
    else:
        _work(job)
    _guarded(job, lambda: fenced_write(session, invoices, key={"event_id": job.event_id},
                                       values={"n": n, "job_id": job.id}, fence=job.fence))
    if n % 13 == 4:
        raise PermanentError(f"invoice for order {n} refused after writing it; the write must roll back")
    record(job, "end")


def sequence(job: Job, session: Session) -> None:
    """Ordered per key: appends the event to its key's sequence, exactly once."""
    n = job.payload["n"]
    record(job, "start")
    _work(job)
    if n % 11 == 5 and job.attempt == 1:
        raise Transient(f"order {n}: sequence service busy (attempt {job.attempt})")
    applied = session.execute(sa.select(sa.func.count()).select_from(sequence_rows)
                              .where(sequence_rows.c.key == job.key)).scalar_one()
    _guarded(job, lambda: fenced_write(session, sequence_rows, key={"event_id": job.event_id},
                                       values={"key": job.key, "n": n, "position": applied + 1, "job_id": job.id},
                                       fence=job.fence))
    record(job, "end")


def flaky(job: Job) -> None:
    """Fails often: permanently, always, once, or (crash_last) on all but the last attempt."""
    n = job.payload["n"]
    record(job, "start")
    _work(job)
    if job.payload.get("crash_last"):
        if job.attempt < job.max_attempts:
            raise Transient(f"order {n}: try again (attempt {job.attempt})")
        record(job, "hold")
        job.wait_lease_lost(120)  # the test kills this relay now
        return
    if n % 10 == 0:
        raise PermanentError(f"order {n}: rejected for good")
    if n % 10 == 1 or (n % 3 == 0 and job.attempt == 1):
        raise Transient(f"order {n}: service busy (attempt {job.attempt})")
    record(job, "end")


def app() -> Outbox:
    """The registry the relays run (``--app tests.acceptance.workload:app``): the four
    handlers, and the forwarder ``to_stream`` when ``WL_STREAM`` names a JetStream stream
    (subjects ``<WL_STREAM>.>``, on ``WL_NATS_URL``, default ``nats://127.0.0.1:4222``)."""
    ob = Outbox()
    ob.subscriber(TOPIC, consumer="ledger", max_attempts=8)(ledger)
    ob.subscriber(TOPIC, consumer="invoice", transactional=True, max_attempts=5)(invoice)
    ob.subscriber(TOPIC, consumer="sequence", transactional=True, ordered=True, max_attempts=8)(sequence)
    ob.subscriber(TOPIC, consumer="flaky", max_attempts=3)(flaky)
    stream = os.environ.get("WL_STREAM")
    if stream:
        from outbox import JetStream

        ob.forward(TOPIC, to=JetStream(os.environ.get("WL_NATS_URL", "nats://127.0.0.1:4222"),
                                       subject=stream + ".{topic}", stream=stream),
                   consumer=FORWARDER, max_attempts=8)
    topic = os.environ.get("WL_KAFKA_TOPIC")
    if topic:
        from outbox import Kafka

        ob.forward(TOPIC, to=Kafka(os.environ["WL_KAFKA_BOOTSTRAP"], topic=topic), consumer=KAFKA_FORWARDER,
                   max_attempts=8)
    return ob


# ------------------------------------------------------------------ expectations

#: last_error prefixes of failures the faults themselves cause: a lease that expired after
#: a kill or pause, a connection cut under a handler.
FAULT_ERRORS = re.compile(r"^(LeaseExpired|OperationalError|DatabaseError|InterfaceError|AdminShutdown"
                          r"|ConnectionFailure|psycopg\.|sqlalchemy\.)")


def expected(consumer: str, payload: dict[str, Any]) -> str:
    """How a job must end by its consumer's policy: ``done``, ``dead`` (a permanent error),
    ``exhausted`` (dead after max_attempts transient failures) or ``lease_dead`` (dead
    because the lease of its last attempt expired)."""
    n = payload["n"]
    if consumer == "flaky":
        if payload.get("crash_last"):
            return "lease_dead"
        if n % 10 == 0:
            return "dead"
        if n % 10 == 1:
            return "exhausted"
    if consumer == "invoice" and n % 13 == 4:
        return "dead"
    return "done"


# --------------------------------------------------------------------- publisher


@dataclass
class Published:
    """What the publisher did: ``committed`` n values, ``rolled_back`` ones (on purpose)
    and ``unknown`` ones (the transaction failed on a database error, for instance during
    a server restart: committed or not, but atomically)."""

    committed: set[int] = field(default_factory=set)
    rolled_back: set[int] = field(default_factory=set)
    unknown: set[int] = field(default_factory=set)
    errors: list[str] = field(default_factory=list)


class Publisher(threading.Thread):
    """Publishes ``events`` events over ``duration`` seconds in domain transactions of 1..8
    events: each writes its ``wl_domain`` rows and the events together. About one in ten
    transactions is rolled back on purpose, and one in ten committed ones rolls a
    savepoint with one more event back; both are recorded in ``wl_rolled_back``."""

    def __init__(self, engine: Engine, events: int, duration: float, *, seed: int = 3, start_n: int = 1,
                 extra: dict[int, dict[str, Any]] | None = None) -> None:
        super().__init__(name="wl-publisher", daemon=True)
        self.engine = engine
        self.events = events
        self.duration = duration
        self.rng = random.Random(seed)
        self.next_n = start_n
        self.extra = extra or {}
        self.result = Published()
        self.stop = threading.Event()
        self.batches = 0

    def run(self) -> None:
        start = time.monotonic()
        published = 0
        while published < self.events and not self.stop.is_set():
            due = start + self.duration * published / self.events
            if self.stop.wait(max(0.0, due - time.monotonic())):
                return
            size = min(self.rng.randint(1, 8), self.events - published)
            self.publish_batch(size, roll_back=self.rng.random() < 0.1, savepoint=self.rng.random() < 0.1)
            published += size

    def _take(self, size: int) -> list[int]:
        ns = list(range(self.next_n, self.next_n + size))
        self.next_n += size
        return ns

    def payload(self, n: int) -> dict[str, Any]:
        return {"n": n, "customer": f"c{n % 17}", **self.extra.get(n, {})}

    def publish_batch(self, size: int, *, roll_back: bool = False, savepoint: bool = False) -> list[int]:
        """One domain transaction of ``size`` events; returns their n values."""
        ns = self._take(size)
        lost = self._take(1) if savepoint and not roll_back else []
        self.batches += 1
        lost_done = False
        try:
            with Session(self.engine) as s, s.begin():
                s.execute(domain.insert(), [{"n": n, "batch": self.batches} for n in ns])
                publish_many(s, [{"topic": TOPIC, "payload": self.payload(n), "key": f"acct:{n % KEYS}"} for n in ns])
                if lost:
                    with s.begin_nested() as nested:
                        s.execute(domain.insert(), [{"n": n, "batch": self.batches} for n in lost])
                        publish_many(s, [{"topic": TOPIC, "payload": self.payload(n), "key": f"acct:{n % KEYS}"}
                                         for n in lost])
                        nested.rollback()
                    lost_done = True
                if roll_back:
                    raise _RollBack()
        except _RollBack:
            self._rolled_back(ns, "transaction")
            return ns
        except DBAPIError as exc:
            self.result.unknown.update(ns)
            if lost_done:
                self._rolled_back(lost, "savepoint")
            else:
                self.result.unknown.update(lost)
            self.result.errors.append(str(exc.orig).splitlines()[0] if exc.orig else str(exc))
            time.sleep(0.2)  # pacing while the database is away, not synchronisation
            return ns
        self.result.committed.update(ns)
        if lost:
            self._rolled_back(lost, "savepoint")
        return ns

    def _rolled_back(self, ns: list[int], how: str) -> None:
        self.result.rolled_back.update(ns)
        try:
            with self.engine.begin() as conn:
                conn.execute(rolled_back.insert(), [{"n": n, "how": how} for n in ns])
        except DBAPIError:
            pass  # the Python side keeps the record too


class _RollBack(Exception):
    """Raised inside a domain transaction to roll it back on purpose."""


# ------------------------------------------------------------------- invariants


def drained(engine: Engine, published: Published) -> bool:
    """Every known-committed event exists, none is unrouted, every job is done or dead."""
    with engine.connect() as conn:
        row = conn.execute(sa.text(
            "SELECT (SELECT count(*) FROM outbox_events WHERE topic = :t),"
            " (SELECT count(*) FROM outbox_events WHERE routed_at IS NULL),"
            " (SELECT count(*) FROM outbox_jobs WHERE status IN ('ready', 'running', 'pending'))"), {"t": TOPIC}).one()
    return row[0] >= len(published.committed) and row[1] == 0 and row[2] == 0


def progress(engine: Engine) -> str:
    """One line: jobs per status, for failure messages."""
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT status, count(*) FROM outbox_jobs GROUP BY 1 ORDER BY 1")).all()
    return ", ".join(f"{s}={n}" for s, n in rows) or "no jobs"


@dataclass
class Report:
    """The invariant check: failures (empty when every invariant holds) and counts."""

    failures: list[str]
    counts: dict[str, Any]

    def __bool__(self) -> bool:
        return not self.failures

    def __str__(self) -> str:
        lines = [f"{len(self.failures)} invariant(s) failed" if self.failures else "all invariants hold"]
        lines += [f"  FAIL {f}" for f in self.failures]
        lines += [f"  {k}: {v}" for k, v in self.counts.items()]
        return "\n".join(lines)


def check(engine: Engine, published: Published, *, fault_dead_allowed: int = 0,
          unstarted_dead_allowed: int | None = None,
          expect: Callable[[str, dict[str, Any]], str | None] | None = None,
          stream: Any = None, kafka: Any = None) -> Report:
    """Check issue 3's invariants against the database once the work has drained.

    ``fault_dead_allowed``: how many jobs whose handler would have succeeded may end dead
    because faults (lease expiries, cut connections) used up all their attempts.
    ``unstarted_dead_allowed`` (default: the same): how many of those may lack a recorded
    start (``wl_runs``) for one of their attempts, i.e. were charged an attempt whose
    handler never ran: 0 where the only faults are kills, since a crash never charges a job
    whose handler had not started.
    ``expect(consumer, payload)`` overrides :func:`expected` where it returns a policy.
    ``stream``: the scenario's JetStream stream (``messages()`` returns what it stores) when
    the relays ran the forwarder ``to_stream``, else a string saying why they did not (the
    forwarder's section is then skipped) or None (no forwarder, nothing said). ``kafka``:
    the same for ``to_kafka``, an object whose ``records()`` returns every record of its
    topic (:class:`~tests.acceptance.kafka_broker.Record`).
    The forwarder's jobs leave no record per attempt, so the ``unstarted_dead_allowed``
    count leaves them out.
    """
    if unstarted_dead_allowed is None:
        unstarted_dead_allowed = fault_dead_allowed
    failures: list[str] = []
    forwarding = stream is not None and not isinstance(stream, str)
    to_kafka = kafka is not None and not isinstance(kafka, str)
    consumers = set(CONSUMERS) | ({FORWARDER} if forwarding else set()) | ({KAFKA_FORWARDER} if to_kafka else set())
    forwarders = {FORWARDER, KAFKA_FORWARDER}

    def fail(ok: bool, text: str, sample: Any = None) -> None:
        if not ok:
            failures.append(text + (f" (e.g. {sorted(sample)[:8] if isinstance(sample, set) else sample})"
                                    if sample else ""))

    with engine.connect() as conn:
        q = lambda sql, **p: conn.execute(sa.text(sql), p).all()  # noqa: E731
        events = q("SELECT id, payload, routed_at FROM outbox_events WHERE topic = :t", t=TOPIC)
        jobs = q("SELECT j.id, j.event_id, j.consumer, j.status, j.attempts, j.max_attempts, j.fence,"
                 " j.last_error, j.finished_at, e.payload FROM outbox_jobs j JOIN outbox_events e ON e.id = j.event_id")
        domain_ns = {r[0] for r in q("SELECT n FROM wl_domain")}
        recorded_rolled = {r[0] for r in q("SELECT n FROM wl_rolled_back")}
        ended = {(r[0], r[1]) for r in q("SELECT job_id, fence FROM wl_runs WHERE phase = 'end'")}
        run_ns = {r[0] for r in q("SELECT DISTINCT n FROM wl_runs")}
        started = Counter(r[0] for r in q("SELECT DISTINCT job_id, attempt FROM wl_runs WHERE phase = 'start'"))
        ledger = {r[0]: (r[1], r[2]) for r in q("SELECT event_id, fence, n FROM wl_ledger")}
        invoice = {r[0]: (r[1], r[2]) for r in q("SELECT event_id, fence, n FROM wl_invoices")}
        history = q("SELECT tbl, event_id, old_fence, new_fence FROM wl_fence_history ORDER BY id")
        violation_rows = [r[0] for r in q("SELECT detail FROM wl_violations")]
        stale = q("SELECT consumer, count(*) FROM wl_stale_writes GROUP BY 1")
        applied = q("SELECT key, n, position FROM wl_sequence ORDER BY key, position")
        subscribed = {r[0] for r in q("SELECT consumer FROM outbox_subscriptions WHERE topic = :t", t=TOPIC)}
        payload_text = {r[0]: r[1] for r in q("SELECT id, payload::text FROM outbox_events WHERE topic = :t", t=TOPIC)}

    # 1. Committed events exist exactly once; nothing of a rolled-back transaction does.
    event_ns = Counter(e.payload["n"] for e in events)
    fail(all(c == 1 for c in event_ns.values()), "an n was published as more than one event",
         {n for n, c in event_ns.items() if c > 1})
    ns = set(event_ns)
    fail(published.committed <= ns, "committed events missing", published.committed - ns)
    fail(ns <= published.committed | published.unknown, "events nobody committed", ns - published.committed - published.unknown)
    fail(ns == domain_ns, "events and domain rows differ (not atomic)", ns ^ domain_ns)
    gone = published.rolled_back | recorded_rolled
    fail(not (gone & ns), "events of rolled-back transactions exist", gone & ns)
    fail(not (gone & domain_ns), "domain rows of rolled-back transactions exist", gone & domain_ns)
    fail(not (gone & run_ns), "handlers ran for rolled-back events", gone & run_ns)
    fail(not (gone & ({v[1] for v in ledger.values()} | {v[1] for v in invoice.values()})),
         "effects of rolled-back events exist")

    # 2. Every event routed exactly once: one job per subscribed consumer.
    fail(subscribed == consumers, f"subscriptions are {sorted(subscribed)}")
    fail(all(e.routed_at is not None for e in events), "unrouted events", {e.id for e in events if e.routed_at is None})
    per_event = Counter((j.event_id, j.consumer) for j in jobs)
    fail(all(c == 1 for c in per_event.values()), "duplicate (event, consumer) jobs", {k for k, c in per_event.items() if c > 1})
    consumers_of: dict[int, set[str]] = {}
    for j in jobs:
        consumers_of.setdefault(j.event_id, set()).add(j.consumer)
    missing = {e.id for e in events if consumers_of.get(e.id) != consumers}
    fail(not missing, "events without exactly one job per consumer", missing)

    # 3. Every job ended as its policy says; attempts within bounds.
    outcomes: Counter[str] = Counter()
    fault_dead: list[int] = []
    for j in jobs:
        want = (expect and expect(j.consumer, j.payload)) or expected(j.consumer, j.payload)
        error = j.last_error or ""
        fail(j.attempts <= j.max_attempts, f"job {j.id} attempts {j.attempts} > max {j.max_attempts}")
        if j.status not in ("done", "dead"):
            fail(False, f"job {j.id} ({j.consumer}) ended {j.status}")
            continue
        fail(j.finished_at is not None, f"job {j.id} is {j.status} without finished_at")
        outcomes[f"{j.consumer}:{j.status}"] += 1
        if want == "done":
            if j.status == "dead":
                ok = j.attempts == j.max_attempts and bool(FAULT_ERRORS.match(error))
                fail(ok, f"job {j.id} ({j.consumer}, n={j.payload['n']}) should be done, is dead after "
                         f"{j.attempts}/{j.max_attempts}: {error[:200]}")
                fault_dead.append(j.id)
        elif want == "dead":
            fail(j.status == "dead", f"job {j.id} ({j.consumer}, n={j.payload['n']}) should be dead, is {j.status}")
            fail(j.status != "dead" or "PermanentError" in error or
                 (j.attempts == j.max_attempts and bool(FAULT_ERRORS.match(error))),
                 f"job {j.id} dead for the wrong reason: {error[:200]}")
        elif want == "exhausted":
            fail(j.status == "dead" and j.attempts == j.max_attempts,
                 f"job {j.id} ({j.consumer}) should be dead after {j.max_attempts} attempts: {j.status} {j.attempts}")
        elif want == "lease_dead":
            fail(j.status == "dead" and j.attempts == j.max_attempts and error.startswith("LeaseExpired"),
                 f"job {j.id} should be dead by an expired lease on its last attempt: {j.status} "
                 f"{j.attempts}/{j.max_attempts} {error[:120]}")
    fail(len(fault_dead) <= fault_dead_allowed,
         f"{len(fault_dead)} jobs that should succeed were dead-lettered by faults (allowed {fault_dead_allowed})",
         set(fault_dead))
    max_of = {j.id: j.max_attempts for j in jobs}
    forwarder_jobs = {j.id for j in jobs if j.consumer in forwarders}
    unstarted_dead = {i for i in fault_dead if started[i] < max_of[i] and i not in forwarder_jobs}
    fail(len(unstarted_dead) <= unstarted_dead_allowed,
         f"{len(unstarted_dead)} jobs were dead-lettered by faults with attempts whose handler never started "
         f"(allowed {unstarted_dead_allowed})", unstarted_dead)

    # 4. Effects: transactional exactly once per done job, none for dead ones; the
    #    ledger's row carries the done job's fence; lease-mode handlers ran per done job.
    history_count = Counter((h.tbl, h.event_id) for h in history)
    for j in jobs:
        if j.consumer == "invoice":
            writes = history_count[("wl_invoices", j.event_id)]
            if j.status == "done":
                fail(writes == 1 and invoice.get(j.event_id, (None,))[0] == j.fence,
                     f"invoice job {j.id} done at fence {j.fence}: {writes} committed writes, row {invoice.get(j.event_id)}")
            else:
                fail(writes == 0 and j.event_id not in invoice, f"dead invoice job {j.id} left {writes} writes")
        elif j.status == "done" and j.consumer not in forwarders:
            fail((j.id, j.fence) in ended, f"{j.consumer} job {j.id} done at fence {j.fence} with no run that ended at it")
            if j.consumer == "ledger":
                fail(ledger.get(j.event_id, (None,))[0] == j.fence,
                     f"ledger job {j.id} done at fence {j.fence}, row has {ledger.get(j.event_id)}")

    # 5. No fenced row was ever overwritten by a lower (or equal) fence.
    fail(not violation_rows, "fence regressions were attempted", violation_rows[:3])
    last: dict[tuple[str, int], int] = {}
    regressions = []
    for h in history:
        k = (h.tbl, h.event_id)
        if h.old_fence != last.get(k) or (h.old_fence is not None and h.new_fence <= h.old_fence):
            regressions.append((k, h.old_fence, h.new_fence))
        last[k] = h.new_fence
    fail(not regressions, "fence history out of order", regressions[:5])

    # 6. Ordered per key: each key's applied sequence is its events in commit order (one
    #    publisher commits its transactions one after another, in n order), positions
    #    1..k with no gap, each event applied once (its history has one write).
    by_key: dict[str, list[Any]] = {}
    for r in applied:
        by_key.setdefault(r.key, []).append(r)
    for key, seq in by_key.items():
        fail([r.position for r in seq] == list(range(1, len(seq) + 1)),
             f"key {key}: positions {[r.position for r in seq][:12]} have gaps or repeats")
        in_order = [r.n for r in seq] == sorted(r.n for r in seq)
        fail(in_order, f"key {key} applied out of commit order: {[r.n for r in seq][:12]}")
        if not in_order:
            failures.append(_key_story(engine, key))
    sequence_done = {j.event_id for j in jobs if j.consumer == "sequence" and j.status == "done"}
    for key in {f"acct:{e.payload['n'] % KEYS}" for e in events}:
        want = sorted(e.payload["n"] for e in events if f"acct:{e.payload['n'] % KEYS}" == key)
        got = [r.n for r in by_key.get(key, [])]
        fail(got == want[:len(got)] and (len(got) == len(want) or not sequence_done),
             f"key {key}: applied {got[:12]}..., its events are {want[:12]}...")
    for j in jobs:
        if j.consumer == "sequence":
            writes = history_count[("wl_sequence", j.event_id)]
            fail(writes == (1 if j.status == "done" else 0), f"sequence job {j.id} ({j.status}): {writes} committed writes")

    # 7. The forwarder: exactly one message per event in the stream, whatever was re-sent;
    #    none of a rolled-back event; the body is the stored payload, byte for byte.
    stream_counts: Any = f"skipped: {stream}" if isinstance(stream, str) else "no forwarder"
    if forwarding:
        messages = stream.messages()
        stored = Counter(m.headers.get("Outbox-Event-Id") for m in messages)
        fail(all(c == 1 for c in stored.values()), "events stored more than once in the stream",
             {k for k, c in stored.items() if c > 1})
        ids = {int(k) for k in stored if k is not None}
        fail(None not in stored, "stream messages without Outbox-Event-Id")
        fail(ids <= set(payload_text), "stream messages of events that do not exist", ids - set(payload_text))
        done = {j.event_id for j in jobs if j.consumer == FORWARDER and j.status == "done"}
        fail(done <= ids, "forwarder jobs done without their message in the stream", done - ids)
        fail(len(ids) == len(events) or len(done) < len(events),
             f"{len(ids)} events in the stream, {len(events)} published")
        wrong_id = {m.headers.get("Outbox-Event-Id") for m in messages
                    if m.message_id != f"{FORWARDER}:{m.headers.get('Outbox-Event-Id')}"}
        fail(not wrong_id, "stream messages whose Nats-Msg-Id is not the job's idempotency key", wrong_id)
        wrong_body = {int(k) for m in messages if (k := m.headers.get("Outbox-Event-Id")) is not None
                      and int(k) in payload_text and m.body != payload_text[int(k)].encode()}
        fail(not wrong_body, "stream messages whose body differs from the event's payload::text", wrong_body)
        gone_sent = {n for m in messages if (n := json.loads(m.body).get("n")) in gone}
        fail(not gone_sent, "stream messages of rolled-back events", gone_sent)
        stream_counts = {"messages": len(messages), "events": len(ids),
                         "jobs_handed_out_again": sum(1 for j in jobs if j.consumer == FORWARDER and j.attempts > 1)}

    # 8. The Kafka forwarder: every done job's event has a record, every record is of a
    #    committed event, byte for byte; copies beyond the first only of jobs handed out again.
    kafka_counts: Any = f"skipped: {kafka}" if isinstance(kafka, str) else "no forwarder"
    if to_kafka:
        records = kafka.records()
        keyed = Counter(r.headers.get("Outbox-Event-Id") for r in records)
        fail(None not in keyed, "Kafka records without Outbox-Event-Id")
        ids = {int(k) for k in keyed if k is not None}
        fail(ids <= set(payload_text), "Kafka records of events that do not exist", ids - set(payload_text))
        kafka_jobs = {j.event_id: j for j in jobs if j.consumer == KAFKA_FORWARDER}
        done = {e for e, j in kafka_jobs.items() if j.status == "done"}
        fail(done <= ids, "Kafka forwarder jobs done without their record", done - ids)
        again = {str(e) for e, j in kafka_jobs.items() if j.attempts > 1}
        copies = {k for k, c in keyed.items() if c > 1}
        fail(copies <= again, "Kafka records stored twice for jobs sent once", copies - again)
        wrong_key = {r.headers.get("Outbox-Event-Id") for r in records
                     if r.headers.get("Outbox-Idempotency-Key") != f"{KAFKA_FORWARDER}:{r.headers.get('Outbox-Event-Id')}"}
        fail(not wrong_key, "Kafka records whose Outbox-Idempotency-Key is not the job's", wrong_key)
        wrong_body = {int(k) for r in records if (k := r.headers.get("Outbox-Event-Id")) is not None
                      and int(k) in payload_text and r.value != payload_text[int(k)].encode()}
        fail(not wrong_body, "Kafka records whose body differs from the event's payload::text", wrong_body)
        gone_sent = {n for r in records if (n := json.loads(r.value).get("n")) in gone}
        fail(not gone_sent, "Kafka records of rolled-back events", gone_sent)
        kafka_counts = {"records": len(records), "events": len(ids), "copies_beyond_first": len(records) - len(ids),
                        "jobs_handed_out_again": len(again)}

    counts = {
        "events": len(events), "committed": len(published.committed), "rolled_back": len(gone),
        "unknown": len(published.unknown), "jobs": len(jobs), "outcomes": dict(sorted(outcomes.items())),
        "fault_dead": len(fault_dead), "fault_dead_unstarted": len(unstarted_dead),
        "ledger_rewrites": sum(1 for h in history if h.tbl == "wl_ledger" and h.old_fence),
        "stale_writes": dict(stale), "ordered_keys": len(by_key), "stream": stream_counts, "kafka": kafka_counts,
    }
    return Report(failures, counts)
