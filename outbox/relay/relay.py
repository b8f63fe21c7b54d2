"""Relay: the process that runs the router, the job runner, the reaper and the pruner.

This module only wires the parts: it builds them, starts them and stops them; each part's
loop lives with the part. Start-up: connect (an unreachable database or a missing/old
schema is an error, reported in one line), write this registry's subscriptions, then start
the parts and their threads:

* the router (:class:`outbox.relay.router.Router`): ``outbox-router`` routes events until
  none are left, then waits for ``NOTIFY outbox_events`` or ``poll_interval``;
  ``outbox-statistics`` beside it runs ``ANALYZE outbox_jobs`` after bursts of routed jobs
  (:class:`outbox.relay.statistics.StatisticsKeeper`);
* the job runner (:class:`outbox.relay.runner.JobRunner`), woken by ``NOTIFY outbox_jobs``
  or by the router of this process;
* maintenance (:class:`outbox.relay.maintenance.Maintenance`): ``outbox-maintenance``
  runs the reaper and the ordered keys' promotion sweep every ``reap_interval``, the pruner
  every ``prune_interval``;
* ``outbox-hooks`` when the registry declares failure hooks (``on_dead``, ``on_retry``) and
  the job runner is on (:class:`outbox.relay.hooks.HookRunner`): calls them for the due
  calls of its consumers, at least once each;
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

import logging
import os
import signal
import socket
import threading
import uuid
from collections.abc import Callable
from types import FrameType

from outbox.db.engine import (
    make_engine,
    parse_url,
    redact,
    translate_errors,
)
from outbox.db.migrate import check_schema
from outbox.registry import Outbox
from outbox.relay.hooks import HookRunner, warn_uncalled
from outbox.relay.intake import IntakeLoop
from outbox.relay.maintenance import Maintenance, TableUpkeep
from outbox.relay.notify import Listener, Wakeup
from outbox.relay.reconnect import Reconnector
from outbox.relay.router import Router, register_subscriptions
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


class Relay:
    """One relay: ``registry``'s handlers plus routing and maintenance for the whole
    database, configured by ``settings`` (``settings.database_url`` is required).

    ``route``, ``work``, ``maintain``, ``schedule`` and ``intake`` turn the router, the job
    runner, the reaper/pruner, the scheduler of the registry's schedules and its broker
    intakes (:class:`~outbox.relay.intake.IntakeLoop`, ``intake``) on or off (all on by
    default); the parts are ``router`` (:class:`~outbox.relay.router.Router`), ``runner``
    (:class:`~outbox.relay.runner.JobRunner`), ``maintenance``
    (:class:`~outbox.relay.maintenance.Maintenance`), ``scheduler`` and ``hooks``
    (:class:`~outbox.relay.hooks.HookRunner`: with the runner, when the registry declares
    failure hooks), each None when turned off, and ``listener``, None when polling only. Use :meth:`run` in a process (handles
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
                 work: bool = True, maintain: bool = True, schedule: bool = True, intake: bool = True,
                 worker_id: str | None = None) -> None:
        from outbox.errors import ConfigurationError

        url = settings.url()
        if url is None:
            raise ConfigurationError("no database configured: set OUTBOX_DATABASE_URL or pass --database-url")
        self.url = parse_url(url)
        self.registry = registry
        self.settings = settings
        self.worker_id = worker_id or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.stop_event = threading.Event()  # ends every part's loop
        self.wake_workers = Wakeup()
        wake_router = threading.Event()
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
                self.metrics, settings.metrics_interval, self.stop_event, schema=settings.schema_name)
        upkeep = TableUpkeep(settings.schema_name)  # may this role ANALYZE / VACUUM? (warns once if not)
        self.router = (Router(self.engine, settings, stop=self.stop_event, wake=wake_router,
                              wake_workers=self.wake_workers, reconnect=self.reconnect, metrics=self.metrics,
                              statistics=StatisticsKeeper(self.engine, schema=settings.schema_name, upkeep=upkeep))
                       if route else None)
        listen_url = settings.listen_target()
        self.listener = (Listener(parse_url(listen_url), wake_router, self.wake_workers, self.stop_event,
                                  reconnect=self.reconnect, schema=settings.schema_name,
                                  on_events=self.router.hint.lower if self.router is not None else None)
                         if listen_url else None)
        self.runner = (JobRunner(self.engine, registry, settings, self.worker_id, self.wake_workers,
                                 reconnect=self.reconnect, metrics=self.metrics) if work else None)
        self.maintenance = (Maintenance(self.engine, settings, stop=self.stop_event, wake_workers=self.wake_workers,
                                        reconnect=self.reconnect, upkeep=upkeep) if maintain else None)
        self.scheduler = (Scheduler(self.engine, registry.schedules, self.stop_event, self.reconnect,
                                    schema=settings.schema_name)
                          if schedule and registry.schedules else None)
        self.hooks = (HookRunner(self.engine, registry, settings, stop=self.stop_event, reconnect=self.reconnect,
                                 metrics=self.metrics)
                      if work and any(registry.hooks_of(c) for c in registry.consumers) else None)
        pulled = [i for i in registry.intakes if i.source.pulled]
        self.intake = (IntakeLoop(self.engine, pulled, settings, stop=self.stop_event, reconnect=self.reconnect,
                                  metrics=self.metrics) if intake and pulled else None)
        self._threads: list[threading.Thread] = []  # the gauges' and the scheduler's

    @property
    def stats(self) -> dict[str, int]:
        """The relay's tallies of routing and maintenance: the router's ``events_routed``,
        ``jobs_created``, ``events_unsubscribed`` and maintenance's ``reaped``,
        ``reaped_dead``, ``reaped_unstarted``, ``pruned_jobs``, ``pruned_events``,
        ``vacuums``, ``vacuums_skipped``, ``promoted`` and the failure hooks'
        ``hook_calls_ok``, ``hook_calls_failed``, ``hook_calls_gave_up`` (0 for a part turned
        off). The job runner's are in ``runner.stats``."""
        return {**dict.fromkeys(Router.COUNTS + Maintenance.COUNTS + HookRunner.COUNTS, 0),
                **(self.router.stats if self.router else {}), **(self.maintenance.stats if self.maintenance else {}),
                **(self.hooks.stats if self.hooks else {})}

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Check the database and schema, register subscriptions, start every thread."""
        schema = self.settings.schema_name
        with translate_errors(self.url, schema):
            with self.engine.connect() as conn:
                check_schema(conn, schema)
            register_subscriptions(self.engine, self.registry, self.settings)
            if self.runner:
                warn_uncalled(self.engine, schema)
            if self.scheduler:
                register_schedules(self.engine, self.registry.schedules, self.settings.schema_name)
        pool_size, overflow = self.settings.pool_limits()
        listen = (f"LISTEN on {redact(self.listener.conninfo)}" if self.listener else
                  f"polling only (every {self.settings.poll_interval:g}s)")
        # async transactional handlers: each worker thread may hold one connection of its own async engine
        async_tx = self.settings.concurrency if self.runner and any(
            s.transactional and s.is_async for s in self.registry) else 0
        log.info("relay started: worker %s, consumers %s, %s, database %s, pooler %s, schema %s; at most %d connections "
                 "(pool %d + overflow %d%s%s); %s",
                 self.worker_id, self.registry.consumers or "none",
                 self.runner.pacing.describe(len(self.runner.dispatchers)) if self.runner else "no job runner",
                 redact(self.url), self.settings.pooler, schema,
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
        if self.router:
            self.router.start()
        if self.runner:
            self.runner.start()
        if self.maintenance:
            self.maintenance.start()
        if self.hooks:
            self.hooks.start()
        if self.scheduler:
            self._spawn("outbox-scheduler", self.scheduler.run)
        if self.intake:
            for i in self.intake.intakes:
                log.info("intake %s: %s -> %s", i.name, i.source.describe(),
                         ", ".join(i.topics() or ("topic by message",)))
            self.intake.start()

    def stop(self, grace: float | None = None, cut_short: threading.Event | None = None) -> None:
        """Stop as on SIGTERM: stop claiming and routing, let in-flight handlers run for up
        to ``grace`` seconds (default ``shutdown_grace``; ``cut_short`` ends the wait
        early), release the rest (fenced), stop every thread, close the pool."""
        grace = self.settings.shutdown_grace if grace is None else grace
        self.stop_event.set()
        if self.router:
            self.router.stop()  # wakes its loop and the statistics keeper's
        if self.maintenance:
            self.maintenance.stop()
        if self.runner:
            self.runner.stop(grace, cut_short)
        for part in (self.router, self.maintenance, self.hooks):
            if part:
                part.join(timeout=5)
        for thread in self._threads:
            thread.join(timeout=5)
        if self.intake:
            self.intake.join(timeout=10)
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
        if self.intake:
            stats.update({f"intake_{name}": count for name, count in self.intake.stats.items()})
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
