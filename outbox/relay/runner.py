"""The job runner: the parts that claim, run, heartbeat and finish a relay's jobs, wired.

Threads (one concurrency model: threads, with one event loop per worker thread for
``async def`` handlers), each running one part (architecture notes, "The job runner"):

* the **dispatcher** (:class:`outbox.relay.dispatcher.Dispatcher`) owns one autocommit
  connection and runs the rounds: the **producer** (:class:`outbox.relay.producer.Producer`:
  room, the claim-order hint, claims, the prefetch buffer) claims, the **completer**
  (:class:`outbox.relay.completer.Completer`) writes outcomes; completions and the next claim go
  in one round trip (``job_complete_many`` then ``job_claim_after_many``) when both are due;
* the **starter** (:class:`outbox.relay.starter.Starter`) hands buffered jobs to workers as
  they come free, on its own connection;
* ``concurrency`` **worker threads** run handlers through the **executor**
  (:class:`outbox.relay.executor.JobExecutor`, which runs one job and says how it ended;
  ``outbox.testing.drain`` uses the same one); a worker is free again the moment its
  handler returns (the claim stays held, and heartbeated, until its outcome is written);
* the **heartbeat** (:class:`outbox.relay.heartbeat.Heartbeater`) renews the leases of every
  claim held, buffered ones included, every lease/3 (of the shortest lease);
* the **watchdog** (:class:`outbox.relay.watchdog.Watchdog`, only when a subscriber has a
  ``timeout``) fails the attempts of handlers that run past their timeout;
* the **forwarder** (:class:`outbox.relay.forwarder.Forwarder`, only when the registry declares
  forwarders) sends forwarders' jobs to their brokers in batches, from one event loop, in
  place of worker threads; its outcomes go to the dispatcher like the workers'.
* the **look-out** (:class:`outbox.relay.notify.Lookout`, thread ``outbox-claim-lookout``) looks
  every second, on a connection of its own, for a due ready job before the claim-order hint
  that no wake-up announced (:meth:`JobRunner.look_behind`), and lowers the hint to it.

What they share is :class:`outbox.relay.claims.HeldClaims` (under one lock) and two queues: jobs
to run (producer and starter to workers) and outcomes (workers to the dispatcher).

Shutdown (:meth:`JobRunner.stop`): stop claiming, release buffered claims at once, let
running handlers finish for the grace period, release (fenced) what is still held so other
relays claim it at once, flush outcomes.

Database outages: every loop retries and carries on, through the relay's shared
:class:`~outbox.relay.reconnect.Reconnector`; an outcome that could not be written is retried
until it is, or until the relay stops (then the lease expires and the reaper takes the job
back: at-least-once).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox.db import poison
from outbox.db.engine import describe, make_async_engine
from outbox.db.jobs import RelayInfo, first_ready_before, notify_head, package_version, release_jobs
from outbox.errors import HandlerTimeoutError
from outbox.job import Job
from outbox.registry import FORWARD_TIMEOUT, Outbox, Subscriber
from outbox.relay import pacing, transaction
from outbox.relay.claim import Claim, jobs_of
from outbox.relay.claims import HeldClaims, Signals
from outbox.relay.completer import Completer
from outbox.relay.counters import Counters
from outbox.relay.dispatcher import Dispatcher, RelayConnection, RelayRow
from outbox.relay.executor import JobExecutor, WorkerContext
from outbox.relay.forwarder import Forwarder
from outbox.relay.heartbeat import Heartbeater
from outbox.relay.notify import ClaimKey, Lookout, Wakeup
from outbox.relay.outcomes import Failure, Outcome
from outbox.relay.pacing import Pacing
from outbox.relay.producer import ClaimHint, Producer
from outbox.relay.reconnect import Reconnector
from outbox.relay.starter import Starter
from outbox.relay.watchdog import Watchdog
from outbox.settings import OutboxSettings
from outbox.sinks import resend_span
from outbox.telemetry.logs import job_fields
from outbox.telemetry.metrics import RelayMetrics

log = logging.getLogger(__name__)

#: Longest stop() waits past the grace period for the dispatcher's last round to return,
#: seconds: a claim still executing then has its jobs released, not left to their leases.
STOP_ROUND_WAIT = 5.0


class JobRunner:
    """Claims and runs the jobs of ``registry``'s consumers until :meth:`stop` is called.

    ``wake`` is set (by LISTEN, the router or the reaper) when new jobs may be ready;
    polling every ``settings.poll_interval`` seconds is the fallback. The runner holds up to
    ``concurrency + prefetch`` claims whose handlers have not returned: ``concurrency``
    running and up to ``prefetch`` waiting in the buffer (their leases run from the claim
    and are heartbeated like the running ones; on SIGTERM they are released at once).

    Attempts and crashes: a claim counts an attempt, and the relay's row of
    ``outbox_relays`` lists the fences of its buffered claims, written in the statement that
    claims them and rewritten (without it) before a buffered job goes to a worker; the
    reaper gives the attempt back to an expired claim still listed. So a ``kill -9`` never
    charges a job whose handler had not started, and a handler that kills its process is
    charged each time it starts.
    """

    def __init__(self, engine: Engine, registry: Outbox, settings: OutboxSettings,
                 worker_id: str, wake: Wakeup, *, reconnect: Reconnector | None = None,
                 async_engine: Callable[[], AsyncEngine] | None = None, metrics: RelayMetrics | None = None) -> None:
        self.engine = engine
        self.metrics = metrics  # outbox.telemetry.metrics: per-consumer counts and timings, when the relay serves them
        self.settings = settings
        self.schema = settings.schema_name  # every statement runs on this schema's tables
        self.worker_id = worker_id
        self.wake = wake
        self.reconnect = reconnect or Reconnector(settings.reconnect_max)  # the relay's, shared by its loops
        self.subscribers: dict[str, Subscriber] = {s.consumer: s for s in registry}
        self.leases = {s.consumer: s.lease or settings.default_lease for s in registry}
        # Each consumer's retry policy (outbox.retry), its backoff filled from settings: refused here if it does not fit.
        self.policies = registry.retry_policies(settings)
        self.stats = Counters(("claimed", "completed", "cancelled", "retried", "dead", "stale", "lease_lost",
                               "released", "retried_in_place", "snoozed", "timed_out", "superseded"))
        # Handlers run in the worker threads through one executor; an async transactional
        # handler's thread makes an async engine of one connection on first use.
        self._async_engine = async_engine or (lambda: make_async_engine(
            engine.url, pool_size=1, max_overflow=0, application_name="outbox-relay",
            prepared_statements=settings.pooler == "none"))
        forwarders = {c: s for c, s in self.subscribers.items() if s.sink is not None}
        for consumer, sub in forwarders.items():  # before the forwarder connects them
            within, why = resend_span(lease=self.leases[consumer], reap_interval=settings.reap_interval,
                                      poll_interval=settings.poll_interval, timeout=sub.timeout or FORWARD_TIMEOUT,
                                      max_attempts=sub.max_attempts, backoff_base=self.policies[consumer].base,
                                      backoff_cap=self.policies[consumer].cap)
            assert sub.sink is not None
            sub.sink.expect_resends(within, f"forwarder {consumer}: {why}")
        self.claims = HeldClaims(settings.concurrency, settings.forward_window if forwarders else 0, forwarders)
        # Shared by the dispatchers: how far claims run ahead, and (no transactional handler) the elastic pool.
        elastic = not any(s.transactional and s.sink is None for s in registry)
        self.pacing = Pacing(settings, self.claims, self._grow if elastic else None)
        self._workers = 0  # worker threads started, and the lock that counts them
        self._workers_lock = threading.Lock()
        self.signals = Signals()
        self._todo: queue.SimpleQueue[Claim | None] = queue.SimpleQueue()
        self._outcomes: queue.SimpleQueue[tuple[Claim, Any] | None] = queue.SimpleQueue()
        self.hint = hint = ClaimHint()  # shared: each dispatcher claims after the latest claim of any of them
        self.quarantine = poison.Quarantine("job")  # shared: a poison row found by one is skipped by all
        # A second dispatcher on standby when the setting is not given (outbox.relay.pacing): it
        # runs rounds only while the backlog is deep, on a connection the pool has room for.
        standby = "dispatchers" not in settings.model_fields_set and sum(settings.pool_limits()) > settings.pool_needed()
        count = settings.dispatchers + (1 if standby else 0)
        row = RelayRow(self.claims, worker_id, self.schema, count, RelayInfo(
            package_version(), tuple(registry.consumers), settings.concurrency))
        self.dispatchers = [self._dispatcher(engine, row, hint, wake if count == 1 else wake.branch())
                            for _ in range(count)]
        if standby:
            self.dispatchers[-1].standby = self.pacing.deep
        if metrics is not None:
            metrics.pacing = lambda: self.pacing.reading(standby)
        self.dispatcher = self.dispatchers[0]
        self.producer, self.completer = self.dispatcher.producer, self.dispatcher.completer
        self.starter = Starter(engine, settings, self.claims, worker_id, self._start, self._post_outcome,
                               self.signals, self.reconnect)
        self.heartbeater = Heartbeater(engine, self.claims, min(self.leases.values(), default=30.0) / 3,
                                       self.signals, self.reconnect, self.stats, self.schema, metrics=metrics)
        self.watchdog = (Watchdog(self._timed_out)
                         if any(s.timeout is not None and s.sink is None for s in registry) else None)
        self.executor = JobExecutor(settings, transaction.HandlerConnections(engine, settings.reconnect_max),
                                    held=self._holds, stopping=self.signals.draining,
                                    completing=lambda job: self.claims.mark_finishing(job.fence),
                                    abandoned=lambda job: self.claims.unmark_finishing(job.fence), stats=self.stats,
                                    watchdog=self.watchdog, policies=self.policies)
        self.forwarder = Forwarder(forwarders, self.claims, self._post, self.executor.failure, self.signals,
                                   wake.poke, self.stats, metrics=metrics) if forwarders else None
        if self.forwarder is not None:
            for dispatcher in self.dispatchers:
                dispatcher.producer.exclude(self.forwarder.unavailable)
        self._threads: list[threading.Thread] = []

    def _dispatcher(self, engine: Engine, row: RelayRow, hint: ClaimHint, wake: Wakeup) -> Dispatcher:
        """One dispatcher with a connection, a producer and a completer of its own; what the
        dispatchers share is the runner's claims, the relay's row and the outcomes queue."""
        connection = RelayConnection(engine, row)
        completer = Completer(self.claims, connection.get, self.stats, self.schema,
                              subscribers=self.subscribers, wake=self.wake, metrics=self.metrics,
                              keep_done=self.settings.keep_done)
        producer = Producer(self.settings, self.claims, self.leases, self.worker_id, wake, self._start, self.stats,
                            subscribers=self.subscribers, metrics=self.metrics, hint=hint, quarantine=self.quarantine,
                            pacing=self.pacing)
        return Dispatcher(self.settings, self.claims, producer, completer, connection, self._outcomes, wake,
                          self.signals, self.reconnect)

    # ------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Start the dispatcher, starter, worker and heartbeat threads (daemon threads, so a
        handler stuck past the shutdown grace period cannot keep the process alive)."""
        if not self.subscribers:
            return
        for n, dispatcher in enumerate(self.dispatchers):
            self._spawn("outbox-dispatcher" + (f"-{n}" if n else ""), dispatcher.run)
        self._spawn("outbox-starter", self.starter.run)
        if self.forwarder is not None:
            self._spawn("outbox-forwarder", self.forwarder.run)
        if any(s.sink is None for s in self.subscribers.values()):
            self._add_workers(self.settings.concurrency)
        self._spawn("outbox-heartbeat", self.heartbeater.run)
        self._spawn("outbox-claim-lookout", Lookout(self.engine, self.look_behind, "claim-lookout",
                                                    self.signals.stop_claiming, self.reconnect).run)
        if self.watchdog is not None:
            self._spawn("outbox-watchdog", self.watchdog.run)

    def _spawn(self, name: str, target: Callable[[], None]) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _add_workers(self, n: int) -> None:
        """Start ``n`` worker threads; those beyond ``concurrency`` end after ``IDLE_EXIT``
        seconds without a job (:mod:`outbox.relay.pacing`)."""
        with self._workers_lock:
            first, self._workers = self._workers, self._workers + n
            self._threads = [t for t in self._threads if t.is_alive()]
            for k in range(first, first + n):
                self._spawn(f"outbox-worker-{k}", self._work_loop)

    def _grow(self, n: int) -> None:
        """The pacing asks for ``n`` more worker threads (an elastic pool: handlers that wait),
        or, ``n`` negative, for that many fewer: the slots go at once, and threads beyond the
        pool's size end as they finish their jobs (:meth:`_retire_extra`)."""
        if n > 0 and self.signals.stop_claiming.is_set():
            return
        self.claims.add_threads(n)
        if n > 0:
            self._add_workers(n)

    def _retire_extra(self) -> bool:
        """Whether this worker thread ends now: more threads run than the pool's slots (it
        shrank), so one of them, this one, leaves."""
        with self._workers_lock:
            if self._workers > self.claims.concurrency:
                self._workers -= 1
                return True
            return False

    def look_behind(self, conn: Connection) -> ClaimKey | None:
        """The first due ready job before the claim hint that the main claims take
        (``job_first_ready_before``: the consumers of every dispatcher's claims, quarantined
        ids left out) on ``conn``: the next claim starts before it (``Wakeup.lower``, which
        also wakes the dispatchers). Returns its key, or None when there is none or no claim
        has taken a job yet (claims then start from the head anyway)."""
        before = self.hint.key()
        if before is None:
            return None
        consumers = sorted({c for d in self.dispatchers for c in d.producer.claim_leases()})
        first = first_ready_before(conn, before, consumers, self.quarantine.ids(), schema=self.schema) \
            if consumers else None
        if first is not None:
            priority, run_at, job_id = first
            self.wake.lower((priority, run_at, job_id - 1))  # claims start after the key: this job is next
        return first

    def in_flight(self) -> int:
        """Claims this runner holds: buffered, running, or waiting for their outcome to be written."""
        return self.claims.count()

    def stop(self, grace: float, cut_short: threading.Event | None = None) -> None:
        """Stop claiming; release buffered claims at once; let running handlers finish for up
        to ``grace`` seconds (or until ``cut_short`` is set); release (fenced) what is still
        held so other relays can claim it at once; flush outcomes.

        A claim in flight when this is called is waited for (the dispatcher says when it has
        stopped claiming, at most ``grace`` seconds): counting what is held before that
        would miss the jobs the claim is about to return."""
        if not self._threads:
            return
        signals = self.signals
        signals.stop_claiming.set()
        signals.draining.set()
        self.wake.poke()
        deadline = time.monotonic() + grace
        cut = cut_short or threading.Event()
        while (not all(d.closed.wait(0.02) for d in self.dispatchers) and time.monotonic() < deadline
               and not cut.is_set()):
            pass
        while self.in_flight() and time.monotonic() < deadline and not cut.is_set():
            time.sleep(0.02)
        left = self.claims.unfinished()  # buffered claims are the dispatcher's to release (at once, draining)
        if left:
            for claim in left:
                claim.job.mark_lease_lost()
            self._release_now(left)
        with self._workers_lock:
            workers = self._workers
        for _ in range(workers):
            self._todo.put(None)
        for _ in self.dispatchers:
            self._outcomes.put(None)  # one closing marker for each dispatcher
        signals.stopped.set()
        if self.watchdog is not None:
            self.watchdog.stop()
        self.wake.poke()
        self.claims.wake_all()
        for thread in self._threads:
            if thread.name.startswith("outbox-dispatcher") or thread.name in ("outbox-starter", "outbox-forwarder"):
                # Past the grace period only while a round is still out (a claim that returns
                # late must still have its jobs released before the process exits).
                thread.join(timeout=max(0.5, deadline - time.monotonic()) + STOP_ROUND_WAIT)
            else:
                thread.join(timeout=0.05)

    def _release_now(self, claims: list[Claim]) -> None:
        """Release, in one autocommit statement of their own, claims whose handlers are
        still running at the end of the grace period."""
        try:
            with self.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                released = release_jobs(conn, jobs_of(claims), schema=self.schema)
                if released:
                    notify_head(conn, schema=self.schema)
        except DBAPIError as exc:
            log.warning("could not release %d jobs on shutdown (%s); their leases will expire", len(claims),
                        describe(exc))
            return
        self.stats.add("released", len(released))
        if self.metrics is not None:
            self.metrics.jobs("released", (c.consumer for c in claims if c.id in released))
        log.info("released %d jobs still running after the grace period", len(released),
                 extra={"job_ids": sorted(released)})
        self.claims.released_at_shutdown(claims)

    # ------------------------------------------------------------- workers

    def _start(self, claims: list[Claim]) -> None:
        """Start claimed jobs whose places are taken: forwarders' to the forwarder, the
        others to the worker threads."""
        forwarded = []
        for claim in claims:
            if self.claims.is_forwarded(claim):
                forwarded.append(claim)
            else:
                self._todo.put(claim)
        if forwarded and self.forwarder is not None:
            self.forwarder.submit(forwarded)

    def _work_loop(self) -> None:
        context = WorkerContext(self._async_engine)
        # Handlers' CPU share is measured only for an elastic pool (the pacing's rule to grow it).
        floor, handled = self.settings.concurrency, self.pacing.handled if self.pacing.grow else None
        try:
            while True:
                try:
                    claim = self._todo.get(timeout=pacing.IDLE_EXIT)
                except queue.Empty:
                    if self._retire_extra():  # the pool shrank meanwhile
                        break
                    if self.claims.retire_thread(floor):
                        with self._workers_lock:
                            self._workers -= 1
                        break
                    continue
                if claim is None:
                    break
                # A job handed ahead waits in the queue: after a pause (SIGSTOP, a starved
                # process) its lease may have run out and another relay taken it, or a later
                # job of its ordered key; like the starter's buffered claims, it is released
                # (fenced: nothing if it was reaped), never started.
                if self.signals.draining.is_set() or claim.lease_lost or time.monotonic() >= claim.lease_bound:
                    self._post(claim, Outcome.RELEASE)
                    continue
                cpu = time.thread_time() if handled else 0.0
                started = claim.started = time.monotonic()  # for metrics and the job's log lines
                outcome = self.executor.run(claim.job, self.subscribers[claim.consumer], context)
                claim.ran = time.monotonic() - started
                if handled:
                    handled(claim.ran, time.thread_time() - cpu)
                if outcome is Outcome.TIMED_OUT:  # the watchdog failed the attempt already
                    hung = self.claims.unhang()
                    log.info("the hung handler of job %s (%s) returned; its worker slot is free again (%d of %d "
                             "slots still held by hung handlers)", claim.id, claim.consumer, hung,
                             self.claims.concurrency, extra=claim.fields())
                else:
                    self._post(claim, outcome)
                if self._workers > self.claims.concurrency and self._retire_extra():
                    break
        finally:
            context.close()

    def _post(self, claim: Claim, outcome: Any) -> None:
        """Hand a finished handler's outcome to the dispatcher; its worker slot is free now
        (the claim stays held, and heartbeated, until the outcome is written)."""
        self.claims.slot_freed(claim)
        self._post_outcome(claim, outcome)

    def _post_outcome(self, claim: Claim, outcome: Any) -> None:
        self._outcomes.put((claim, outcome))
        self.wake.poke()

    def _timed_out(self, job: Job, seconds: float) -> None:
        """The watchdog fired: ``job``'s handler ran past its timeout. Its attempt fails
        (counted, fenced; backoff, or dead when out of attempts) and the job goes back so
        any relay can run it; the thread keeps its worker slot until it returns."""
        self.stats.add("timed_out")
        if self.metrics is not None:
            self.metrics.jobs("timed_out", [job.consumer])
        # The subscriber's timeout, not the watchdog's: an async handler is watched one second
        # past it, as a backstop for one that blocks its event loop.
        seconds = self.subscribers[job.consumer].timeout or seconds
        hung = self.claims.hang()
        log.warning("job %s (%s) fence %s: handler still running after its timeout of %gs; attempt %s/%s failed and "
                    "the job handed back. Its thread cannot be stopped and keeps its worker slot: %d of %d slots "
                    "held by hung handlers", job.id, job.consumer, job.fence, seconds, job.attempt, job.max_attempts,
                    hung, self.claims.concurrency, extra=job_fields(job, outcome="timed_out", timeout_seconds=seconds))
        if self.claims.all_hung():
            log.error("every worker slot (%d) is held by a hung handler: this relay claims nothing, and hands its "
                      "buffered jobs back, until one returns (restart it to free them)", hung)
        outcome = self.executor.failure(job, HandlerTimeoutError(seconds))
        claim = self.claims.get(job.fence)
        if claim is None:  # released at shutdown meanwhile: nothing held any more
            return
        if isinstance(outcome, Failure):
            self.claims.mark_finishing(claim.fence)
            self._post_outcome(claim, replace(outcome, timed_out=True))
        else:  # the claim was lost meanwhile: nothing to write, and nothing held any more
            self.claims.forget([claim])

    def _holds(self, job: Job) -> bool:
        """Whether this runner still holds ``job``'s claim: held, not lost to a heartbeat,
        and its lease not past the local bound renewed by each heartbeat."""
        if job.lease_lost:
            return False
        claim = self.claims.get(job.fence)
        return claim is not None and time.monotonic() < claim.lease_bound
