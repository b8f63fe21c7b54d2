"""Prometheus metrics of a relay (the extra ``metrics``: prometheus_client).

With ``metrics_port`` set (``--metrics-port``, ``OUTBOX_METRICS_PORT``) the relay serves
``GET /metrics`` in Prometheus' text format on ``metrics_host`` (default 127.0.0.1). What it
serves (the table in the operations notes, "Metrics"):

* **Counters of this process**, by consumer: ``outbox_jobs_total{consumer,outcome}``,
  ``outbox_forwarded_messages_total{consumer,result}``,
  ``outbox_hook_calls_total{consumer,hook,result}`` (failure hooks), ``outbox_stale_writes_rejected_total``
  and the router's ``outbox_events_routed_total`` / ``outbox_events_unsubscribed_total``.
* **Histograms of this process**: ``outbox_handler_duration_seconds{consumer}``,
  ``outbox_job_start_latency_seconds{consumer}`` (event created -> handler start) and
  ``outbox_claim_round_trip_seconds``.
* **Gauges of this process's pacing** (:class:`PacingReading`, read at the scrape):
  ``outbox_relay_worker_threads``, ``outbox_relay_ahead_slots``, ``outbox_relay_claim_batch``
  and, with a standby dispatcher, ``outbox_relay_standby_dispatcher_running``.
* **Gauges read from the database** (:class:`GaugeGatherer`) by one relay of the schema at a
  time: ``outbox_jobs_in_status{consumer,status}`` (ready, running, dead), ``outbox_oldest_ready_job_age_seconds``,
  ``outbox_unrouted_events`` and ``outbox_oldest_unrouted_event_age_seconds``. Every relay
  serves ``outbox_metrics_gatherer`` (1 on the one that reads them), so summing a gauge over
  relays counts it once.

**Where each number is taken.** Each outcome is counted where it is written: the completer
(done, retried, dead, snoozed, released, stale, and superseded: a coalescing consumer's
failed attempt that does not run again because a newer event of its key waits), the router
(superseded: the waiting jobs a newer event of their key replaced, and the jobs it created
superseded), the producer (claimed), the heartbeat
(lease lost), the watchdog's report (timed out), the release at shutdown (released), the
forwarder (each broker result), :func:`outbox.fenced_write` (stale writes). The dispatcher's
thread writes most of them once per round, counts per consumer added under one lock
(:class:`RelayMetrics`), histogram values bisected into plain lists: no prometheus_client
object sits on the hot path, whose cost is a dictionary update per job (performance notes,
"Metrics").

**Clocks.** The start latency is measured without comparing two machines' clocks: the claim
statement returns ``lease_until = now() + lease`` and the event's ``created_at``, both by the
database clock, so the event's age at the claim is ``lease_until - lease - created_at``; the
time from sending the claim to the handler's start is added on this process's monotonic
clock. The result overstates the latency by at most the claim's one-way trip. ``created_at``
is the publishing transaction's start (``now()``), so a long publishing transaction counts too.
"""

from __future__ import annotations

import bisect
import logging
import math
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import SQLAlchemyError

from outbox.db import queries
from outbox.db.engine import describe
from outbox.errors import ConfigurationError

if TYPE_CHECKING:
    from datetime import datetime

    from outbox.job import Job

log = logging.getLogger(__name__)


class HandlerRun(Protocol):
    """What :meth:`RelayMetrics.handlers_finished` reads of a claim whose handler ran (the
    runner's :class:`outbox.relay.claim.Claim`): its ``job``, the claim's ``lease_until``
    (database clock), the ``time.monotonic()`` readings of when the claim was ``sent`` and
    the handler ``started`` (0: not started, or already accounted for) and how long it
    ``ran``, seconds."""

    job: Job
    consumer: str
    lease_until: datetime | None
    sent: float
    started: float
    ran: float

#: The outcomes ``outbox_jobs_total`` counts (label ``outcome``).
JOB_OUTCOMES = ("claimed", "done", "retried", "dead", "cancelled", "stale", "lease_lost", "released", "snoozed",
                "timed_out", "superseded")
#: The results ``outbox_forwarded_messages_total`` counts (label ``result``).
FORWARD_RESULTS = ("delivered", "duplicate", "failed", "unavailable")
#: The results ``outbox_hook_calls_total`` counts (label ``result``): a hook returned, raised
#: (or ran past ``hook_timeout``), or was given up after its last call (:mod:`outbox.relay.hooks`).
HOOK_RESULTS = ("ok", "failed", "gave_up")
#: Job statuses ``outbox_jobs`` reports (label ``status``).
GAUGE_STATUSES = ("ready", "running", "dead")

#: Bucket bounds, seconds.
HANDLER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)
CLAIM_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)

#: Longest a gauge reading's statement may run, seconds (cancelled past it, and skipped).
GAUGE_STATEMENT_TIMEOUT = 2.0

# Every RelayMetrics alive in this process: fenced_write counts its refusals in each.
_ACTIVE: weakref.WeakSet[RelayMetrics] = weakref.WeakSet()


class Histogram:
    """A histogram without labels' machinery: ``bounds`` (ascending upper bounds, seconds)
    and a count per bucket plus one for ``+Inf``. Not thread-safe: the caller holds a lock."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # le: a value on a bound is in its bucket
        self.total += value

    def cumulative(self) -> list[tuple[str, float]]:
        """(le, cumulative count) pairs, ``+Inf`` last, as Prometheus exposes them."""
        out: list[tuple[str, float]] = []
        running = 0
        for bound, n in zip((*self.bounds, math.inf), self.counts):
            running += n
            out.append(("+Inf" if bound == math.inf else repr(float(bound)), float(running)))
        return out


@dataclass(frozen=True, slots=True)
class PacingReading:
    """What a runner's pacing (:mod:`outbox.relay.pacing`) sizes now: ``threads`` of its
    worker pool, ``ahead`` slots beyond them (jobs it may hand to the pool's queue),
    ``claim_batch`` (most jobs one claim asks for) and ``standby``: whether its standby
    dispatcher runs rounds (None: it has none)."""

    threads: int
    ahead: int
    claim_batch: int
    standby: bool | None


@dataclass(frozen=True, slots=True)
class GaugeReading:
    """One reading of the database gauges: ``jobs`` maps (consumer, status) to a count (every
    subscribed consumer has all three statuses, 0 included), ``oldest_ready`` maps consumer
    to its lag, seconds; ``unrouted`` and ``oldest_unrouted`` (seconds) are the events'."""

    jobs: Mapping[tuple[str, str], int]
    oldest_ready: Mapping[str, float]
    unrouted: int
    oldest_unrouted: float
    took: float = 0.0
    consumers: frozenset[str] = field(default_factory=frozenset)


class RelayMetrics:
    """The counters and histograms of one relay, and the last gauge reading if this relay
    gathers them. Thread-safe (one lock); writers add a round's counts at once. Serves as a
    prometheus_client collector (:meth:`collect`), read when ``/metrics`` is scraped."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: dict[tuple[str, str], int] = {}
        self._forwarded: dict[tuple[str, str], int] = {}
        self._intake: dict[tuple[str, str], int] = {}
        self._hook_calls: dict[tuple[str, str, str], int] = {}
        self._handler: dict[str, Histogram] = {}
        self._latency: dict[str, Histogram] = {}
        self._claim = Histogram(CLAIM_BUCKETS)
        self.stale_writes = 0
        self.events_routed = 0
        self.events_unsubscribed = 0
        #: Whether this relay holds the gatherer's lock; the last reading (None: none, or stale).
        self.gatherer = False
        self.reading: GaugeReading | None = None
        #: The runner's pacing, read at each scrape (None: no runner, e.g. a router-only relay).
        self.pacing: Callable[[], PacingReading] | None = None
        _ACTIVE.add(self)

    # --------------------------------------------------------------- writers

    def jobs(self, outcome: str, consumers: Iterable[str]) -> None:
        """Count one job of each consumer in ``consumers`` (repeat a name per job) as ``outcome``."""
        counts: dict[str, int] = {}
        for consumer in consumers:
            counts[consumer] = counts.get(consumer, 0) + 1
        if counts:
            self.jobs_counted(outcome, counts)

    def jobs_counted(self, outcome: str, counts: Mapping[str, int]) -> None:
        """Add ``counts`` (consumer -> jobs) to ``outcome``."""
        with self._lock:
            for consumer, n in counts.items():
                key = (consumer, outcome)
                self._jobs[key] = self._jobs.get(key, 0) + n

    def forwarded(self, consumer: str, results: Mapping[str, int]) -> None:
        """Add a forwarder's batch results (result -> messages)."""
        with self._lock:
            for result, n in results.items():
                if n:
                    key = (consumer, result)
                    self._forwarded[key] = self._forwarded.get(key, 0) + n

    def taken_in(self, intake: str, results: Mapping[str, int]) -> None:
        """Add an intake's batch (result -> messages: ``taken``, ``duplicate``, ``rejected``)."""
        with self._lock:
            for result, n in results.items():
                if n:
                    key = (intake, result)
                    self._intake[key] = self._intake.get(key, 0) + n

    def hook_called(self, consumer: str, hook: str, result: str, n: int = 1) -> None:
        """Count ``n`` calls of ``consumer``'s failure hooks of kind ``hook`` (``dead``,
        ``retry``) as ``result`` (:data:`HOOK_RESULTS`)."""
        with self._lock:
            key = (consumer, hook, result)
            self._hook_calls[key] = self._hook_calls.get(key, 0) + n

    def hook_calls(self, consumer: str, hook: str, result: str) -> int:
        """``outbox_hook_calls_total`` of (consumer, hook, result) so far (tests)."""
        with self._lock:
            return self._hook_calls.get((consumer, hook, result), 0)

    def handlers_finished(self, runs: Iterable[HandlerRun]) -> None:
        """Observe the handler duration and the start latency of ``runs`` whose handlers ran
        (``started`` set; reset here, so a claim carried to a later round counts once).
        Inlined: it runs for every job, in the dispatcher's thread."""
        handlers, latencies = self._handler, self._latency
        bisect_left = bisect.bisect_left
        with self._lock:
            for run in runs:
                started = run.started
                if not started:
                    continue
                run.started = 0.0
                consumer = run.consumer
                hist = handlers.get(consumer)
                if hist is None:
                    hist = handlers[consumer] = Histogram(HANDLER_BUCKETS)
                ran = run.ran
                hist.counts[bisect_left(HANDLER_BUCKETS, ran)] += 1
                hist.total += ran
                job = run.job
                lease_until, created = run.lease_until, job.event_created_at
                if lease_until is None or created is None:
                    continue
                latency = (lease_until - created).total_seconds() - job.lease_seconds + (started - run.sent)
                if latency < 0.0:
                    latency = 0.0
                hist = latencies.get(consumer)
                if hist is None:
                    hist = latencies[consumer] = Histogram(LATENCY_BUCKETS)
                hist.counts[bisect_left(LATENCY_BUCKETS, latency)] += 1
                hist.total += latency

    def claim_round_trip(self, seconds: float) -> None:
        with self._lock:
            self._claim.observe(seconds)

    def routed(self, events: int, unsubscribed: int) -> None:
        with self._lock:
            self.events_routed += events
            self.events_unsubscribed += unsubscribed

    def count(self, outcome: str, consumer: str) -> int:
        """``outbox_jobs_total`` of (consumer, outcome) so far (tests, the relay's summary)."""
        with self._lock:
            return self._jobs.get((consumer, outcome), 0)

    # --------------------------------------------------------------- reader

    def collect(self) -> Iterator[Any]:
        """The metric families for a scrape (prometheus_client's collector protocol)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        with self._lock:
            jobs = dict(self._jobs)
            forwarded = dict(self._forwarded)
            intake = dict(self._intake)
            hook_calls = dict(self._hook_calls)
            handler = {c: (h.cumulative(), h.total) for c, h in self._handler.items()}
            latency = {c: (h.cumulative(), h.total) for c, h in self._latency.items()}
            claim = (self._claim.cumulative(), self._claim.total)
            stale_writes, routed, unsubscribed = self.stale_writes, self.events_routed, self.events_unsubscribed
        family = CounterMetricFamily("outbox_jobs", "Jobs of this relay by consumer and outcome.",
                                     labels=["consumer", "outcome"])
        for (consumer, outcome), n in sorted(jobs.items()):
            family.add_metric([consumer, outcome], n)
        yield family
        family = CounterMetricFamily("outbox_forwarded_messages", "Messages this relay's forwarders sent, by "
                                     "consumer and broker result.", labels=["consumer", "result"])
        for (consumer, result), n in sorted(forwarded.items()):
            family.add_metric([consumer, result], n)
        yield family
        family = CounterMetricFamily("outbox_intake_messages", "Messages this relay's intakes took from their brokers, "
                                     "by intake and result.", labels=["intake", "result"])
        for (name, result), n in sorted(intake.items()):
            family.add_metric([name, result], n)
        yield family
        family = CounterMetricFamily("outbox_hook_calls", "Failure hook calls this relay made, by consumer, hook "
                                     "(dead, retry) and result (ok, failed, gave_up).",
                                     labels=["consumer", "hook", "result"])
        for (consumer, hook, result), n in sorted(hook_calls.items()):
            family.add_metric([consumer, hook, result], n)
        yield family
        yield CounterMetricFamily("outbox_stale_writes_rejected", "fenced_write calls in this process refused "
                                  "because a newer fence had written the row.", value=stale_writes)
        yield CounterMetricFamily("outbox_events_routed", "Events this relay's router routed.", value=routed)
        yield CounterMetricFamily("outbox_events_unsubscribed", "Events this relay's router found no subscription "
                                  "for (marked routed, no jobs).", value=unsubscribed)
        for name, doc, hists in (
                ("outbox_handler_duration_seconds", "Time handlers (forwarders: broker round trips) ran, by "
                 "consumer.", handler),
                ("outbox_job_start_latency_seconds", "Time from an event's creation (database clock) to the start "
                 "of its job's handler, by consumer.", latency)):
            hfamily = HistogramMetricFamily(name, doc, labels=["consumer"])
            for consumer, (buckets, total) in sorted(hists.items()):
                hfamily.add_metric([consumer], buckets, total)
            yield hfamily
        hfamily = HistogramMetricFamily("outbox_claim_round_trip_seconds", "Time the claim statements of this "
                                        "relay took, from sending to the claimed rows.")
        hfamily.add_metric([], claim[0], claim[1])
        yield hfamily
        yield GaugeMetricFamily("outbox_metrics_gatherer", "1 on the relay that reads the database gauges (one "
                                "per schema at a time), else 0.", value=1 if self.gatherer else 0)
        if self.pacing is not None:
            yield from pacing_families(self.pacing())
        reading = self.reading if self.gatherer else None
        if reading is None:
            return
        gauge = GaugeMetricFamily("outbox_jobs_in_status", "Jobs in the database by consumer and status (ready, running, "
                                  "dead).", labels=["consumer", "status"])
        for (consumer, status), n in sorted(reading.jobs.items()):
            gauge.add_metric([consumer, status], n)
        yield gauge
        gauge = GaugeMetricFamily("outbox_oldest_ready_job_age_seconds", "Age of each consumer's oldest due ready "
                                  "job (now - run_at, database clock): its lag; 0 when none is due.",
                                  labels=["consumer"])
        for consumer, age in sorted(reading.oldest_ready.items()):
            gauge.add_metric([consumer], age)
        yield gauge
        yield GaugeMetricFamily("outbox_unrouted_events", "Events not routed yet.", value=reading.unrouted)
        yield GaugeMetricFamily("outbox_oldest_unrouted_event_age_seconds", "Age of the oldest unrouted event "
                                "(database clock); 0 when none.", value=reading.oldest_unrouted)
        yield GaugeMetricFamily("outbox_gauges_read_duration_seconds", "Time the last reading of the database "
                                "gauges took.", value=reading.took)


def pacing_families(pacing: PacingReading) -> Iterator[Any]:
    """The gauges of a runner's pacing (:class:`PacingReading`), read at the scrape."""
    from prometheus_client.core import GaugeMetricFamily

    yield GaugeMetricFamily("outbox_relay_worker_threads", "Threads of this relay's worker pool now: concurrency, "
                            "or more while the elastic pool has grown (concurrency not set).", value=pacing.threads)
    yield GaugeMetricFamily("outbox_relay_ahead_slots", "Jobs this relay may hand to its worker pool beyond its "
                            "threads now, paced from the workers' rate (0 with prefetch set, or while a handler is "
                            "hung).", value=pacing.ahead)
    yield GaugeMetricFamily("outbox_relay_claim_batch", "Most jobs one claim of this relay asks for now (paced "
                            "unless claim_batch is set).", value=pacing.claim_batch)
    if pacing.standby is not None:
        yield GaugeMetricFamily("outbox_relay_standby_dispatcher_running", "1 while this relay's standby "
                                "dispatcher runs rounds (a deep backlog), 0 while it is parked.",
                                value=1 if pacing.standby else 0)


def record_stale_write() -> None:
    """Count a refused :func:`outbox.fenced_write` in every relay of this process."""
    for metrics in list(_ACTIVE):
        with metrics._lock:
            metrics.stale_writes += 1


# ------------------------------------------------------------------- the gauges


def read_gauges(conn: Connection, *, schema: str | None = None) -> GaugeReading:
    """Read the database gauges in one transaction of ``conn`` (each statement bounded by
    :data:`GAUGE_STATEMENT_TIMEOUT`; one that runs past it raises). Every subscribed consumer
    gets all three statuses, 0 included, so a count that drops to nothing reads 0."""
    statements = queries.in_schema(schema)
    started = time.perf_counter()
    with conn.begin():
        conn.execute(statements.metrics_statement_timeout_set_local,
                     {"timeout": f"{round(GAUGE_STATEMENT_TIMEOUT * 1000)}ms"})
        consumers = {r.consumer for r in conn.execute(statements.subscription_list)}
        ready = conn.execute(statements.job_ready_gauges).all()
        running = conn.execute(statements.job_running_counts).all()
        dead = conn.execute(statements.job_dead_counts).all()
        unrouted = conn.execute(statements.event_unrouted_gauges).one()
    consumers |= {r.consumer for rows in (ready, running, dead) for r in rows}
    jobs = {(c, s): 0 for c in consumers for s in GAUGE_STATUSES}
    for status, rows in (("ready", ready), ("running", running), ("dead", dead)):
        for r in rows:
            jobs[(r.consumer, status)] = r.jobs
    oldest = dict.fromkeys(consumers, 0.0)
    oldest.update({r.consumer: float(r.oldest_seconds) for r in ready})
    return GaugeReading(jobs=jobs, oldest_ready=oldest, unrouted=unrouted.events,
                        oldest_unrouted=float(unrouted.oldest_seconds), took=time.perf_counter() - started,
                        consumers=frozenset(consumers))


class GaugeGatherer:
    """Reads the database gauges into ``metrics`` every ``interval`` seconds, while this
    relay is the schema's gatherer. Runs in its own thread (:meth:`run`) until ``stop`` is set,
    on one connection of ``engine`` kept open (a pool of one, outside the relay's pool).

    Who gathers: each round a relay that is not the gatherer tries the session-level
    advisory lock ``metrics_gatherer_lock_try``; the one that gets it holds it for as long as
    its connection lives, so one relay reads the gauges at a time and, once its process or
    connection is gone, another takes over within ``interval``. A reading that fails (its
    statement cancelled past :data:`GAUGE_STATEMENT_TIMEOUT`, the connection lost) is
    dropped: the gauges are not served until the next one succeeds, never stale."""

    def __init__(self, engine: Engine, metrics: RelayMetrics, interval: float, stop: threading.Event, *,
                 schema: str | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.interval = interval
        self.stop = stop
        self.schema = schema
        self.readings = 0
        self._conn: Connection | None = None
        self._leader = False  # this relay's connection holds the gatherer's lock
        self._failing = False

    def run(self) -> None:
        try:
            while True:
                self.gather()
                if self.stop.wait(self.interval):
                    break
        finally:
            self._drop()

    def gather(self) -> bool:
        """One round: become the gatherer if no relay is, then read the gauges if this relay
        is it; returns whether it read them."""
        try:
            if self._conn is None:
                self._conn = self.engine.connect()
            conn = self._conn
            if not self._leader:
                held = bool(conn.execute(queries.in_schema(self.schema).metrics_gatherer_lock_try).scalar_one())
                conn.commit()
                if not held:
                    return False
                self._leader = True
                log.info("this relay reads the database gauges for /metrics (every %gs)", self.interval)
            self.metrics.reading = read_gauges(conn, schema=self.schema)
            self.metrics.gatherer = True  # served from its first reading on
        except SQLAlchemyError as exc:
            self.metrics.reading = None
            if not self._failing:
                log.warning("reading the database gauges for /metrics failed (%s); trying again every %gs",
                            describe(exc), self.interval)
            self._failing = True
            self._drop()
            return False
        if self._failing:
            log.info("reading the database gauges for /metrics works again")
            self._failing = False
        self.readings += 1
        return True

    def _drop(self) -> None:
        """Close the connection; the lock goes with its session, and the gatherer's role."""
        conn, self._conn = self._conn, None
        self._leader = self.metrics.gatherer = False
        if conn is not None:
            try:
                conn.invalidate()
                conn.close()
            except Exception:  # noqa: BLE001 - being thrown away
                pass


# ------------------------------------------------------------------- the server


def check_metrics_available() -> None:
    """Raise :class:`~outbox.errors.ConfigurationError` unless prometheus_client (the extra
    ``metrics``) can be imported."""
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        raise ConfigurationError("metrics_port is set but prometheus_client is not installed: "
                                 "pip install 'outbox-relay[metrics]'") from None


class MetricsServer:
    """``GET /metrics`` of ``metrics`` on ``host``:``port`` (0: a free port), prometheus_client's
    WSGI server in a daemon thread. :attr:`port` is the port bound. Raises
    :class:`~outbox.errors.ConfigurationError` when prometheus_client is not installed (the
    extra ``metrics``) or the address cannot be bound."""

    def __init__(self, metrics: RelayMetrics, host: str, port: int) -> None:
        check_metrics_available()
        from prometheus_client import CollectorRegistry, start_wsgi_server

        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(metrics)  # a collector by protocol
        try:
            self._server, self._thread = start_wsgi_server(port, host, self.registry)
        except OSError as exc:
            raise ConfigurationError(f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}") from None
        self.host = host
        self.port: int = self._server.server_port

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
