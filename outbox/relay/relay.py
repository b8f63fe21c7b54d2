"""Relay: the process that runs the router, the job runner, the reaper and the pruner.

Start-up: connect (an unreachable database or a missing/old schema is an error, reported
in one line), write this registry's subscriptions, then start the threads:

* ``outbox-router``: route events until none are left, then wait for ``NOTIFY
  outbox_events`` or ``poll_interval``;
* ``outbox-statistics`` (with the router): ``ANALYZE outbox_jobs`` after bursts of routed
  jobs (:class:`outbox.relay.statistics.StatisticsKeeper`), beside the router rather than in its loop;
* the job runner's threads (:mod:`outbox.relay.runner`), woken by ``NOTIFY outbox_jobs`` or by
  the router of this process;
* ``outbox-maintenance``: reaper and the ordered keys' promotion sweep every ``reap_interval``, pruner every ``prune_interval``;
* ``outbox-scheduler`` when the registry declares schedules (:mod:`outbox.schedule`): wakes
  at the next slot by the database clock and publishes it, once across all relays;
* ``outbox-listener`` (:mod:`outbox.relay.notify`) when ``listen`` is on.

Once running, a lost database connection is never fatal: each loop logs it once and
retries; the loops share one :class:`~outbox.relay.reconnect.Reconnector`, so while the database
is unreachable they probe every 0.25-0.5 s and all retry at once as soon as one of them (or
the listener) gets through (other errors: capped backoff up to ``reconnect_max``).

SIGTERM or SIGINT: stop claiming, give in-flight handlers ``shutdown_grace`` seconds,
release what is still held (fenced) so another relay takes it at once, flush outcomes,
return exit status 0. A second signal skips the rest of the grace period.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable
from types import FrameType

from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError

from outbox.db.engine import (
    make_engine,
    parse_url,
    redact,
    translate_errors,
)
from outbox.db.jobs import notify_head
from outbox.db.migrate import check_schema
from outbox.registry import Outbox
from outbox.relay.counters import Counters
from outbox.relay.maintenance import (
    TableUpkeep,
    autovacuum_enabled,
    prune,
    prune_relays,
    reap_expired,
    vacuum_tables,
)
from outbox.relay.notify import Cooldown, Listener, Wakeup
from outbox.relay.ordering import HeadSweeper
from outbox.relay.poison import Quarantine, SystemicError
from outbox.relay.reconnect import Reconnector
from outbox.relay.router import (
    UnsubscribedTopics,
    register_subscriptions,
    route_round,
)
from outbox.relay.runner import JobRunner
from outbox.relay.scheduler import Scheduler, register_schedules
from outbox.relay.statistics import StatisticsKeeper
from outbox.settings import OutboxSettings
from outbox.telemetry.metrics import (
    GaugeGatherer,
    MetricsServer,
    RelayMetrics,
    check_metrics_available,
)

log = logging.getLogger(__name__)

#: Seconds the router waits before routing again after a round that held keyed events back
#: behind an earlier event another router held (it is routed by then, or about to be).
HELD_BACK_RETRY = 0.05


class Relay:
    """One relay: ``registry``'s handlers plus routing and maintenance for the whole
    database, configured by ``settings`` (``settings.database_url`` is required).

    ``route``, ``work``, ``maintain`` and ``schedule`` turn the router, the job runner, the
    reaper/pruner and the scheduler of the registry's schedules on or off (all on by
    default). Use :meth:`run` in a process (handles
    signals), or :meth:`start` / :meth:`stop` when embedding it (tests, an app's own
    process). Raises :class:`~outbox.errors.DatabaseUnavailableError`,
    :class:`~outbox.errors.SchemaNotReadyError` or :class:`~outbox.errors.ConfigurationError`
    from :meth:`start` when it cannot begin.

    With ``settings.metrics_port`` set it serves Prometheus metrics (:mod:`outbox.telemetry.metrics`)
    from :meth:`start` to :meth:`stop`, and reads the database gauges on one more connection
    of its own (outside the pool) while it is the schema's gatherer; without prometheus_client
    installed it raises :class:`~outbox.errors.ConfigurationError` when built.

    Everything it reads and writes is in schema ``settings.schema_name`` (``OUTBOX_SCHEMA``):
    its events, jobs, subscriptions and relay rows, and the NOTIFY channels it listens on.
    Relays of different schemas share a database without seeing each other's work.
    """

    def __init__(self, registry: Outbox, settings: OutboxSettings, *, route: bool = True,
                 work: bool = True, maintain: bool = True, schedule: bool = True,
                 worker_id: str | None = None) -> None:
        from outbox.errors import ConfigurationError

        url = settings.url()
        if url is None:
            raise ConfigurationError("no database configured: set OUTBOX_DATABASE_URL or pass --database-url")
        self.url = parse_url(url)
        self.registry = registry
        self.settings = settings
        self.schema = settings.schema_name
        self.worker_id = worker_id or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.stop_event = threading.Event()
        self.wake_router = threading.Event()
        self.wake_workers = Wakeup()
        self.reconnect = Reconnector(settings.reconnect_max)  # shared by every loop below
        pool_size, overflow = settings.pool_limits()
        self.engine = make_engine(self.url, pool_size=pool_size, max_overflow=overflow, application_name="outbox-relay",
                                  prepared_statements=settings.pooler == "none")
        # Prometheus metrics (outbox.telemetry.metrics), when a port is set: the counters, the server,
        # and the database gauges' reader on a connection of its own (outside the pool).
        self.metrics: RelayMetrics | None = None
        self.metrics_server: MetricsServer | None = None
        self.gauges: GaugeGatherer | None = None
        if settings.metrics_port is not None:
            check_metrics_available()
            self.metrics = RelayMetrics()
            self.gauges = GaugeGatherer(
                make_engine(self.url, pool_size=1, max_overflow=0, application_name="outbox-relay-metrics",
                            prepared_statements=settings.pooler == "none"),
                self.metrics, settings.metrics_interval, self.stop_event, schema=self.schema)
        self.runner = (JobRunner(self.engine, registry, settings, self.worker_id, self.wake_workers,
                                 reconnect=self.reconnect, metrics=self.metrics) if work else None)
        listen_url = settings.listen_target()
        self.listener = (Listener(parse_url(listen_url), self.wake_router, self.wake_workers, self.stop_event,
                                  reconnect=self.reconnect, schema=self.schema) if listen_url else None)
        self._route = route
        self.upkeep = TableUpkeep(self.schema)  # may this role ANALYZE / VACUUM? (warns once if not)
        self.job_statistics = StatisticsKeeper(self.engine, schema=self.schema,  # ANALYZE after bursts, in its own thread
                                               upkeep=self.upkeep)
        self.unsubscribed_topics = UnsubscribedTopics()  # the router loop's warnings about topics with no subscriber
        # Rows each loop skips for a while: their statement fails alone and recording it did too (poison.py).
        self.route_quarantine = Quarantine("event")
        self.reap_quarantine = Quarantine("job")
        self.prune_quarantine = Quarantine("row")
        self.head_sweeper = HeadSweeper()  # ordered keys' heads left pending (outbox.relay.ordering, "Sweep")
        self._maintain = maintain
        self.scheduler = (Scheduler(self.engine, registry.schedules, self.stop_event, self.reconnect,
                                    schema=self.settings.schema_name)
                          if schedule and registry.schedules else None)
        self._threads: list[threading.Thread] = []
        self.stats = Counters(("events_routed", "jobs_created", "events_unsubscribed", "reaped", "reaped_dead",
                               "reaped_unstarted", "pruned_jobs", "pruned_events", "vacuums", "vacuums_skipped",
                               "promoted"))
        self._warned_autovacuum = False

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Check the database and schema, register subscriptions, start every thread."""
        with translate_errors(self.url, self.schema):
            with self.engine.connect() as conn:
                check_schema(conn, self.schema)
            register_subscriptions(self.engine, self.registry, self.settings)
            if self.scheduler:
                register_schedules(self.engine, self.registry.schedules, self.settings.schema_name)
        pool_size, overflow = self.settings.pool_limits()
        listen = (f"LISTEN on {redact(self.listener.conninfo)}" if self.listener else
                  f"polling only (every {self.settings.poll_interval:g}s)")
        # async transactional handlers: each worker thread may hold one connection of its own async engine
        async_tx = self.settings.concurrency if self.runner and any(
            s.transactional and s.is_async for s in self.registry) else 0
        log.info("relay started: worker %s, consumers %s, concurrency %d, dispatchers %d, prefetch %d, claim_batch %d, "
                 "database %s, pooler %s, schema %s; at most %d connections (pool %d + overflow %d%s%s); %s",
                 self.worker_id, self.registry.consumers or "none", self.settings.concurrency, self.settings.dispatchers,
                 self.settings.prefetch, self.settings.claim_batch, redact(self.url), self.settings.pooler, self.schema,
                 pool_size + overflow + async_tx + (1 if self.listener else 0), pool_size, overflow,
                 f" + {async_tx} async" if async_tx else "", " + 1 LISTEN" if self.listener else "", listen)
        for sub in self.registry:
            if sub.sink is not None:
                log.info("forwarder %s: %s -> %s (window %d messages in flight per relay)", sub.consumer,
                         ", ".join(sub.topics), sub.sink.describe(), self.settings.forward_window)
        if self.metrics is not None and self.gauges is not None:
            self.metrics_server = MetricsServer(self.metrics, self.settings.metrics_host,
                                                self.settings.metrics_port or 0)
            log.info("serving Prometheus metrics on http://%s:%d/metrics", self.settings.metrics_host,
                     self.metrics_server.port, extra={"metrics_port": self.metrics_server.port})
            self._spawn("outbox-metrics", self.gauges.run)
        if self.listener:
            self.listener.start()
        if self._route:
            self._spawn("outbox-router", self._router_loop)
            self._spawn("outbox-statistics", lambda: self.job_statistics.run(self.stop_event))
        if self.runner:
            self.runner.start()
        if self._maintain:
            self._spawn("outbox-maintenance", self._maintenance_loop)
        if self.scheduler:
            self._spawn("outbox-scheduler", self.scheduler.run)

    def stop(self, grace: float | None = None, cut_short: threading.Event | None = None) -> None:
        """Stop as on SIGTERM: stop claiming and routing, let in-flight handlers run for up
        to ``grace`` seconds (default ``shutdown_grace``; ``cut_short`` ends the wait
        early), release the rest (fenced), stop every thread, close the pool."""
        grace = self.settings.shutdown_grace if grace is None else grace
        self.stop_event.set()
        self.wake_router.set()
        self.job_statistics.wake()
        if self.runner:
            self.runner.stop(grace, cut_short)
        for thread in self._threads:
            thread.join(timeout=5)
        if self.listener:
            self.listener.join(timeout=5)
        if self.metrics_server is not None:
            self.metrics_server.close()
        if self.gauges is not None:
            self.gauges.engine.dispose()
        self.engine.dispose()
        stats = {**self.stats, **(self.runner.stats if self.runner else {})}
        if self.scheduler:
            stats["scheduled_events"] = self.scheduler.published
        log.info("relay stopped: %s", ", ".join(f"{k}={v}" for k, v in stats.items()))

    def run(self) -> int:
        """Start, then block until SIGTERM or SIGINT; drain and return exit status 0.
        Signals are handled from before start-up, so a SIGTERM that arrives while the relay
        is starting (connecting, registering subscriptions) still drains and exits 0. One
        that arrives earlier, while Python is still importing the package (the first second
        or so of an ``outbox-relay`` process on a slow machine, before any database work),
        ends the process with the default action (exit status 143)."""
        grace_over = threading.Event()

        def on_signal(signum: int, frame: FrameType | None) -> None:
            if not self.stop_event.is_set():
                log.info("%s received: draining (grace %.0fs)", signal.Signals(signum).name,
                         self.settings.shutdown_grace)
                self.stop_event.set()
            else:
                log.info("second signal: releasing in-flight jobs now")
                grace_over.set()

        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            self.start()
            while not self.stop_event.wait(0.5):
                pass
            self.stop(cut_short=grace_over)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        return 0

    def _spawn(self, name: str, target: Callable[[], None]) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    # ---------------------------------------------------------------- loops

    def _router_loop(self) -> None:
        failures = 0
        limit = self.settings.route_batch
        cooldown = Cooldown(self.settings.wake_cooldown)
        conn: Connection | None = None  # kept between rounds: no pool checkout and pre-ping per round
        while not self.stop_event.is_set():
            cooldown.wait(self.stop_event.wait)  # NOTIFYs closer than the cooldown share a round
            cooldown.started()
            try:
                if conn is None:
                    # One statement, atomic by itself: no BEGIN/COMMIT round trips needed.
                    conn = self.engine.connect().execution_options(isolation_level="AUTOCOMMIT")
                result = route_round(conn, limit, self.route_quarantine, schema=self.schema)
                failures = self.reconnect.recovered(failures, "router")
            except (DBAPIError, SystemicError) as exc:  # SystemicError: a statement that fails for every row
                if conn is not None:
                    with contextlib.suppress(Exception):  # it is being thrown away
                        conn.invalidate()  # whatever broke, the next round starts on a fresh connection
                        conn.close()
                    conn = None
                failures = self.reconnect.backoff(failures, "router", exc, self.stop_event)
                continue
            if result.jobs:
                self.wake_workers.set()
            self.job_statistics.count(result.jobs)  # no query: the keeper's thread runs the ANALYZE
            self.stats.add("events_routed", result.events)
            self.stats.add("jobs_created", result.jobs)
            if self.metrics is not None and result.events:
                self.metrics.routed(result.events, result.unsubscribed)
            if result.unsubscribed:
                self.stats.add("events_unsubscribed", result.unsubscribed)
                self.unsubscribed_topics.routed(result.unsubscribed_topics)  # a WARNING per topic, once a minute
            if result.events >= limit:
                cooldown.skip()  # a full batch: more events may be waiting
            else:
                # Events held back behind another router's batch (architecture notes, "Ordering")
                # go once it commits, which sends no NOTIFY: look again soon.
                self.wake_router.wait(min(HELD_BACK_RETRY, self.settings.poll_interval) if result.held_back
                                      else self.settings.poll_interval)
                self.wake_router.clear()
        if conn is not None:
            conn.close()

    def _vacuum_if_autovacuum_is_off(self) -> None:
        """Vacuum the queue's tables when autovacuum will not (see :mod:`outbox.relay.maintenance`)."""
        with self.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            if autovacuum_enabled(conn, schema=self.schema):
                return
            if not self._warned_autovacuum:
                self._warned_autovacuum = True
                log.warning("autovacuum is off for outbox_jobs; this relay vacuums outbox_jobs and outbox_events "
                            "itself after each pruning round (every %.0fs)", self.settings.prune_interval)
            if not self.upkeep.permitted(conn):
                self.stats.add("vacuums_skipped")
                return
            vacuum_tables(conn, schema=self.schema)
        self.stats.add("vacuums")

    def _maintenance_loop(self) -> None:
        failures = 0
        next_prune = time.monotonic() + min(5.0, self.settings.prune_interval)
        while not self.stop_event.wait(self.settings.reap_interval if not failures else 0):
            try:
                with self.engine.begin() as conn:
                    reaped = reap_expired(conn, quarantine=self.reap_quarantine, schema=self.schema)
                    if reaped.retried or reaped.unstarted:  # back with their early place: every relay claims from the head
                        notify_head(conn, schema=self.schema)
                with self.engine.begin() as conn:  # after the reaping committed (outbox.relay.ordering, "Sweep")
                    promoted = self.head_sweeper.sweep(conn, schema=self.schema)
                if promoted:
                    self.stats.add("promoted", len(promoted))
                    self.wake_workers.set()
                self.stats.add("reaped", reaped.retried + reaped.dead + reaped.unstarted)
                self.stats.add("reaped_dead", reaped.dead)
                self.stats.add("reaped_unstarted", reaped.unstarted)
                if reaped.retried or reaped.unstarted:
                    self.wake_workers.rewind()
                if time.monotonic() >= next_prune:
                    with self.engine.begin() as conn:
                        jobs, events = prune(conn, self.settings.retention_done, self.settings.retention_events,
                                             quarantine=self.prune_quarantine, schema=self.schema)
                        prune_relays(conn, schema=self.schema)
                    self.stats.add("pruned_jobs", jobs)
                    self.stats.add("pruned_events", events)
                    if jobs or events:
                        log.info("pruned %d done or cancelled jobs and %d finished events", jobs, events)
                    self._vacuum_if_autovacuum_is_off()
                    next_prune = time.monotonic() + self.settings.prune_interval
                failures = self.reconnect.recovered(failures, "maintenance")
            except (DBAPIError, SystemicError) as exc:  # SystemicError: a statement that fails for every row
                failures = self.reconnect.backoff(failures, "maintenance", exc, self.stop_event)
