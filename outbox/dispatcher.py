"""The dispatcher: one thread, one connection, the rounds that claim jobs and write outcomes.

Each round takes every outcome the workers have posted, has the completer sort them, and,
when the buffer has room, has the producer claim more. Completions and the claim travel in
one statement (``job_complete_claim_many``): a busy runner pays one round trip and one
commit per batch. Failures and releases, which are rare, follow in their own fenced
statements; then the completer's follow-up on the jobs the round finished. A claim that
found fewer due jobs than it asked for marks the table drained: until a wake-up (NOTIFY,
router, reaper) or ``poll_interval`` passes, only rounds that write completions also claim.

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
(``claims_closed``); while draining it releases every buffered claim; it exits when
``stop()`` has queued its marker and every outcome is written, so no claim it holds
outlives the relay unreleased.
"""

from __future__ import annotations

import logging
import queue
import time
from typing import Any, cast

import psycopg
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError

from . import poison
from .claims import HeldClaims, Signals
from .completer import Completer
from .db.engine import describe, is_disconnect
from .job import Job
from .notify import Wakeup
from .producer import Producer
from .reconnect import Reconnector
from .settings import OutboxSettings
from .worker import Outcome, RelayInfo, relay_delete, relay_seen

log = logging.getLogger("outbox.worker")

#: Longest an idle dispatcher leaves its relay's row of ``outbox_relays`` unwritten, seconds
#: (pruning forgets relays not seen for ``maintenance.RELAY_GONE_AFTER``).
RELAY_SEEN_INTERVAL = 30.0


class RelayConnection:
    """The dispatcher's psycopg connection from ``engine`` (autocommit: every statement
    it runs is atomic by itself) and relay ``worker_id``'s row of ``outbox_relays``, which
    lists the buffered fences of ``claims`` and, from ``info``, what the relay runs."""

    def __init__(self, engine: Engine, claims: HeldClaims, worker_id: str, schema: str,
                 info: RelayInfo | None = None) -> None:
        self.engine = engine
        self.info = info  # written with the row (the relay registry)
        self.claims = claims
        self.worker_id = worker_id
        self.schema = schema
        self._conn: Any = None  # a PoolProxiedConnection
        self._seen_at = 0.0  # time.monotonic() of the last write of this relay's row

    def get(self) -> psycopg.Connection[Any]:
        """The connection, checked out once and kept; a new one writes the relay's row first."""
        if self._conn is None:
            raw = self.engine.raw_connection()
            driver = cast(psycopg.Connection[Any], raw.driver_connection)  # the engine's driver is psycopg
            driver.autocommit = True
            try:
                relay_seen(driver, self.worker_id, self.claims.buffer_fences(), info=self.info, schema=self.schema)
            except BaseException:
                raw.invalidate()
                raise
            self._conn = raw
            self._seen_at = time.monotonic()
        return cast(psycopg.Connection[Any], self._conn.driver_connection)

    def mark_seen(self) -> None:
        """Refresh the relay's row every ``RELAY_SEEN_INTERVAL`` seconds, busy or idle, so
        pruning never takes it for a dead relay's, and drop stale fences from its list.
        Errors are left to the next round."""
        if time.monotonic() - self._seen_at < RELAY_SEEN_INTERVAL:
            return
        try:
            fresh = self._conn is None
            conn = self.get()  # a new connection writes the row itself
            if not fresh:
                relay_seen(conn, self.worker_id, self.claims.buffer_fences(), info=self.info, schema=self.schema)
            self._seen_at = time.monotonic()
        except (DBAPIError, psycopg.Error) as exc:
            self.drop(exc)

    def unregister(self) -> None:
        """A clean stop: every claim is finished or released, so the relay's row goes."""
        try:
            relay_delete(self.get(), self.worker_id, schema=self.schema)
        except (DBAPIError, psycopg.Error) as exc:
            log.info("could not remove this relay's row of outbox_relays (%s); pruning will", describe(exc))

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
    outcomes from ``outcomes`` (a ``None`` marker: closing), claims by ``producer``,
    outcome statements by ``completer``, all on ``connection``."""

    def __init__(self, settings: OutboxSettings, claims: HeldClaims, producer: Producer, completer: Completer,
                 connection: RelayConnection, outcomes: queue.SimpleQueue[tuple[Job, Any] | None],
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

    def run(self) -> None:
        failures = 0
        drained_until = 0.0  # monotonic time before which a bare claim is not worth a round trip
        carry: list[tuple[Job, Any]] = []  # outcomes a failed round could not write
        closing = False
        signals = self.signals
        while True:
            if signals.stop_claiming.is_set():
                signals.claims_closed.set()  # between rounds: no claim is in flight any more
            elif not failures:
                self.connection.mark_seen()
            batch = carry + self._take_outcomes()
            if any(item is None for item in batch):
                closing = True
                batch = [item for item in batch if item is not None]
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
            try:
                claimed, from_head = self.round(batch, want if claim else 0, limited)
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
            if claim and claimed < want and from_head:
                drained_until = time.monotonic() + self.settings.poll_interval
            elif claim:
                drained_until = 0.0
        if not self.abandoned:  # a relay that could not release its buffer keeps its row, for the reaper
            self.connection.unregister()
        self.connection.close()

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

    def _take_outcomes(self) -> list[Any]:
        batch: list[Any] = []
        while len(batch) < 1000:
            try:
                batch.append(self.outcomes.get_nowait())
            except queue.Empty:
                break
        return batch

    def round(self, pending: list[tuple[Job, Any]], want: int, limited: int = 0) -> tuple[int, bool]:
        """Write the outcomes in ``pending`` and claim up to ``want`` jobs (and, after the
        outcomes, up to ``limited`` of the capped or rate-limited consumers on their own path,
        :meth:`Producer.claim_limited`); returns how many were claimed by the main claim and
        whether it started at the head of the ready jobs. While
        draining, the buffer is released. Outcomes leave ``pending`` as their statement
        commits, so after an error ``pending`` holds exactly what is still to write."""
        finishing = [job for job, outcome in pending if outcome is not Outcome.RELEASE]  # promoted once written
        done, failed, snoozed, release = self.completer.sort(pending)
        release += self.claims.take_buffer() if self._buffer_to_release() else []
        # Off the buffer now: carried like any outcome if a statement below fails.
        pending[:] = [(j, Outcome.DONE) for j in done] + failed + snoozed + [(j, Outcome.RELEASE) for j in release]
        claimed, from_head = 0, True
        if done or want:
            completed, buried, claimed, from_head = self.producer.claim(self.connection.get(), done, want)
            self.completer.completed(done, completed, buried)
            del pending[:len(done)]
        if failed:
            self.completer.write_failures(failed)
            del pending[:len(failed)]
        if snoozed:
            self.completer.write_snoozes(snoozed)
            del pending[:len(snoozed)]
        if finishing:
            self.completer.finished(finishing)
        if release:
            self.completer.write_releases(release)
            pending[:] = []
        if limited:  # flow control: capped and rate-limited consumers, a claim of their own, after the outcomes
            self.producer.claim_limited(self.connection.get(), limited)
        return claimed, from_head
