"""The dispatcher: one thread, one connection, the rounds that claim jobs and write outcomes.

Each round takes every outcome the workers have posted, has the completer sort them into
the round's object, and, when the buffer has room, has the producer shape a claim that the
completer sends with the completions (``job_complete_many`` then ``job_claim_after_many``,
one round trip and one transaction: :func:`outbox.db.jobs.complete_and_claim_rows`) and the
producer then hands out: a busy runner pays one round trip and one
commit per batch. Failures and releases, which are rare, follow in their own fenced
statements; then the completer's follow-up on the jobs the round finished. A claim that
found fewer due jobs than it asked for marks the table drained: until a wake-up (NOTIFY,
router, reaper) or ``poll_interval`` passes, only rounds that write completions also claim.
A round starts at most every ``wake_cooldown`` seconds after the previous one began, unless
that one's claim came back full or outcomes are waiting: job NOTIFYs closer together share
a round (the performance notes, lever 20), and a backlog is claimed back to back. Outcomes
never wait out the cooldown: a round starts as soon as one is posted (or right after the
round in flight), so what a SIGKILL loses is at most the outcomes of the round in flight and
those posted during it, not a cooldown's worth more (issue 26, item 8); outcomes posted
while a round runs share the next one.

Each statement commits on its own (autocommit): each locks the rows it finishes in id
order, and the claim skips locked rows, so with no transaction holding one statement's
locks while the next one waits, none of them (nor a concurrent heartbeat) can deadlock.
Each is fenced, so each alone is safe.

**The connection** (:class:`RelayConnection`): checked out of the pool once and kept; a new
one first writes the relay's row of ``outbox_relays`` (its buffer list lives there), which
is refreshed every ``RELAY_SEEN_INTERVAL`` seconds and removed at a clean stop. After an
error a broken connection is thrown away and the outcomes the round could not write are
carried to the next one (fenced, so writing one twice changes nothing).

**Stopping.** Once it sees ``stop_claiming`` it claims no more and says so
(:attr:`Dispatcher.closed`); while draining it releases every buffered claim; it exits when
``stop()`` has queued its marker and every outcome is written, so no claim it holds
outlives the relay unreleased.

**Several dispatchers** (setting ``dispatchers``): each runs these rounds on its own
connection, so one's statement runs on the server while another's rows are handled. They
take outcomes from one queue and share the relay's row (:class:`RelayRow`: how its list of
buffered fences stays exact with claims in flight on several connections) and, through the
runner, the room, the claim-order hint, the quarantine and the wake-ups (architecture
notes, "Several dispatchers").
"""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, cast

import psycopg
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError

from outbox.db import poison
from outbox.db.engine import describe, is_disconnect
from outbox.db.jobs import RelayInfo, relay_delete, relay_seen
from outbox.db.tables import RELAY_SEEN_INTERVAL
from outbox.relay.claim import Claim
from outbox.relay.claims import HeldClaims, Signals
from outbox.relay.completer import Completer
from outbox.relay.notify import Cooldown, Wakeup
from outbox.relay.outcomes import Outcome
from outbox.relay.producer import Producer
from outbox.relay.reconnect import Reconnector
from outbox.settings import OutboxSettings

log = logging.getLogger(__name__)

#: Seconds between a parked standby dispatcher's looks at the backlog.
STANDBY_POLL = 0.02


class RelayRow:
    """Relay ``worker_id``'s row of ``outbox_relays``, shared by the relay's dispatchers: it
    lists the buffered fences of ``claims`` and, from ``info``, what the relay runs.

    Claims add fences to the list and the starter removes them (each changes the list, so
    statements of several dispatchers and the starter may interleave); ``relay_seen``
    rewrites it from ``claims.buffer_fences()`` and the jobs running under the relay, which
    would drop the fences of a claim that committed after that statement's snapshot but
    before its jobs were held. So a rewrite (:meth:`rewriting`) waits until no claim of this
    relay is in flight, and claims (:meth:`claiming`) wait while a rewrite is running or
    waiting: a rewrite comes once per ``RELAY_SEEN_INTERVAL`` or new connection, so claims
    wait for it rarely. With one dispatcher the two never overlap anyway.

    The row is removed (:meth:`leave`) when the last dispatcher stops, unless one of them
    could not release its buffered claims: then the row stays for the reaper."""

    def __init__(self, claims: HeldClaims, worker_id: str, schema: str, dispatchers: int = 1,
                 info: RelayInfo | None = None) -> None:
        self.claims = claims
        self.worker_id = worker_id
        self.schema = schema
        self.info = info  # written with the row (the relay registry)
        self.seen_at = 0.0  # time.monotonic() of the last write of the row
        self._cond = threading.Condition(threading.Lock())
        self._claiming = 0  # claims in flight
        self._rewrites = 0  # rewrites running or waiting
        self._left = dispatchers  # dispatchers still running
        self._abandoned = False

    @contextlib.contextmanager
    def claiming(self) -> Iterator[None]:
        """Around a dispatcher's round, whose claims list their buffered fences in the row."""
        with self._cond:
            while self._rewrites:
                self._cond.wait()
            self._claiming += 1
        try:
            yield
        finally:
            with self._cond:
                self._claiming -= 1
                if not self._claiming:
                    self._cond.notify_all()

    @contextlib.contextmanager
    def rewriting(self) -> Iterator[None]:
        """Around ``relay_seen``, which rewrites the list: no claim of this relay in flight."""
        with self._cond:
            self._rewrites += 1
            while self._claiming:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._rewrites -= 1
                self._cond.notify_all()

    def write(self, conn: psycopg.Connection[Any]) -> None:
        """Insert or refresh the row on ``conn`` (``relay_seen``), as a rewrite."""
        with self.rewriting():
            relay_seen(conn, self.worker_id, self.claims.buffer_fences(), info=self.info, schema=self.schema)
            self.seen_at = time.monotonic()

    def due(self) -> bool:
        """Whether the row was last written ``RELAY_SEEN_INTERVAL`` seconds ago or more."""
        return time.monotonic() - self.seen_at >= RELAY_SEEN_INTERVAL

    def leave(self, conn: Callable[[], psycopg.Connection[Any]], abandoned: bool) -> None:
        """A dispatcher stops (``abandoned``: its buffered claims could not be released); the
        last one removes the row on ``conn()`` unless any abandoned."""
        with self._cond:
            self._left -= 1
            self._abandoned = self._abandoned or abandoned
            if self._left or self._abandoned:
                return
        try:
            relay_delete(conn(), self.worker_id, schema=self.schema)
        except (DBAPIError, psycopg.Error) as exc:
            log.info("could not remove this relay's row of outbox_relays (%s); pruning will", describe(exc))


class RelayConnection:
    """A dispatcher's psycopg connection from ``engine`` (autocommit: every statement it
    runs is atomic by itself); a new one first writes the relay's ``row``."""

    def __init__(self, engine: Engine, row: RelayRow) -> None:
        self.engine = engine
        self.row = row
        self._conn: Any = None  # a PoolProxiedConnection

    def get(self) -> psycopg.Connection[Any]:
        """The connection, checked out once and kept; a new one writes the relay's row first
        (call it outside :meth:`RelayRow.claiming`)."""
        if self._conn is None:
            raw = self.engine.raw_connection()
            driver = cast(psycopg.Connection[Any], raw.driver_connection)  # the engine's driver is psycopg
            driver.autocommit = True
            try:
                self.row.write(driver)
            except BaseException:
                raw.invalidate()
                raise
            self._conn = raw
        return cast(psycopg.Connection[Any], self._conn.driver_connection)

    def mark_seen(self) -> None:
        """Refresh the relay's row every ``RELAY_SEEN_INTERVAL`` seconds, busy or idle, so
        pruning never takes it for a dead relay's, and drop stale fences from its list.
        Errors are left to the next round."""
        if not self.row.due():
            return
        try:
            fresh = self._conn is None
            conn = self.get()  # a new connection writes the row itself
            if not fresh:
                self.row.write(conn)
        except (DBAPIError, psycopg.Error) as exc:
            self.drop(exc)

    def drop(self, exc: BaseException) -> None:
        """After an error: a broken connection is thrown away (the next round checks out a
        new one); a healthy one, in autocommit, is kept."""
        conn = self._conn
        if conn is None:
            return
        driver = conn.driver_connection
        if is_disconnect(exc) or driver is None or driver.closed or driver.broken:
            self._conn = None
            try:
                conn.invalidate()
            except Exception:  # noqa: BLE001 - it is being thrown away
                pass

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception:  # noqa: BLE001
                pass


class Dispatcher:
    """Runs the rounds of a runner (see the module notes) in its own thread (:meth:`run`):
    outcomes from ``outcomes`` (a ``None`` marker: closing; each dispatcher takes one),
    claims by ``producer``, outcome statements by ``completer``, all on ``connection``.
    :attr:`closed` is set between two rounds once it has seen ``stop_claiming``: no claim of
    this dispatcher is in flight after that."""

    def __init__(self, settings: OutboxSettings, claims: HeldClaims, producer: Producer, completer: Completer,
                 connection: RelayConnection, outcomes: queue.SimpleQueue[tuple[Claim, Any] | None],
                 wake: Wakeup, signals: Signals, reconnect: Reconnector) -> None:
        self.settings = settings
        self.claims = claims
        self.producer = producer
        self.completer = completer
        self.connection = connection
        self.outcomes = outcomes
        self.wake = wake
        self.signals = signals
        self.reconnect = reconnect
        self.abandoned = False  # closing, buffered claims could not be released
        self.closed = threading.Event()
        # A standby dispatcher runs rounds only while this says so (outbox.relay.pacing: the
        # backlog is deep) or claiming has stopped; None: always.
        self.standby: Callable[[], bool] | None = None

    def run(self) -> None:
        failures = 0
        drained_until = 0.0  # monotonic time before which a bare claim is not worth a round trip
        carry: list[tuple[Claim, Any]] = []  # outcomes a failed round could not write
        closing = False
        signals = self.signals
        cooldown = Cooldown(self.settings.wake_cooldown)
        while True:
            if self.standby is not None and not carry:
                self._park()
            # Wake-ups closer than the cooldown share a round, but an outcome waiting (or a
            # stop) ends the cooldown: a finished job's outcome is written at once.
            cooldown.wait(functools.partial(self._until_outcome, carry=carry))
            if signals.stop_claiming.is_set():
                self.closed.set()  # between rounds: no claim is in flight any more
            elif not failures:
                self.connection.mark_seen()
            batch = carry + self._take_outcomes(closing)
            if any(item is None for item in batch):
                closing = True
                batch = [item for item in batch if item is not None]
            if not batch and cooldown.holding() and not signals.stop_claiming.is_set():
                continue  # the outcomes that ended the wait went to another dispatcher: claims still wait
            want = 0 if signals.stop_claiming.is_set() else self.producer.room()
            has_done = any(o is Outcome.DONE for _, o in batch)
            flow = self.producer.flow
            flow.finished(j.consumer for j, _ in batch)  # flow control: a capped slot may be free
            limited = flow.room(want)  # flow control: the limited claim's share, 0 unless due
            want -= limited
            claim = want > 0 and (has_done or (time.monotonic() >= drained_until and self.producer.worth_claiming(want)))
            to_release = self._buffer_to_release() and self.claims.has_buffer()
            if not batch and not claim and not to_release and not limited:
                if closing:
                    break
                timeout = max(0.0, drained_until - time.monotonic()) if drained_until else self.settings.poll_interval
                timeout = min(timeout or self.settings.poll_interval, flow.wait_seconds())  # flow control
                jobs_hint, _ = self.wake.wait(min(timeout or self.settings.poll_interval, RELAY_SEEN_INTERVAL))
                if jobs_hint:
                    flow.poke()  # flow control: new jobs may be ready for a limited consumer
                if jobs_hint or time.monotonic() >= drained_until:
                    drained_until = 0.0
                continue
            cooldown.started()
            try:
                self.connection.get()  # a new connection rewrites the relay's row: not inside claiming()
                with self.connection.row.claiming():
                    drained = self.round(batch, want if claim else 0, limited)
                failures = self.reconnect.recovered(failures, "claim and completion")
                carry = []
            except (DBAPIError, psycopg.Error, poison.SystemicError) as exc:
                self.connection.drop(exc)
                if signals.stopped.is_set() or (not is_disconnect(exc) and failures >= 3):
                    # A closing relay, or an error that retrying will not fix: the leases
                    # expire and the reaper hands the jobs out again (at-least-once).
                    if batch:
                        log.error("dropping %d outcomes (%s); the jobs return when their leases expire",
                                  len(batch), describe(exc))
                    self.claims.forget(j for j, _ in batch)
                    carry = []
                    if closing:
                        self._abandon_buffer()
                        break
                else:
                    carry = batch
                failures = self.reconnect.backoff(failures, "claim and completion", exc, signals.stopped)
                continue
            except Exception:  # noqa: BLE001 - a bug must not stop the relay's claiming for good
                log.exception("unexpected error in the dispatcher's round; retrying its outcomes")
                carry = batch
                failures = self.reconnect.backoff(failures, "claim and completion", RuntimeError("unexpected"),
                                                  signals.stopped, log_failure=False)
                continue
            if claim and drained:
                drained_until = time.monotonic() + self.settings.poll_interval
            elif claim:
                drained_until = 0.0
                cooldown.skip()  # the claim came back full: more jobs may be waiting
        # The last dispatcher to stop removes the relay's row, unless one could not release
        # its buffer: then the row stays, for the reaper.
        self.connection.row.leave(self.connection.get, self.abandoned)
        self.connection.close()

    def _park(self) -> None:
        """A standby dispatcher waits here, taking no outcome and claiming nothing, until the
        backlog is deep or claiming stops (then it runs to its end like any dispatcher)."""
        assert self.standby is not None
        while not self.standby() and not self.signals.stop_claiming.wait(STANDBY_POLL):
            pass

    def _until_outcome(self, seconds: float, carry: list[tuple[Claim, Any]]) -> None:
        """Wait up to ``seconds``, less if outcomes are waiting (posted, or ``carry``: a
        failed round's) or claiming stops: the wake-up cooldown holds claims, never outcomes
        (a process killed meanwhile would lose them, and their jobs would run again)."""
        deadline = time.monotonic() + seconds
        while not (carry or not self.outcomes.empty() or self.signals.stop_claiming.is_set()):
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self.wake.wait_poke(left)

    def _buffer_to_release(self) -> bool:
        """Whether the buffered claims are to be handed back: the relay is draining, or hung
        handlers hold every worker slot, so nothing buffered could start here."""
        return self.signals.draining.is_set() or self.claims.all_hung()

    def _abandon_buffer(self) -> None:
        """Closing without a database: forget the buffered claims. Their leases expire and
        the reaper gives each its attempt back, since the relay's row still lists them."""
        n = self.claims.abandon_buffer()
        if n:
            log.warning("%d buffered jobs could not be released; they return, attempt not counted, "
                        "when their leases expire", n)
        self.abandoned = True

    def _take_outcomes(self, closing: bool) -> list[Any]:
        """Up to 1,000 posted outcomes, ending at the first closing marker: each dispatcher
        takes one marker, so every one of them sees its own. One that is ``closing`` (it
        has its marker) puts any other marker it meets back, for a dispatcher still
        without one (it takes it within its next wait, ``poll_interval`` at most)."""
        batch: list[Any] = []
        while len(batch) < 1000:
            try:
                item = self.outcomes.get_nowait()
            except queue.Empty:
                break
            if item is None:
                if closing:
                    self.outcomes.put(None)
                else:
                    batch.append(item)
                break
            batch.append(item)
        return batch

    def round(self, pending: list[tuple[Claim, Any]], want: int, limited: int = 0) -> bool:
        """Write the outcomes in ``pending`` and claim up to ``want`` jobs (and, after the
        outcomes, up to ``limited`` of the capped or rate-limited consumers on their own path,
        :meth:`Producer.claim_limited`); returns whether the main claim found the table
        drained (:meth:`Producer.hand_over`). While
        draining, the buffer is released. Outcomes leave ``pending`` as their statement
        commits, so after an error ``pending`` holds exactly what is still to write."""
        try:
            return self._round(pending, want, limited)
        finally:
            self.completer.report()  # the round's stale reports, in one line

    def _round(self, pending: list[tuple[Claim, Any]], want: int, limited: int) -> bool:
        this = self.completer.sort(pending)
        if self._buffer_to_release():
            this.release += self.claims.take_buffer()
        # Off the buffer now: carried like any outcome if a statement below fails.
        pending[:] = this.pending()
        drained = False
        if this.done or want:
            with self.producer.claiming(want) as claim:
                self.completer.write_completions(this, claim)
                del pending[:len(this.done)]
                drained = self.producer.hand_over(self.connection.get(), claim)
        if this.failed:
            self.completer.write_failures(this.failed)
            del pending[:len(this.failed)]
        if this.snoozed:
            self.completer.write_snoozes(this.snoozed)
            del pending[:len(this.snoozed)]
        if this.finishing:
            self.completer.finished(this.finishing)
        if this.release:
            self.completer.write_releases(this.release)
            pending[:] = []
        if limited:  # flow control: capped and rate-limited consumers, a claim of their own, after the outcomes
            self.producer.claim_limited(self.connection.get(), limited)
        return drained
