"""The forwarder: the runner's part that sends forwarders' jobs to their brokers.

A forwarder (:meth:`outbox.Outbox.forward`) is a consumer like any other up to the moment
its job would start: it is routed, claimed (fence, lease, attempt), buffered, heartbeated,
and its outcome is written by the dispatcher in the same fenced statements as a handler's.
Where a handler's job goes to a worker thread, a forwarder's goes here (forwarding
notes):

* **One thread, one event loop** for every sink of the relay (the brokers' clients are
  asyncio libraries). Jobs arrive through :meth:`Forwarder.submit` from the starter, which
  hands a forwarder's jobs over only while the forwarding window (``forward_window``:
  messages sent and not yet answered, every forwarder of the relay together) has room;
  they take a place in it, not a worker slot.
* **Attempts start at the hand-off.** A forwarder's claims are always buffered first,
  listed in the relay's row of ``outbox_relays`` (:class:`~outbox.db.jobs.BufferMark`), and
  the starter unlists them just before it hands them here: a claim the relay never sent
  (paused, killed, its window full) costs no attempt when the reaper takes it back
  (the promise "attempts count starts, not claims"). Issue 26, item 9 (b).
* **A pipeline, not batch after batch.** The jobs of each hand-off are made
  :class:`~outbox.sinks.Message` s (the payload's stored JSON text, byte for byte) and sent
  at once by :meth:`Sink.send_many` in a task of their own, whatever earlier sends still
  wait for: the window, not a round trip, bounds what is in flight. Each broker answer
  becomes its job's outcome as it arrives (``answered``), so a job never waits for another
  message's acknowledgement, nor for a silent one's timeout (issue 26, item 9 (a)):
  delivered -> done (the completion is written, fenced, with the round's other
  completions); failed -> a failed attempt (backoff, or dead once out of attempts; at once
  when permanent), its ``last_error`` the broker's answer; broker unreachable -> released,
  attempt not counted. What the broker has not answered when the send's ``timeout`` ends
  fails, or counts as an outage (below).
* **Nothing is sent for a claim that may be lost.** A claim's lease runs out, by the
  database's clock, no earlier than the relay's own bound of it (``Claim.lease_bound``: the
  monotonic time the claim or the last heartbeat was sent, plus the lease). A message's
  ``deadline`` is that bound less a safety margin (:func:`send_deadline`), and it is
  checked immediately before each hand-off to the broker: here, and by the sink right
  before each publish (after any wait for room). A message past it is not sent
  (:class:`~outbox.sinks.Expired`) and its job is released (fenced, attempt not counted):
  another relay may already have re-claimed it, and the message it sends is the only one.
  A job whose lease the heartbeat found lost is released unsent too; one lost while its
  message was in flight has its outcome dropped by the fence, as any job's. Issue 26,
  item 2.
* **Outages.** A send of which no message was answered in time, while the broker answered
  nothing else either, counts as an outage (a silent broker on a connection that looks up:
  a partition, a stalled server), as does, for RabbitMQ, a missing exchange; after such a
  send the forwarder stays out of claims for a growing pause (0.5 s doubling to 10 s). A
  message left unanswered while others were answered is a failed attempt. A keeper task
  per sink connects it, and reconnects it with backoff when its connection is down;
  meanwhile the forwarder is in :meth:`unavailable` and the producer claims none of its
  jobs (they wait, ready, in the table: an outage never costs an attempt). It logs once
  when a broker becomes unreachable and once when it is back: back means a message was
  delivered, or, after an outage of the connection itself, that the sink has reconnected
  and knows of nothing in the way (:attr:`Sink.destination_problem`). A pause running out
  is not "back": the next send may find the same outage (a missing exchange, a silent
  broker), which is no new state to log.

Crash safety is the broker's message id: a relay killed after the broker stored a message
and before the completion committed leaves the job running; the reaper hands it out again
and the re-send carries the same id (the job's idempotency key), which JetStream's duplicate
window drops and which a RabbitMQ consumer can drop.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

from outbox import backoff
from outbox.errors import ForwardingError, UndeliverableError
from outbox.job import Job
from outbox.registry import Subscriber
from outbox.relay.claim import Claim, jobs_of
from outbox.relay.claims import HeldClaims, Signals
from outbox.relay.counters import Counters
from outbox.relay.outcomes import Outcome
from outbox.sinks import (
    Delivered,
    Expired,
    Failed,
    Message,
    SendResult,
    Sink,
    SinkUnavailableError,
    Unavailable,
)
from outbox.telemetry import tracing
from outbox.telemetry.metrics import FORWARD_RESULTS, RelayMetrics

log = logging.getLogger(__name__)

#: Seconds between checks of a sink's connection while it is up.
WATCH_INTERVAL = 0.2
#: Longest pause between two connection attempts to an unreachable broker, seconds.
RECONNECT_CAP = 10.0
#: The safety margin of a message's deadline (:func:`send_deadline`): this many seconds, or
#: :data:`SEND_MARGIN_SHARE` of the lease when that is less.
SEND_MARGIN = 1.0
#: The share of the lease the margin is at most: below the third of the lease the heartbeat
#: leaves between two renewals, so a relay that keeps up never stops short.
SEND_MARGIN_SHARE = 0.25
#: Job ids a log line names at most (the rest are counted).
IDS_LOGGED = 5
#: Outcomes of broker answers are gathered and posted together: at once when no other
#: message is in flight, or when they are as many as a hand-off tops the window up by
#: (``HeldClaims.refill``); else once no answer has come for :data:`POST_QUIET` seconds (a
#: burst of answers has ended), and at the latest :data:`POST_INTERVAL` seconds after the
#: first of them. So a lone message, or a burst, is completed at once, while a broker that
#: confirms a message a millisecond makes a completion round per dozens of messages, not per
#: few (relay and database CPU per event: the reliability notes, issue 26).
POST_QUIET = 0.005
POST_INTERVAL = 0.1


def send_deadline(claim: Claim) -> float:
    """The ``time.monotonic()`` after which ``claim``'s message must not be handed to the
    broker: the relay's bound of its claim's lease (from the claim's or the last heartbeat's
    send time, so never later than the database's ``lease_until``) less a safety margin of
    :data:`SEND_MARGIN` seconds, or :data:`SEND_MARGIN_SHARE` of the lease when that is less.
    The margin covers what happens after the check: the event loop's delay before the bytes
    are written, their way to the broker, and the two clocks' drift over a lease."""
    return claim.lease_bound - min(SEND_MARGIN, claim.job.lease_seconds * SEND_MARGIN_SHARE)


def message_for(claim: Claim) -> Message:
    """The broker message of ``claim``'s job: its payload's stored JSON text as the body, its event's
    headers as strings (a value that is not a string as its JSON text), and its
    :func:`send_deadline`."""
    job = claim.job
    headers = {str(k): v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)
               for k, v in (job.headers or {}).items()}
    created = job.event_created_at or datetime.now(UTC)
    return Message(job_id=job.id, event_id=job.event_id, consumer=job.consumer, topic=job.topic, key=job.key,
                   idempotency_key=job.idempotency_key, created_at=created,
                   body=job.payload_json.encode("utf-8"), headers=headers, deadline=send_deadline(claim))


class Forwarder:
    """Sends the jobs of ``forwarders`` (consumer -> its :class:`Subscriber` with a sink) held
    in ``claims`` (see the module notes). ``post(claim, outcome)`` hands an outcome to the
    dispatcher (and frees the job's place in the window); ``failure(job, exc)`` makes the
    outcome of a failed attempt (the executor's: backoff, permanent errors); ``wake()`` is
    called when a sink comes back, so claims resume at once. Runs in its own thread
    (:meth:`run`) until ``signals.stopped``."""

    def __init__(self, forwarders: Mapping[str, Subscriber], claims: HeldClaims,
                 post: Callable[[Claim, Any], None], failure: Callable[[Job, BaseException], Any],
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
        self._inbox: queue.SimpleQueue[Claim] = queue.SimpleQueue()
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
        self._tells_answers = {c: _tells_answers(_sink(sub)) for c, sub in self.forwarders.items()}
        # A sink written before ``answered`` existed was promised one send_many at a time.
        self._one_at_a_time: dict[str, asyncio.Lock] = {}
        # Per forwarder, when (monotonic) its broker last answered a message: a send left
        # unanswered is an outage only when nothing was answered meanwhile.
        self._answered_at: dict[str, float] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._arrived: asyncio.Event | None = None
        self._posting: list[tuple[Claim, Any]] = []  # outcomes gathered for the next post (POST_INTERVAL)
        self._post_timer: asyncio.TimerHandle | None = None
        self._first_gathered = self._last_gathered = 0.0  # monotonic
        self._in_flight = 0  # messages handed to a sink whose outcome is not made yet

    # ------------------------------------------------------------- other threads

    def submit(self, claims: list[Claim]) -> None:
        """Queue claimed jobs of forwarders for sending (any thread)."""
        for claim in claims:
            self._inbox.put(claim)
        loop, arrived = self._loop, self._arrived
        if claims and loop is not None and arrived is not None:
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
        self._one_at_a_time = {c: asyncio.Lock() for c, tells in self._tells_answers.items() if not tells}
        keepers = [asyncio.create_task(self._keep(sub)) for sub in self.forwarders.values()]
        sending: set[asyncio.Task[None]] = set()
        try:
            while not self.signals.stopped.is_set():
                try:
                    await asyncio.wait_for(self._arrived.wait(), 0.2)
                except TimeoutError:
                    pass
                self._arrived.clear()
                arrived: dict[str, list[Claim]] = {}
                while True:
                    try:
                        claim = self._inbox.get_nowait()
                    except queue.Empty:
                        break
                    arrived.setdefault(claim.consumer, []).append(claim)
                for consumer, claims in arrived.items():
                    task = asyncio.create_task(self._send(self.forwarders[consumer], claims))
                    sending.add(task)
                    task.add_done_callback(sending.discard)
        finally:
            tasks = [*keepers, *sending]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._post_gathered()
            # Jobs whose send was cut short are released by the runner's stop(), as unfinished claims.
            for sub in self.forwarders.values():
                try:
                    await _sink(sub).close()
                except Exception:  # noqa: BLE001 - closing on the way out
                    log.debug("closing the sink of %s failed", sub.consumer, exc_info=True)

    async def _send(self, sub: Subscriber, claims: list[Claim]) -> None:
        """Send one hand-off of ``sub``'s jobs and post each job's outcome as its answer
        arrives (module notes); for a sink that takes no ``answered``, one send at a time."""
        lock = self._one_at_a_time.get(sub.consumer)
        async with lock if lock is not None else contextlib.nullcontext():
            await self._send_now(sub, claims)

    async def _send_now(self, sub: Subscriber, claims: list[Claim]) -> None:
        sink = _sink(sub)
        sendable: list[Claim] = []
        expired: list[Claim] = []
        now = time.monotonic()
        for claim in claims:
            if self.signals.draining.is_set() or claim.lease_lost:
                self.post(claim, Outcome.RELEASE)  # not sent: the claim goes back, attempt not counted
            elif now >= send_deadline(claim):
                expired.append(claim)
            else:
                sendable.append(claim)
        self._release_expired(sub, expired)
        if not sendable:
            return
        if not sink.connected:
            self._mark_down(sub, "not connected")
            for claim in sendable:
                self.post(claim, Outcome.RELEASE)
            return
        started = time.monotonic()
        for claim in sendable:
            claim.started = started  # the broker round trip is a forwarded job's "handler" (metrics)
        tally = dict.fromkeys(FORWARD_RESULTS, 0)
        settled = [False] * len(sendable)
        self._in_flight += len(sendable)

        def answered(index: int, result: SendResult) -> None:
            if 0 <= index < len(settled) and not settled[index]:
                settled[index] = True
                self._answered_at[sub.consumer] = time.monotonic()
                self._settle(sendable[index], result, started, tally)

        span = (tracing.send_span(sub.consumer, sink.extra or tracing.SYSTEM, sink.describe(), jobs_of(sendable))
                if tracing.active() else contextlib.nullcontext())
        with span as current:
            try:
                messages = [message_for(claim) for claim in sendable]
                results = await (sink.send_many(messages, sub.timeout or 10.0, answered)
                                 if self._tells_answers[sub.consumer] else sink.send_many(messages, sub.timeout or 10.0))
                if len(results) != len(sendable):
                    raise RuntimeError(f"the sink answered {len(results)} results for {len(sendable)} messages")
            except Exception as exc:  # noqa: BLE001 - a sink's bug fails the attempts, it does not stop forwarding
                log.exception("forwarder %s: sending a batch of %d failed", sub.consumer, len(sendable))
                results = [Failed(f"the sink raised {type(exc).__name__}: {exc}")] * len(sendable)
            left = [i for i in range(len(sendable)) if not settled[i]]
            silent = [r for r in (results[i] for i in left) if isinstance(r, Failed) and r.unanswered]
            if (silent and len(silent) == len(sendable)
                    and self._answered_at.get(sub.consumer, -math.inf) < started):
                # Not one message answered in time, and nothing else either, on a connection
                # that looks up: the broker is silent (a partition, a stalled server), not the
                # messages bad. Counting attempts would dead-letter the backlog for an outage:
                # release them, as when it is down.
                results = [Unavailable(f"no message of a batch of {len(results)} answered: {silent[0].error}")
                           for _ in results]
            expired = []
            for i in left:
                settled[i] = True
                if isinstance(results[i], Expired):
                    self._in_flight -= 1
                    expired.append(sendable[i])
                else:
                    self._settle(sendable[i], results[i], started, tally)
            self._release_expired(sub, expired)
            if self._in_flight <= 0:
                self._post_gathered()
            if current is not None:
                tracing.record_send(current, tally["delivered"] + tally["duplicate"], tally["failed"],
                                    tally["unavailable"])
        if self.metrics is not None:
            self.metrics.forwarded(sub.consumer, tally)
        if tally["unavailable"]:
            self._outages[sub.consumer] = self._outages.get(sub.consumer, 0) + 1
            pause = backoff.retry_delay(self._outages[sub.consumer], base=0.5, cap=RECONNECT_CAP, jitter=0.25)
            self._hold_until[sub.consumer] = time.monotonic() + pause
            self._mark_down(sub, next(r.error for r in results if isinstance(r, Unavailable)))
        elif tally["delivered"] or tally["duplicate"]:
            self._outages.pop(sub.consumer, None)
            self._mark_delivered(sub)

    def _settle(self, claim: Claim, result: SendResult, started: float, tally: dict[str, int]) -> None:
        """Make ``job``'s outcome of the broker's ``result``, to be posted with others (the
        rule at :data:`POST_QUIET`; its place in the window is free from then), and count it
        in ``tally`` (results by :data:`FORWARD_RESULTS` name)."""
        claim.ran = time.monotonic() - started
        outcome: Any
        if isinstance(result, Delivered):
            tally["duplicate" if result.duplicate else "delivered"] += 1
            self.stats.add("forwarded")
            if result.duplicate:
                self.stats.add("forward_duplicates")
            outcome = Outcome.DONE
        elif isinstance(result, Unavailable | Expired):
            tally["unavailable"] += isinstance(result, Unavailable)
            outcome = Outcome.RELEASE
        else:
            tally["failed"] += 1
            error: ForwardingError = (UndeliverableError(result.error) if result.permanent
                                      else ForwardingError(result.error))
            outcome = self.failure(claim.job, error)
        self._in_flight -= 1
        self._posting.append((claim, outcome))
        self._last_gathered = time.monotonic()
        if self._in_flight <= 0 or len(self._posting) >= self.claims.refill:
            self._post_gathered()
        elif self._post_timer is None and self._loop is not None:
            self._first_gathered = self._last_gathered
            self._post_timer = self._loop.call_later(POST_QUIET, self._post_when_quiet)

    def _post_when_quiet(self) -> None:
        """Post the gathered outcomes once answers have paused for :data:`POST_QUIET`, or the
        first of them has waited :data:`POST_INTERVAL`; else look again then."""
        self._post_timer = None
        now = time.monotonic()
        due = min(self._last_gathered + POST_QUIET, self._first_gathered + POST_INTERVAL)
        if now >= due or self._loop is None:
            self._post_gathered()
        else:
            self._post_timer = self._loop.call_later(due - now, self._post_when_quiet)

    def _post_gathered(self) -> None:
        """Post the outcomes :meth:`_settle` gathered."""
        if self._post_timer is not None:
            self._post_timer.cancel()
            self._post_timer = None
        posting, self._posting = self._posting, []
        for claim, outcome in posting:
            self.post(claim, outcome)

    def _release_expired(self, sub: Subscriber, claims: list[Claim]) -> None:
        """Release ``jobs``, not sent because their message's deadline had passed (fenced,
        attempt not counted: another relay may hold their claims by now); one line for all."""
        if not claims:
            return
        self.stats.add("forward_expired", len(claims))
        for claim in claims:
            self.post(claim, Outcome.RELEASE)
        ids = ", ".join(str(claim.id) for claim in claims[:IDS_LOGGED]) + (", ..." if len(claims) > IDS_LOGGED else "")
        log.warning("forwarder %s: %d messages not sent, their claims' leases (less a safety margin) had run out "
                    "before the hand-off to the broker (this relay was paused or starved); released, attempts not "
                    "counted (jobs %s)", sub.consumer, len(claims), ids,
                    extra={"job_ids": [claim.id for claim in claims], "outcome": "released"})

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


def _tells_answers(sink: Sink) -> bool:
    """Whether ``sink.send_many`` takes ``answered``: a sink written before it existed
    (``send_many(messages, timeout)``) still works, called one batch at a time as it was
    promised, its jobs completed when the call returns."""
    try:
        parameters = inspect.signature(sink.send_many).parameters
    except (TypeError, ValueError):
        return False
    return "answered" in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def _sink(sub: Subscriber) -> Sink:
    assert sub.sink is not None  # only forwarders are given to the Forwarder
    return sub.sink
