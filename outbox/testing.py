"""Helpers for tests of outbox and of applications using it: jobs to hand to a handler,
the relay's work run in-process, a server to test against and throw-away databases on it.

:func:`make_job` builds a :class:`~outbox.Job` for a unit test of a handler.
:func:`drain` routes and runs every due job of a registry in the calling thread, with the
relay's own claim, handler execution (:class:`outbox.relay.executor.JobExecutor`) and fenced
statements, and returns how each attempt ended (Oban's ``drain_queue``, River's
``rivertest``); :func:`run_hooks` then makes the failure-hook calls its failures left due. The pytest fixtures of :mod:`outbox.pytest_plugin` give each test a
migrated database of its own.

:func:`server_url` picks the server: ``OUTBOX_TEST_DATABASE_URL``, else
``OUTBOX_DATABASE_URL``, else an embedded PostgreSQL (extra ``embedded``) started in a
temporary folder, stopped and deleted when the process exits. :func:`temporary_database`
creates a uniquely named database (from a template, when given) and drops it afterwards,
so tests never touch data they did not create; :class:`DatabaseCopies` makes such
databases ahead of need on a thread of its own, so a suite of many tests does not wait for
each creation.

Drain's rounds: each round routes every unrouted event (the registry's subscriptions
written first, as a relay does at start), then claims and runs the due jobs of the chosen
consumers one at a time until none is left that the round has not run: one attempt per
job per round. A job whose attempt failed is ``retried`` (back to ``ready`` after its
backoff, by the database clock) or ``dead``. Without ``run_retries`` a retried job is not
run again by the same call, even once its backoff has passed; with it, each round starts
by making every retry of the chosen consumers due at once (``job_retry_now_many``: ready
jobs with an attempt behind them, from this call or an earlier one; jobs never attempted
keep their ``run_at``), so retried jobs run again until they are done or dead. Rounds go on while a round ran something (a handler may publish events that other
consumers handle), at most ``max_rounds``: a round that would start past it raises
:class:`~outbox.errors.DrainLimitError`. Nothing heartbeats: a handler that runs past its
lease while a relay runs against the same database may lose its job to the reaper, and its
result is then reported ``stale``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import os
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal, TypeVar, cast

import psycopg
import sqlalchemy as sa
from sqlalchemy.engine import URL

from outbox.db import queries
from outbox.db.engine import make_async_engine, make_engine, parse_url
from outbox.db.jobs import complete_and_claim_after, complete_jobs, fail_jobs, job_from_row, release_jobs, snooze_jobs
from outbox.errors import (
    ConfigurationError,
    DrainLimitError,
    HandlerTimeoutError,
    InvalidEventError,
)
from outbox.job import Job
from outbox.publish import check_name
from outbox.registry import Outbox
from outbox.relay import ordering, transaction
from outbox.relay.executor import JobExecutor, WorkerContext
from outbox.relay.flow import FlowControl
from outbox.relay.outcomes import Failure, Outcome, Snoozed
from outbox.relay.router import register_subscriptions, route_all
from outbox.relay.watchdog import Watchdog
from outbox.settings import OutboxSettings

__all__ = [
    "DrainLimitError",
    "DatabaseCopies",
    "DrainResult",
    "create_database",
    "drain",
    "drop_database",
    "make_job",
    "migrated_template",
    "server_url",
    "temporary_database",
    "wait_for",
]

# ------------------------------------------------------------------------ make_job


def make_job(
    payload: Any = None,
    *,
    id: int = 1,  # noqa: A002 - the field's name
    event_id: int = 1,
    consumer: str = "test_consumer",
    topic: str = "test.topic",
    key: str | None = None,
    headers: dict[str, Any] | None = None,
    attempt: int = 1,
    max_attempts: int = 5,
    fence: int = 1,
    lease_seconds: float = 30.0,
    event_created_at: datetime | None = None,
) -> Job:
    """A :class:`~outbox.Job` as a handler receives it, for calling a handler directly in
    a unit test (no database involved). Every public field can be given by keyword;
    defaults: ``payload`` ``{}``, ``id`` 1, ``event_id`` 1, ``consumer``
    ``"test_consumer"``, ``topic`` ``"test.topic"``, ``key`` None, ``headers`` ``{}``,
    ``attempt`` 1 of ``max_attempts`` 5, ``fence`` 1, ``lease_seconds`` 30.0,
    ``event_created_at`` now (UTC). ``idempotency_key`` follows from them
    (``"test_consumer:1"``). The job's lease is never lost (``job.lease_lost`` stays False
    unless the test calls ``job.mark_lease_lost()``).

    Raises :class:`~outbox.errors.ConfigurationError` naming the field for an id, event id,
    fence or attempt count that is not a positive int, an ``attempt`` above
    ``max_attempts``, an empty topic or consumer, a lease that is not positive and finite, a
    ``key`` that is not a str, ``headers`` that are not a dict, or an ``event_created_at``
    that is not an aware datetime."""
    for name, value in (("id", id), ("event_id", event_id), ("fence", fence), ("attempt", attempt),
                        ("max_attempts", max_attempts)):
        if type(value) is not int or value < 1:
            raise ConfigurationError(f"make_job: {name} must be a positive int, got {value!r}")
    if attempt > max_attempts:
        raise ConfigurationError(f"make_job: attempt ({attempt}) must not exceed max_attempts ({max_attempts})")
    try:
        check_name(topic, "topic")
        check_name(consumer, "consumer")
    except InvalidEventError as exc:
        raise ConfigurationError(f"make_job: {exc}") from None
    if isinstance(lease_seconds, bool) or not isinstance(lease_seconds, (int, float)) \
            or not 0 < lease_seconds < math.inf:
        raise ConfigurationError(f"make_job: lease_seconds must be positive, finite seconds, got {lease_seconds!r}")
    if key is not None and type(key) is not str:
        raise ConfigurationError(f"make_job: key must be a str or None, got {type(key).__name__}")
    if headers is not None and not isinstance(headers, dict):
        raise ConfigurationError(f"make_job: headers must be a dict or None, got {type(headers).__name__}")
    if event_created_at is not None and (not isinstance(event_created_at, datetime) or event_created_at.tzinfo is None):
        raise ConfigurationError(f"make_job: event_created_at must be an aware datetime or None, got {event_created_at!r}")
    return Job(id, event_id, consumer, topic, key, {} if payload is None else payload,
               {} if headers is None else headers, attempt, max_attempts, fence, float(lease_seconds),
               event_created_at if event_created_at is not None else datetime.now(UTC))


# --------------------------------------------------------------------------- drain

#: ``locked_by`` of the jobs :func:`drain` claims.
DRAIN_WORKER_ID = "outbox.testing.drain"

DrainOutcome = Literal["done", "retried", "dead", "released", "snoozed", "cancelled", "superseded", "stale"]


@dataclass(frozen=True, slots=True)
class DrainResult:
    """How one attempt run by :func:`drain` ended.

    ``outcome``: ``"done"`` (completed; a transactional handler's writes committed with it),
    ``"retried"`` (failed, back to ``ready`` after its backoff), ``"dead"`` (failed with
    :class:`~outbox.PermanentError` or on its last attempt), ``"released"`` (handed back
    without counting the attempt: no database connection for a transactional handler, or
    its connection broke), ``"snoozed"`` (the handler raised :class:`~outbox.Snooze`: back to
    ``ready`` after the delay, the attempt not counted; like a retried job, run again only
    with ``run_retries``, once due), ``"cancelled"`` (a transactional handler's job an
    operator cancelled while it ran: its transaction rolled back, nothing of it committed),
    ``"superseded"`` (a coalescing consumer's job failed while a newer event of its key was
    routed: it does not run again) or
    ``"stale"`` (the claim was no longer drain's: another worker
    took the job, nothing was written). ``error`` is the job's ``last_error`` text for
    ``retried`` and ``dead`` (type, message, traceback), else None. ``attempt`` counts from 1."""

    job_id: int
    consumer: str
    event_id: int
    topic: str
    attempt: int
    outcome: DrainOutcome
    error: str | None = None


def drain(
    engine: sa.Engine,
    ob: Outbox,
    *,
    consumers: Collection[str] | None = None,
    run_retries: bool = False,
    run_scheduled: bool = False,
    max_rounds: int = 100,
    settings: OutboxSettings | None = None,
) -> list[DrainResult]:
    """Route every unrouted event and run every due job of ``ob``'s consumers (or only of
    ``consumers``) in the calling thread, on ``engine``'s database, until nothing is due;
    returns one :class:`DrainResult` per attempt, in the order they ran.

    The work is the relay's own: ``ob``'s subscriptions are written to
    ``outbox_subscriptions``, events are routed by ``event_route_many``, each job is claimed
    (fence, lease, attempt) and finished by the fenced statements the relay uses, and its
    handler runs through :class:`outbox.relay.executor.JobExecutor`: lease mode or transactional,
    ``def`` or ``async def`` (an ``async def`` handler runs on an event loop of drain's own;
    an async transactional one on an ``AsyncEngine`` made from ``engine.url`` for the call).
    One attempt per job per round; ``run_retries=True`` makes jobs waiting out a retry's
    backoff due at once and runs them again, round after round, until they are done or
    dead; otherwise each retried job is reported once and left waiting out its backoff
    (see the module's notes). Jobs of a delayed publish (``run_at=``, ``delay=``) wait for
    their time like in the relay, unless ``run_scheduled=True`` makes them due at once (as
    Oban's ``drain_queue(with_scheduled: true)``), in every round.
    ``settings`` gives the backoff, the default lease and the schema of outbox's tables
    (``schema_name``; default: ``OutboxSettings()``, the ``OUTBOX_*`` environment).

    Forwarders (:meth:`outbox.Outbox.forward`) are left out: their jobs are routed and
    stay ready, for a relay to send.

    Raises :class:`~outbox.errors.ConfigurationError` for a consumer not in ``ob`` or a
    forwarder named in ``consumers``, a
    ``max_rounds`` that is not a positive int, or ``async def`` handlers to run while an
    event loop is running in this thread (call ``await asyncio.to_thread(drain, ...)``);
    :class:`~outbox.errors.DrainLimitError` (with the results so far) when jobs are still
    due after ``max_rounds`` rounds; database errors of its own statements propagate.
    Handler failures never raise: they are results; but a ``KeyboardInterrupt`` or
    ``SystemExit`` from a handler (Ctrl-C in a test run) hands its job back, attempt not
    counted, and propagates."""
    if type(max_rounds) is not int or max_rounds < 1:
        raise ConfigurationError(f"drain: max_rounds must be a positive int, got {max_rounds!r}")
    chosen = [c for c in ob.consumers if ob[c].sink is None] if consumers is None else list(consumers)
    unknown = [c for c in chosen if c not in ob.consumers]
    if unknown or isinstance(consumers, str):
        raise ConfigurationError(f"drain: consumers {unknown or [consumers]!r} are not declared in the registry "
                                 f"(it declares {ob.consumers!r})")
    forwarders = [c for c in chosen if ob[c].sink is not None]
    if forwarders:
        raise ConfigurationError(f"drain: {forwarders!r} are forwarders: drain runs handlers, and a forwarder's jobs "
                                 "go to its broker, which a relay does (drain leaves them ready)")
    subscribers = {c: ob[c] for c in chosen}
    if any(s.is_async for s in subscribers.values()) and _loop_running():
        raise ConfigurationError("drain runs async def handlers on an event loop of its own, and this thread's loop "
                                 "is running: call it as `await asyncio.to_thread(drain, ...)`")
    settings = settings if settings is not None else OutboxSettings()
    schema = settings.schema_name
    register_subscriptions(engine, ob, settings)
    if not subscribers:
        route_all(engine, settings.route_batch, schema=schema)
        return []
    leases = {c: s.lease or settings.default_lease for c, s in subscribers.items()}
    # Consumers with a cap or rate limit are claimed on their own path, as by the relay.
    limited = FlowControl(subscribers, leases, DRAIN_WORKER_ID, settings.poll_interval, schema=schema)
    deadlines: dict[int, float] = {}  # fence -> time.monotonic() by which the claim's lease has surely run out
    # Handler timeouts as in the relay: an async def handler is cancelled; a def handler
    # runs in this thread and cannot be stopped, so the watchdog only marks it, and when it
    # returns, late, its attempt is recorded as timed out (drain waits for it meanwhile).
    watchdog = Watchdog(lambda job, seconds: None)
    if any(s.timeout is not None for s in subscribers.values()):
        threading.Thread(target=watchdog.run, name="outbox-drain-watchdog", daemon=True).start()
    executor = JobExecutor(settings, transaction.HandlerConnections(engine, settings.reconnect_max),
                           held=lambda job: time.monotonic() < deadlines.get(job.fence, 0.0),
                           stopping=threading.Event(), reraise_interrupts=True, watchdog=watchdog,
                           policies=ob.retry_policies(settings))
    context = WorkerContext(lambda: make_async_engine(engine.url, pool_size=1, max_overflow=0,
                                                      application_name="outbox-drain"))
    results: list[DrainResult] = []
    left_waiting: set[int] = set()  # retried jobs this call will not run again (no run_retries)
    rounds = 0
    try:
        while True:
            route_all(engine, settings.route_batch, schema=schema)
            if run_retries or run_scheduled:
                statements = queries.in_schema(schema)
                with _autocommit(engine) as conn:
                    if run_retries:
                        conn.execute(statements.job_retry_now_many, {"consumers": chosen})
                    if run_scheduled:
                        conn.execute(statements.job_scheduled_now_many, {"consumers": chosen})
            ran: set[int] = set()
            retried: list[int] = []
            while True:
                sent = time.monotonic()
                job = _claim_one(engine, leases, ran | left_waiting, schema, limited)
                if job is None:
                    break
                if not ran and rounds == max_rounds:
                    with _autocommit(engine) as conn:
                        release_jobs(conn, [job], schema=schema)
                    raise DrainLimitError(f"drain: jobs still due after {max_rounds} rounds (max_rounds); the "
                                          f"next was job {job.id} of {job.consumer}", results)
                ran.add(job.id)
                deadlines[job.fence] = sent + job.lease_seconds
                try:
                    outcome = executor.run(job, subscribers[job.consumer], context)
                    if outcome is Outcome.TIMED_OUT:
                        outcome = executor.failure(job, HandlerTimeoutError(subscribers[job.consumer].timeout or 0.0))
                except (KeyboardInterrupt, SystemExit):  # Ctrl-C in a test run: hand the job back, stop
                    with _autocommit(engine) as conn:
                        release_jobs(conn, [job], schema=schema)
                    raise
                result = _record(engine, job, outcome, schema, keep_done=settings.keep_done)
                if ordering.promotion_params([job], subscribers) is not None:  # its key's next job may go
                    with _autocommit(engine) as conn:
                        ordering.promote_finished(conn, [job], subscribers, schema=schema)
                del deadlines[job.fence]
                results.append(result)
                if result.outcome in ("retried", "snoozed"):
                    retried.append(job.id)
            if not ran:
                return results
            rounds += 1
            if not run_retries:
                left_waiting.update(retried)
    finally:
        watchdog.stop()
        context.close()


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _autocommit(engine: sa.Engine) -> sa.Connection:
    return engine.connect().execution_options(isolation_level="AUTOCOMMIT")


def _claim_one(engine: sa.Engine, leases: dict[str, float], skip: set[int], schema: str,
               limited: FlowControl) -> Job | None:
    """Claim the next due job of the consumers in ``leases`` (claim order), leaving out
    ``skip``; None when there is none. The main claim leaves out paused, capped and
    rate-limited consumers; the capped and rate-limited ones are claimed after it through
    ``limited`` (their caps and buckets apply: one job at a time never exceeds a cap, and a
    bucket that is empty ends the round). A job of ``skip`` the limited claim took is handed
    back (release: not counted) and ends the round."""
    with _autocommit(engine) as conn:
        _, claimed, _ = complete_and_claim_after(conn, [], leases, 1, DRAIN_WORKER_ID, None, skip=sorted(skip),
                                                 schema=schema)
        if claimed:
            return claimed[0]
        if not limited.consumers:
            return None
        rows = limited.claim(cast(psycopg.Connection, conn.connection.driver_connection), 1, None, 0)
        if not rows:
            return None
        job: Job = job_from_row(rows[0], leases[rows[0].consumer])
        if job.id in skip:
            release_jobs(conn, [job], schema=schema)
            return None
        return job


def _record(engine: sa.Engine, job: Job, outcome: Outcome | Failure | Snoozed, schema: str, *,
            keep_done: bool) -> DrainResult:
    """Write ``outcome`` of ``job``'s attempt with the relay's fenced statements (in ``schema``;
    a done job deleted unless ``keep_done``)."""
    error = None
    ended: DrainOutcome
    with _autocommit(engine) as conn:
        if outcome is Outcome.COMMITTED:
            ended = "done"
        elif outcome is Outcome.CANCELLED:
            ended = "cancelled"
        elif outcome is Outcome.DONE:
            ended = "done" if job.id in complete_jobs(conn, [job], keep_done=keep_done, schema=schema) else "stale"
        elif outcome is Outcome.RELEASE:
            ended = "released" if job.id in release_jobs(conn, [job], schema=schema) else "stale"
        elif isinstance(outcome, Snoozed):
            ended = "snoozed" if job.id in snooze_jobs(conn, [(job, outcome)], schema=schema) else "stale"
        elif isinstance(outcome, Failure):
            status = fail_jobs(conn, [(job, outcome)], schema=schema).get(job.id)
            ended = ("retried" if status == "ready" else "dead" if status == "dead"
                     else "superseded" if status == "superseded" else "stale")
            error = outcome.error if ended != "stale" else None
        else:
            ended = "stale"
    return DrainResult(job.id, job.consumer, job.event_id, job.topic, job.attempt, ended, error)


# ------------------------------------------------------------ servers and databases


def run_hooks(engine: sa.Engine, ob: Outbox, *, settings: OutboxSettings | None = None, max_rounds: int = 100) -> int:
    """Make the due failure-hook calls (``on_dead``, ``on_retry``: :mod:`outbox.hooks`) of
    ``ob``'s consumers now, as a relay's hook runner does (:class:`outbox.relay.hooks.HookRunner`:
    leased, each hook in a thread of its own bounded by ``hook_timeout``, deleted once every
    hook returned), until none is due, at most ``max_rounds`` rounds of up to 16 calls;
    returns how many calls were made. A hook that raises is logged and its call due again
    after the runner's backoff, so it is not made again by this call. Run it after
    :func:`drain` (which writes the calls as a relay's statements do). ``settings`` as in
    :func:`drain`. Database errors propagate."""
    from outbox.relay.hooks import HookRunner
    from outbox.relay.reconnect import Reconnector

    settings = settings if settings is not None else OutboxSettings()
    runner = HookRunner(engine, ob, settings, stop=threading.Event(), reconnect=Reconnector(settings.reconnect_max))
    made = 0
    for _ in range(max_rounds):
        leased = runner.round()
        made += leased
        if not leased:
            break
    return made


def server_url() -> tuple[URL, bool]:
    """The server tests run against, and whether it is the embedded one:
    ``OUTBOX_TEST_DATABASE_URL``, else ``OUTBOX_DATABASE_URL``, else an embedded PostgreSQL
    (extra ``embedded``) of this process's own, started on the first call in a new folder of
    the temporary directory (``outbox-test-server-*``), stopped and deleted when the process
    exits (:func:`outbox.db.embedded.start_embedded` with ``delete_on_exit``). Raises
    :class:`~outbox.errors.ConfigurationError` when neither is set and the extra is missing."""
    url = os.environ.get("OUTBOX_TEST_DATABASE_URL") or os.environ.get("OUTBOX_DATABASE_URL")
    if url:
        return parse_url(url), False
    return parse_url(_embedded_test_server()), True


@functools.cache
def _embedded_test_server() -> str:
    """URL of the embedded server of this process's tests: one per process, however many
    fixtures ask (the suite's own and the pytest plugin's)."""
    from outbox.db.embedded import start_embedded

    # A name no other server's folder contains: pgserver, initialising a folder, stops every
    # postgres whose command line contains that folder's path (older outbox used
    # "outbox-test-pg-<uid>", a prefix of "outbox-test-pg-<random>" names).
    return start_embedded(tempfile.mkdtemp(prefix="outbox-test-server-"), delete_on_exit=True)


def _admin(url: URL) -> sa.Engine:
    return sa.create_engine(url, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)


def create_database(server: URL, prefix: str = "outbox_test", template: str | None = None) -> URL:
    """Create a database named ``<prefix>_<random>`` (copied from ``template``) on the
    server of ``server``; returns its URL."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    engine = _admin(server)
    with engine.connect() as conn:
        clause = f' TEMPLATE "{template}"' if template else ""
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"{clause}')
    engine.dispose()
    return server.set(database=name)


def drop_database(url: URL) -> None:
    """Drop the database of ``url`` (terminating its sessions), connecting via ``postgres``."""
    engine = _admin(url.set(database="postgres"))
    with engine.connect() as conn:
        conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{url.database}" WITH (FORCE)')
    engine.dispose()


@contextlib.contextmanager
def temporary_database(server: URL, prefix: str = "outbox_test", template: str | None = None) -> Iterator[URL]:
    """A fresh database for the duration of the ``with`` block, dropped afterwards."""
    url = create_database(server, prefix, template)
    try:
        yield url
    finally:
        drop_database(url)


class DatabaseCopies:
    """Throw-away databases made ahead of need, for a test suite that gives each test a
    database of its own: a thread of its own keeps ``ahead`` (default 2) fresh databases
    ready on ``server`` (``<prefix>_<random>``, copies of the database named ``template``,
    or empty ones when it is None, as :func:`create_database` makes them), so a test does
    not wait for its ``CREATE DATABASE`` (a few tenths of a second on a busy server).

    :meth:`take` hands out a ready database, or creates one at once when none is ready (its
    errors then raise there; a creation that failed on the thread, as while the server
    restarts, is not reported and stops the making ahead until the next :meth:`take`).
    :meth:`give_back` drops a database at once, in the caller's thread, so whatever runs
    after it (a fixture dropping a role that had privileges there) finds it gone.
    :meth:`close` stops the thread and drops the databases made ahead and not taken. The
    template must not change while copies are made (a copy made ahead is the template as
    it was then) and no session may be connected to it (``CREATE DATABASE`` refuses a
    template in use)."""

    def __init__(self, server: URL, template: str | None = None, prefix: str = "outbox_test", ahead: int = 2) -> None:
        if type(ahead) is not int or ahead < 0:
            raise ConfigurationError(f"DatabaseCopies: ahead must be an int >= 0, got {ahead!r}")
        self._server = server
        self._template = template
        self._prefix = prefix
        self._ahead = ahead
        self._ready: list[URL] = []
        self._stalled = False  # a creation on the thread failed: none ahead until the next take
        self._closed = False
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="outbox-database-copies", daemon=True)
        self._thread.start()

    def take(self) -> URL:
        """A fresh database of the caller's own; hand it back with :meth:`give_back`.
        Raises :class:`~outbox.errors.ConfigurationError` once closed; the database
        errors of creating one when none is ready propagate."""
        with self._changed:
            if self._closed:
                raise ConfigurationError("DatabaseCopies: take() after close()")
            url = self._ready.pop(0) if self._ready else None
            self._stalled = False
            self._changed.notify_all()
        return url if url is not None else create_database(self._server, self._prefix, self._template)

    def give_back(self, url: URL) -> None:
        """Drop the database of ``url`` (from :meth:`take`) now, terminating its sessions
        (:func:`drop_database`; its errors propagate)."""
        drop_database(url)

    def close(self) -> None:
        """Stop the thread (after the creation it may be in) and drop the databases made
        ahead and not taken; the first drop error propagates."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        self._thread.join()
        ready, self._ready = self._ready, []
        for url in ready:
            drop_database(url)

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._closed and (self._stalled or len(self._ready) >= self._ahead):
                    self._changed.wait()
                if self._closed:
                    return
            try:
                made = create_database(self._server, self._prefix, self._template)
            except Exception:  # noqa: BLE001 - take() creates one itself and raises its error
                with self._changed:
                    self._stalled = True
                continue
            with self._changed:
                self._ready.append(made)  # close() drops it, if it came first


def migrated_template(server: URL) -> URL:
    """Create a database with outbox's schema migrated, for use as a template; the caller
    drops it with :func:`drop_database`."""
    from outbox.db.migrate import upgrade

    url = create_database(server, "outbox_tpl")
    engine = make_engine(url)
    upgrade(engine)
    engine.dispose()
    return url


T = TypeVar("T")


def wait_for(condition: Callable[[], T], timeout: float = 30.0, interval: float = 0.05, what: str = "condition") -> T:
    """Call ``condition`` every ``interval`` seconds until it returns something truthy and
    return that; raise AssertionError naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
