"""The forwarder: the runner's part that sends forwarders' jobs to their brokers.

A forwarder (:meth:`outbox.Outbox.forward`) is a consumer like any other up to the moment
its job would start: it is routed, claimed (fence, lease, attempt), buffered, heartbeated,
and its outcome is written by the dispatcher in the same fenced statements as a handler's.
Where a handler's job goes to a worker thread, a forwarder's goes here (forwarding
notes):

* **One thread, one event loop** for every sink of the relay (the brokers' clients are
  asyncio libraries). Jobs arrive through :meth:`Forwarder.submit` from the producer and the
  starter; they take a place in the forwarding window (``forward_window``), not a worker
  slot.
* **Batches.** Per forwarder, one batch at a time: every job waiting for it is made a
  :class:`~outbox.sinks.Message` (the payload's stored JSON text, byte for byte) and the
  batch goes to :meth:`Sink.send_many`, which sends all of it before it waits for the
  broker's acknowledgements. Each result becomes the job's outcome: delivered -> done (the
  completion is written, fenced, with the round's other completions); failed -> a failed
  attempt (backoff, or dead once out of attempts; at once when permanent), its
  ``last_error`` the broker's answer; broker unreachable -> released, attempt not counted.
  A job whose lease was lost before it was sent is released unsent; one lost while it was
  in flight has its outcome dropped by the fence, as any job's.
* **Outages.** A batch of which no message was answered in time counts as an outage too
  (a silent broker on a connection that looks up: a partition, a stalled server), as does,
  for RabbitMQ, a missing exchange; after such a batch the forwarder stays out of claims
  for a growing pause (0.5 s doubling to 10 s). A keeper task per sink connects it, and reconnects it with backoff when its
  connection is down; meanwhile the forwarder is in :meth:`unavailable` and the producer
  claims none of its jobs (they wait, ready, in the table: an outage never costs an
  attempt). It logs once when a broker becomes unreachable and once when it is back: back
  means a batch was delivered, or, after an outage of the connection itself, that the sink
  has reconnected and knows of nothing in the way (:attr:`Sink.destination_problem`). A
  pause running out is not "back": the next batch may find the same outage (a missing
  exchange, a silent broker), which is no new state to log.

Crash safety is the broker's message id: a relay killed after the broker stored a message
and before the completion committed leaves the job running; the reaper hands it out again
and the re-send carries the same id (the job's idempotency key), which JetStream's duplicate
window drops and which a RabbitMQ consumer can drop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

from . import backoff, tracing
from .claims import HeldClaims, Signals
from .counters import Counters
from .errors import ForwardingError, UndeliverableError
from .job import Job
from .metrics import FORWARD_RESULTS, RelayMetrics
from .registry import Subscriber
from .sinks import Delivered, Failed, Message, Sink, SinkUnavailableError, Unavailable
from .worker import Outcome

log = logging.getLogger("outbox.forward")

#: Seconds between checks of a sink's connection while it is up.
WATCH_INTERVAL = 0.2
#: Longest pause between two connection attempts to an unreachable broker, seconds.
RECONNECT_CAP = 10.0


def message_for(job: Job) -> Message:
    """The broker message of ``job``: its payload's stored JSON text as the body, its event's
    headers as strings (a value that is not a string as its JSON text)."""
    headers = {str(k): v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)
               for k, v in (job.headers or {}).items()}
    created = job.event_created_at or datetime.now(UTC)
    return Message(job_id=job.id, event_id=job.event_id, consumer=job.consumer, topic=job.topic, key=job.key,
                   idempotency_key=job.idempotency_key, created_at=created,
                   body=job.payload_json.encode("utf-8"), headers=headers)


class Forwarder:
    """Sends the jobs of ``forwarders`` (consumer -> its :class:`Subscriber` with a sink) held
    in ``claims`` (see the module notes). ``post(job, outcome)`` hands an outcome to the
    dispatcher (and frees the job's place in the window); ``failure(job, exc)`` makes the
    outcome of a failed attempt (the executor's: backoff, permanent errors); ``wake()`` is
    called when a sink comes back, so claims resume at once. Runs in its own thread
    (:meth:`run`) until ``signals.stopped``."""

    def __init__(self, forwarders: Mapping[str, Subscriber], claims: HeldClaims,
                 post: Callable[[Job, Any], None], failure: Callable[[Job, BaseException], Any],
                 signals: Signals, wake: Callable[[], None], stats: Counters, *,
                 metrics: RelayMetrics | None = None) -> None:
        self.forwarders = dict(forwarders)
        self.metrics = metrics
        self.claims = claims
        self.post = post
        self.failure = failure
        self.signals = signals
        self.wake = wake
        self.stats = stats
        self._inbox: queue.SimpleQueue[Job] = queue.SimpleQueue()
        self._down: set[str] = set(self.forwarders)  # until its sink first connects
        self._announced: dict[str, bool] = {}  # consumer -> the last state logged (True: up)
        # Outages a batch found while the connection looked up (silent broker, missing
        # exchange): only a delivered batch ends them, not a reconnect or a pause running out.
        self._unconfirmed: set[str] = set()
        # Batches in a row that found the broker unavailable, and until when (monotonic) the
        # forwarder stays out of claims although its connection looks up.
        self._outages: dict[str, int] = {}
        self._hold_until: dict[str, float] = {}
        self._down_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._arrived: asyncio.Event | None = None

    # ------------------------------------------------------------- other threads

    def submit(self, jobs: list[Job]) -> None:
        """Queue claimed jobs of forwarders for sending (any thread)."""
        for job in jobs:
            self._inbox.put(job)
        loop, arrived = self._loop, self._arrived
        if jobs and loop is not None and arrived is not None:
            try:
                loop.call_soon_threadsafe(arrived.set)
            except RuntimeError:  # the loop has closed: the relay is stopping
                pass

    def unavailable(self) -> frozenset[str]:
        """The forwarders whose broker is unreachable now: the producer does not claim them."""
        with self._down_lock:
            return frozenset(self._down)

    # ------------------------------------------------------------- the loop

    def run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._arrived = asyncio.Event()
        waiting: dict[str, list[Job]] = {c: [] for c in self.forwarders}
        ready = {c: asyncio.Event() for c in self.forwarders}
        tasks = [asyncio.create_task(self._keep(sub)) for sub in self.forwarders.values()]
        tasks += [asyncio.create_task(self._send_loop(sub, waiting[c], ready[c])) for c, sub in self.forwarders.items()]
        try:
            while not self.signals.stopped.is_set():
                try:
                    await asyncio.wait_for(self._arrived.wait(), 0.2)
                except TimeoutError:
                    pass
                self._arrived.clear()
                while True:
                    try:
                        job = self._inbox.get_nowait()
                    except queue.Empty:
                        break
                    waiting[job.consumer].append(job)
                    ready[job.consumer].set()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            # Jobs still waiting here are released by the runner's stop(), as unfinished claims.
            for sub in self.forwarders.values():
                try:
                    await _sink(sub).close()
                except Exception:  # noqa: BLE001 - closing on the way out
                    log.debug("closing the sink of %s failed", sub.consumer, exc_info=True)

    async def _send_loop(self, sub: Subscriber, waiting: list[Job], ready: asyncio.Event) -> None:
        """Send the jobs of one forwarder as they arrive, one batch at a time."""
        while True:
            await ready.wait()
            ready.clear()
            batch = waiting[:]
            del waiting[:]
            if batch:
                await self._send(sub, batch)

    async def _send(self, sub: Subscriber, jobs: list[Job]) -> None:
        sink = _sink(sub)
        sendable: list[Job] = []
        for job in jobs:
            if self.signals.draining.is_set() or job.lease_lost:
                self.post(job, Outcome.RELEASE)  # not sent: the claim goes back, attempt not counted
            else:
                sendable.append(job)
        if not sendable:
            return
        if not sink.connected:
            self._mark_down(sub, "not connected")
            for job in sendable:
                self.post(job, Outcome.RELEASE)
            return
        started = time.monotonic()
        for job in sendable:
            job._started = started  # the broker round trip is a forwarded job's "handler" (metrics)
        span = (tracing.send_span(sub.consumer, sink.extra or tracing.SYSTEM, sink.describe(), sendable)
                if tracing.active() else contextlib.nullcontext())
        with span as current:
            try:
                messages = [message_for(job) for job in sendable]
                results = await sink.send_many(messages, sub.timeout or 10.0)
                if len(results) != len(messages):
                    raise RuntimeError(f"the sink answered {len(results)} results for {len(messages)} messages")
            except Exception as exc:  # noqa: BLE001 - a sink's bug fails the attempts, it does not stop forwarding
                log.exception("forwarder %s: sending a batch of %d failed", sub.consumer, len(sendable))
                results = [Failed(f"the sink raised {type(exc).__name__}: {exc}")] * len(sendable)
            if current is not None:
                tracing.record_send(current, sum(isinstance(r, Delivered) for r in results),
                                    sum(isinstance(r, Failed) for r in results),
                                    sum(isinstance(r, Unavailable) for r in results))
        silent = [r for r in results if isinstance(r, Failed) and r.unanswered]
        if results and len(silent) == len(results):
            # Not one message answered in time, on a connection that looks up: the broker is
            # silent (a partition, a stalled server), not the messages bad. Counting attempts
            # would dead-letter the backlog for an outage: release them, as when it is down.
            results = [Unavailable(f"no message of a batch of {len(results)} answered: {silent[0].error}")
                       for _ in results]
        lost = False
        ran = time.monotonic() - started
        tally = dict.fromkeys(FORWARD_RESULTS, 0)
        for job, result in zip(sendable, results):
            job._ran = ran
            if isinstance(result, Delivered):
                tally["duplicate" if result.duplicate else "delivered"] += 1
                self.stats.add("forwarded")
                if result.duplicate:
                    self.stats.add("forward_duplicates")
                self.post(job, Outcome.DONE)
            elif isinstance(result, Unavailable):
                lost = True
                tally["unavailable"] += 1
                self.post(job, Outcome.RELEASE)
            else:
                tally["failed"] += 1
                error: ForwardingError = (UndeliverableError(result.error) if result.permanent
                                          else ForwardingError(result.error))
                self.post(job, self.failure(job, error))
        if self.metrics is not None:
            self.metrics.forwarded(sub.consumer, tally)
        if lost:
            self._outages[sub.consumer] = self._outages.get(sub.consumer, 0) + 1
            pause = backoff.retry_delay(self._outages[sub.consumer], base=0.5, cap=RECONNECT_CAP, jitter=0.25)
            self._hold_until[sub.consumer] = time.monotonic() + pause
            self._mark_down(sub, next(r.error for r in results if isinstance(r, Unavailable)))
        elif tally["delivered"] or tally["duplicate"]:
            self._outages.pop(sub.consumer, None)
            self._mark_delivered(sub)

    # ------------------------------------------------------------- connections

    async def _keep(self, sub: Subscriber) -> None:
        """Keep ``sub``'s sink connected: connect, watch, reconnect with backoff."""
        sink = _sink(sub)
        failures = 0
        while True:
            if sink.connected:
                failures = 0
                # After a batch found the broker unavailable on a connection that looks up
                # (silent, or the exchange missing), wait out a growing pause before claiming.
                if time.monotonic() >= self._hold_until.get(sub.consumer, 0.0):
                    self._mark_up(sub)
                await asyncio.sleep(WATCH_INTERVAL)
                continue
            try:
                await sink.connect()
            except SinkUnavailableError as exc:
                failures += 1
                self._mark_down(sub, str(exc))
                await asyncio.sleep(backoff.retry_delay(failures, base=0.5, cap=RECONNECT_CAP, jitter=0.25))
            except Exception as exc:  # noqa: BLE001 - a client's surprise must not end the keeper
                failures += 1
                self._mark_down(sub, f"{type(exc).__name__}: {exc}")
                await asyncio.sleep(backoff.retry_delay(failures, base=0.5, cap=RECONNECT_CAP, jitter=0.25))

    def _mark_down(self, sub: Subscriber, why: str) -> None:
        """No claims for ``sub``; logged when it was not already reported unreachable."""
        sink = _sink(sub)
        with self._down_lock:
            self._down.add(sub.consumer)
            if sink.connected:  # found by a batch on a connection that looks up
                self._unconfirmed.add(sub.consumer)
            changed = self._announced.get(sub.consumer) is not False
            self._announced[sub.consumer] = False
        if changed:
            self._log_down(sub, why)

    def _mark_up(self, sub: Subscriber) -> None:
        """Claims for ``sub`` again (the sink is connected, any pause over); logged as back
        only when the outage was the connection's and the sink knows of nothing in the way,
        else the next delivered batch says it (:meth:`_mark_delivered`)."""
        problem = _sink(sub).destination_problem
        with self._down_lock:
            was_down = sub.consumer in self._down
            self._down.discard(sub.consumer)  # a batch may check the broker again
            if problem is not None:
                self._unconfirmed.add(sub.consumer)
            down = problem is not None and self._announced.get(sub.consumer) is not False
            back = sub.consumer not in self._unconfirmed and self._announced.get(sub.consumer) is not True
            if down or back:
                self._announced[sub.consumer] = back
        if down:
            self._log_down(sub, problem or "")
        if back:
            log.info("forwarder %s: connected to %s", sub.consumer, _sink(sub).describe())
        if was_down:
            self.wake()

    def _mark_delivered(self, sub: Subscriber) -> None:
        """A batch of ``sub`` was delivered: its broker is back, if it was reported unreachable."""
        with self._down_lock:
            self._unconfirmed.discard(sub.consumer)
            back = self._announced.get(sub.consumer) is False
            if back:
                self._announced[sub.consumer] = True
        if back:
            log.info("forwarder %s: connected to %s", sub.consumer, _sink(sub).describe())

    def _log_down(self, sub: Subscriber, why: str) -> None:
        log.warning("forwarder %s: broker unreachable (%s: %s); its jobs wait, and this relay claims none "
                    "until it is back", sub.consumer, _sink(sub).describe(), why)


def _sink(sub: Subscriber) -> Sink:
    assert sub.sink is not None  # only forwarders are given to the Forwarder
    return sub.sink
