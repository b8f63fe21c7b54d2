"""The intake loop: the relay's part that takes messages in from brokers (:mod:`outbox.intake`).

One thread (``outbox-intake``) runs one event loop with one task per broker intake of the
registry. A task's round: wait while the intake's backlog is at its ``max_backlog``; fetch a
batch from the source; decide what each message becomes (:func:`outbox.intake.arrival`);
take the batch in, in one transaction (:func:`outbox.intake.taking.take_in`, on a worker
thread, on the relay's pool); and only once that has committed, acknowledge the batch.

Faults:

* **The database is down** (or refuses the statement): the batch is held, unacknowledged,
  and its transaction tried again with the relay's :class:`~outbox.relay.reconnect.Reconnector`
  backoff until it commits, then acknowledged. Nothing is fetched meanwhile, so the broker
  keeps the rest (RabbitMQ's prefetch and JetStream's ``max_ack_pending`` bound what a relay
  holds). A relay stopped meanwhile acknowledges nothing of it: the broker delivers it again.
* **Two relays take the same message in at once** (a redelivery to a second relay while the
  first's transaction is open): the second waits on the first's row, finds it recorded,
  rolls back and runs its batch again, dropping that message (:class:`RacedError`).
* **The broker is down**: the source is reconnected with backoff (0.2 s doubling to
  ``reconnect_max``), logged once when it goes and once when it is back. An acknowledgement
  lost in an outage makes the broker deliver the batch again; it is dropped then.
* **Ordered intakes** (``ordered=True``): one relay at a time takes the intake in. It holds a
  session advisory lock of the intake on a connection of its own, leased like a job
  (:class:`IntakeLock`: a paused holder loses it after ``default_lease``); the others stand by,
  connected to no broker (so the broker hands them nothing), and try the lock every
  :data:`LOCK_RETRY` seconds. The holder checks the lock before each fetch (a holder woken
  after its lease fetches nothing more), and each take-in transaction checks that the lock's
  session still holds it (:class:`~outbox.intake.taking.LockLostError` otherwise: nothing
  committed, the batch unacknowledged, the relay stands by). A new holder first lets the
  source :meth:`~outbox.intake.Source.settle` (JetStream: messages delivered to the previous
  holder and never acknowledged come back first, after ``ack_wait``; RabbitMQ: the previous
  holder's connection is gone and its deliveries requeued), so the events are written in the
  order the broker delivers them. The lock check and the commit are two steps: a lock
  lost between them lets one batch commit beside the next holder's first.
* **The backlog** (unrouted events, and ready jobs of the consumers of the intake's topics):
  a batch is fetched only while the backlog plus a batch stays within ``max_backlog``. The
  backlog is read every :data:`BACKLOG_CHECK` seconds, and at once when the last reading
  plus what was taken in since would pass the limit, so the intake stops within one batch
  of it; it then reads again every :data:`BACKLOG_CHECK` seconds until there is room. What
  is not fetched waits in the broker.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
import time
from collections.abc import Sequence

from sqlalchemy.engine import Connection, Engine

from outbox import backoff
from outbox.db import queries
from outbox.db.poison import describe_error, is_data_error
from outbox.intake import Arrival, Intake, Received, SourceUnavailableError, arrival
from outbox.intake.taking import LockLostError, RacedError, Taken, refused, take_in
from outbox.relay.counters import Counters
from outbox.relay.reconnect import Reconnector
from outbox.settings import OutboxSettings
from outbox.telemetry.metrics import RelayMetrics

log = logging.getLogger(__name__)

#: Seconds between two readings of an intake's backlog while it is below its limit.
BACKLOG_CHECK = 1.0
#: Seconds a fetch waits for a first message before the loop looks at its stop flag again.
FETCH_WAIT = 0.5
#: Seconds between a standby relay's tries to take an ordered intake's lock.
LOCK_RETRY = 1.0


class IntakeLock:
    """An ordered intake's lock session: the connection that holds the intake's advisory lock
    (taken off the pool for good: discarded, not returned, when released) and its server pid.
    The session is leased like a job: the server ends it when it sits idle for ``lease``
    seconds (``idle_session_timeout``, PostgreSQL 14+), and :meth:`ping` touches it every
    lease/3 from the loop. A holder that stops (SIGSTOP, a frozen VM) stops pinging, the
    server ends its session, the lock goes to a standby, and the holder's next take-in finds
    the lock gone (:class:`~outbox.intake.taking.LockLostError`) and commits nothing."""

    def __init__(self, conn: Connection, pid: int, lease: float) -> None:
        self.conn = conn
        self.pid = pid
        self.lease = lease

    def ping(self) -> bool:
        """Touch the session (a round trip); False when it is gone."""
        try:
            self.conn.exec_driver_sql("SELECT 1")
            self.conn.commit()
            return True
        except Exception:  # noqa: BLE001 - the session is gone: the take-in's check says so
            return False

    def release(self) -> None:
        """End the session (the lock goes with it)."""
        try:
            self.conn.invalidate()
            self.conn.close()
        except Exception:  # noqa: BLE001 - a lost connection has released the lock already
            pass


class _Lost:
    """What :meth:`IntakeLoop._take` returns when the ordered intake's lock was lost."""


LOST = _Lost()


class IntakeLoop:
    """Runs ``intakes`` (broker intakes only) on ``engine``'s pool until ``stop`` is set.
    ``stats``: ``taken`` (events written), ``duplicates`` (messages dropped as taken in
    before), ``rejected``, ``batches``; per intake in ``by_intake``."""

    COUNTS = ("taken", "duplicates", "rejected", "batches")

    def __init__(self, engine: Engine, intakes: Sequence[Intake], settings: OutboxSettings, *,
                 stop: threading.Event, reconnect: Reconnector, metrics: RelayMetrics | None = None) -> None:
        self.engine = engine
        self.intakes = list(intakes)
        self.settings = settings
        self.stop = stop
        self.reconnect = reconnect
        self.metrics = metrics
        self.stats = Counters(self.COUNTS)
        self.by_intake: dict[str, Counters] = {i.name: Counters(self.COUNTS) for i in self.intakes}
        self._thread: threading.Thread | None = None
        self._statements = queries.in_schema(settings.schema_name)

    def start(self) -> None:
        """Start the ``outbox-intake`` thread."""
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), name="outbox-intake", daemon=True)
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        """Wait for the thread to end (after ``stop`` is set)."""
        if self._thread is not None:
            self._thread.join(timeout)

    async def _main(self) -> None:
        await asyncio.gather(*(self._run(intake) for intake in self.intakes))

    @staticmethod
    async def _stand_by(intake: Intake, lock: IntakeLock | None, keeper: asyncio.Task[None] | None) -> None:
        """This relay lost an ordered intake's lock (its session ended): stop pinging it and
        let the session go; the caller then stands by, holding no lock."""
        log.warning("intake %s: this relay lost the intake's lock (its session ended); standing by", intake.name)
        if keeper is not None:
            keeper.cancel()
        if lock is not None:
            await asyncio.to_thread(lock.release)

    async def _run(self, intake: Intake) -> None:
        source = copy.copy(intake.source)  # a connection of this loop's own (relays in one process share the registry)
        connected = False
        down_since: float | None = None  # when the source was found unreachable (logged once per outage)
        failures = 0
        backlog_checked = -1.0
        backlog = 0  # the last reading plus the events taken in since
        lock: IntakeLock | None = None  # an ordered intake's lock session, while this relay holds it
        keeper: asyncio.Task[None] | None = None  # pings it
        settle = False
        try:
            while not self.stop.is_set():
                if intake.ordered and lock is None:
                    if connected:  # a standby holds no message: the broker keeps them for the holder
                        await source.close()
                        connected = False
                    lock = await asyncio.to_thread(self._try_lock, intake)
                    if lock is None:
                        await self._sleep(LOCK_RETRY)
                        continue
                    keeper = asyncio.create_task(self._keep(lock))
                    log.info("intake %s: this relay takes it in now (ordered: the other relays stand by)",
                             intake.name)
                    settle = True
                if not connected:
                    try:
                        await source.connect()
                    except SourceUnavailableError as exc:
                        failures += 1
                        if down_since is None:
                            log.warning("intake %s: source unreachable (%s); retrying", intake.name, exc)
                            down_since = time.monotonic()
                        await self._sleep(backoff.retry_delay(failures, base=0.2, cap=self.settings.reconnect_max,
                                                              jitter=0.25))
                        continue
                    if down_since is not None:
                        log.info("intake %s: source reachable again after %.1f s", intake.name,
                                 time.monotonic() - down_since)
                    else:
                        log.info("intake %s: taking in from %s", intake.name, source.describe())
                    connected, down_since, failures = True, None, 0
                if settle:
                    try:
                        await source.settle()
                    except SourceUnavailableError as exc:
                        connected, down_since = False, time.monotonic()
                        log.warning("intake %s: source connection lost (%s); reconnecting", intake.name, exc)
                        continue
                    settle = False
                now = time.monotonic()
                if intake.max_backlog is not None and (now - backlog_checked >= BACKLOG_CHECK
                                                       or backlog + intake.batch > intake.max_backlog):
                    backlog_checked = now
                    backlog = await asyncio.to_thread(self._backlog, intake)
                    if backlog + intake.batch > intake.max_backlog:
                        await self._sleep(BACKLOG_CHECK)
                        continue
                if lock is not None and not await asyncio.to_thread(self._still_held, intake, lock):
                    await self._stand_by(intake, lock, keeper)
                    lock = None
                    continue
                try:
                    batch = await source.fetch(intake.batch, FETCH_WAIT)
                except SourceUnavailableError as exc:
                    connected, down_since = False, time.monotonic()
                    log.warning("intake %s: source connection lost (%s); reconnecting", intake.name, exc)
                    continue
                if not batch:
                    continue
                taken = await asyncio.to_thread(self._take, intake, batch, None if lock is None else lock.pid)
                if taken is None:  # stopped before the batch committed: the broker delivers it again
                    return
                if isinstance(taken, _Lost):  # nothing committed; the batch comes again
                    await self._stand_by(intake, lock, keeper)
                    lock = None
                    continue
                self._count(intake, batch, taken)
                backlog += len(taken.events)
                try:
                    await source.ack(batch)
                except SourceUnavailableError as exc:  # delivered again later, then dropped as known
                    log.warning("intake %s: acknowledgement lost (%s); the batch will be delivered again and "
                                "dropped", intake.name, exc)
                    connected, down_since = False, time.monotonic()
        except Exception:  # noqa: BLE001 - a bug must not end the relay's other intakes silently
            log.exception("intake %s stopped by an unexpected error", intake.name)
        finally:
            await source.close()
            if keeper is not None:
                keeper.cancel()
            if lock is not None:
                await asyncio.to_thread(lock.release)

    # --------------------------------------------------------------- database side

    def _take(self, intake: Intake, messages: Sequence[Received], lock_pid: int | None) -> Taken | _Lost | None:
        """Decide what ``messages`` become (on this worker thread: the intake's functions may
        be slow) and take them in, retrying until it commits; None when stopped first, LOST
        when ``lock_pid`` (an ordered intake's lock session) holds the lock no more. A data
        error (a message the database refuses, whatever the checks let through) is found by
        trying each message alone, in transactions rolled back, and that message is
        rejected with the database's error instead (:func:`~outbox.intake.taking.refused`),
        once; a data error after that is retried with backoff like any other."""
        arrivals = [arrival(intake, m) for m in messages]
        failures = 0
        isolated = False
        what = f"intake {intake.name}"
        while not self.stop.is_set() or failures == 0:
            try:
                with self.engine.begin() as conn:
                    taken = take_in(conn, intake.name, arrivals, schema=self.settings.schema_name, lock_pid=lock_pid)
                self.reconnect.recovered(failures, what)
                return taken
            except RacedError:
                continue
            except LockLostError:
                return LOST
            except Exception as exc:  # noqa: BLE001 - any database error: held and retried, never acked
                if is_data_error(exc) and not isolated:
                    isolated = True
                    arrivals = self._without_refused(intake, arrivals)
                    continue
                failures = self.reconnect.backoff(failures, what, exc, self.stop)
        return None

    def _without_refused(self, intake: Intake, arrivals: list[Arrival]) -> list[Arrival]:
        """``arrivals`` with each one the database refuses alone replaced by its rejection:
        each tried alone in a transaction rolled back (nothing is written here)."""
        out = []
        with self.engine.connect() as conn:
            for item in arrivals:
                trial = conn.begin()
                try:
                    take_in(conn, intake.name, [item], schema=self.settings.schema_name)
                    out.append(item)
                except Exception as exc:  # noqa: BLE001 - only data errors make a rejection
                    out.append(refused(item, describe_error(exc)) if is_data_error(exc) else item)
                    if is_data_error(exc):
                        log.warning("intake %s: message %r refused by the database (%s); rejected", intake.name,
                                    item.identity, describe_error(exc))
                finally:
                    trial.rollback()
        return out

    def _try_lock(self, intake: Intake) -> IntakeLock | None:
        """Take ordered ``intake``'s session lock on a connection held for as long as this
        relay takes it in, leased for ``default_lease`` seconds (:class:`IntakeLock`); None
        when another relay holds it (or the database is down)."""
        try:
            conn = self.engine.connect()
        except Exception as exc:  # noqa: BLE001 - retried after LOCK_RETRY
            log.debug("intake %s: cannot try the lock (%s)", intake.name, exc)
            return None
        lease = max(1.0, self.settings.default_lease)
        try:
            taken, pid = conn.execute(self._statements.intake_lock_try, {"source": intake.name}).one()
            conn.commit()  # the lock is the session's; no transaction stays open
            if taken:
                try:
                    conn.exec_driver_sql(f"SET idle_session_timeout = {int(lease * 1000)}")
                    conn.commit()
                except Exception as exc:  # noqa: BLE001 - PostgreSQL < 14: the lock ends with the process only
                    conn.rollback()
                    log.warning("intake %s: idle_session_timeout is not available (%s); a paused holder keeps the "
                                "intake's lock until its connection ends", intake.name, exc)
        except Exception as exc:  # noqa: BLE001 - retried after LOCK_RETRY
            log.debug("intake %s: cannot try the lock (%s)", intake.name, exc)
            conn.invalidate()
            conn.close()
            return None
        if not taken:
            conn.close()
            return None
        return IntakeLock(conn, int(pid), lease)

    def _still_held(self, intake: Intake, lock: IntakeLock) -> bool:
        """Whether ``lock``'s session still holds ordered ``intake``'s lock, read before each
        fetch: a holder that wakes after its lease (paused) fetches nothing more. True when
        the database cannot say (the take-in's own check decides then)."""
        try:
            with self.engine.connect() as conn:
                return bool(conn.execute(self._statements.intake_lock_held,
                                         {"source": intake.name, "pid": lock.pid}).scalar_one())
        except Exception:  # noqa: BLE001 - unknown: the take-in transaction checks again
            return True

    async def _keep(self, lock: IntakeLock) -> None:
        """Ping ``lock``'s session every lease/3 until it is gone or this task is cancelled."""
        while await asyncio.to_thread(lock.ping):
            await asyncio.sleep(lock.lease / 3)

    def _backlog(self, intake: Intake) -> int:
        topics = intake.topics()
        limit = intake.max_backlog or 0
        try:
            with self.engine.connect() as conn:
                return int(conn.execute(self._statements.intake_backlog,
                                        {"topics": None if topics is None else list(topics), "limit": limit})
                           .scalar_one())
        except Exception as exc:  # noqa: BLE001 - unknown backlog: take in (the commit will tell)
            log.debug("intake %s: backlog unknown (%s)", intake.name, exc)
            return 0

    def _count(self, intake: Intake, batch: Sequence[Received], taken: Taken) -> None:
        duplicates = len(batch) - len(taken.events) - len(taken.rejected)
        for counters in (self.stats, self.by_intake[intake.name]):
            counters.add("taken", len(taken.events))
            counters.add("duplicates", duplicates)
            counters.add("rejected", len(taken.rejected))
            counters.add("batches", 1)
        if self.metrics is not None:
            self.metrics.taken_in(intake.name, {"taken": len(taken.events), "duplicate": duplicates,
                                                "rejected": len(taken.rejected)})
        for identity in taken.rejected:
            log.warning("intake %s: message %r rejected (outbox-relay intake rejected shows why)", intake.name,
                        identity)

    async def _sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while not self.stop.is_set() and time.monotonic() < end:
            await asyncio.sleep(min(0.1, end - time.monotonic()))
