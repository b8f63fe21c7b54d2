"""LISTEN/NOTIFY wake-ups. A notification is a hint, never the only trigger: the router
and the dispatcher also poll every ``poll_interval`` seconds, and the look-outs
(:class:`Lookout`) find what sorts before the claim and route hints that no notification
announced, so a notification missed while the listener was reconnecting only costs
latency, never an event.

The listener holds its own autocommit psycopg connection (not one from the pool) and
``LISTEN``s on ``outbox_events`` (sent on commit of a publish) and ``outbox_jobs`` (sent on
commit of routing); for a schema other than ``public``, on ``<schema>.outbox_events`` and
``<schema>.outbox_jobs`` (:func:`outbox.db.tables.notify_channel`), so publishing into one
schema never wakes the relays of another. When the connection breaks, for instance because the server restarted
or ``pg_terminate_backend`` ended it, it reconnects through the relay's
:class:`~outbox.relay.reconnect.Reconnector` (at once; then, while connecting fails, probing every
0.25-0.5 s, and at once when another loop of the relay got through), listens again, announces
to the relay's other loops that the database is reachable and wakes everyone once, since it
may have missed notifications meanwhile. While idle it sends
a ``SELECT 1`` every ``keepalive`` seconds so a silently dead connection is noticed.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Literal

import psycopg
from sqlalchemy.engine import URL, Connection, Engine
from sqlalchemy.exc import DBAPIError

from outbox.db.tables import EVENTS_CHANNEL, JOBS_CHANNEL, notify_channel
from outbox.relay.reconnect import Reconnector

log = logging.getLogger(__name__)

#: Longest wait for notifications before checking ``stop`` again, seconds: how long
#: :meth:`Listener.join` may take after ``stop`` is set.
STOP_CHECK = 0.25
#: A claim-order key: (priority, run_at, id) of a job, the order claims take ready jobs in.
ClaimKey = tuple[int, datetime, int]

#: Shortest time between two looks from the head (:class:`Lookout`: the first ready job
#: before a runner's claim hint, the first unrouted event before a router's hint), seconds:
#: how long what sorts before a hint and that no notification announced may wait.
HEAD_SECONDS = 1.0
#: Most of its time a look-out spends looking: while a long snapshot elsewhere keeps the
#: index entries of finished jobs and routed events, a look from the head reads through all
#: of them, so looks are spaced at least their duration / HEAD_SHARE apart.
HEAD_SHARE = 0.05


def next_head_scan(seconds: float) -> float:
    """The ``time.monotonic()`` from which the next look from the head is due, after one that
    took ``seconds``: ``HEAD_SECONDS`` from now, or longer for a slow one (``HEAD_SHARE``)."""
    return time.monotonic() + max(HEAD_SECONDS, seconds / HEAD_SHARE)


class Lookout:
    """The safety net under the claim and route hints (issue 28), a loop of its own (thread
    ``name``): every ``HEAD_SECONDS`` (no more often than its duration / ``HEAD_SHARE``) it
    runs ``look`` on a connection of ``engine``'s pool (autocommit; checked out per look),
    which finds what sorts before the hint and no notification announced (a NOTIFY missed
    while the listener reconnected, a relay without LISTEN, a retry more urgent than the
    claim hint, events another router locked and rolled back) and lowers the hint to it.

    Such a look reads from the head of its index: while a snapshot held open elsewhere keeps
    the entries of every job claimed or event routed since it began, it reads all of them.
    Made by a claim or a routing round itself, as it first was, such a look held up that
    round and every job waiting on it: the slowest 1 % of jobs waited for it (p99 3.9x its
    value under a 5-minute snapshot: performance notes, "Long snapshots"). On a connection
    of its own it costs the database the same reads and holds up no round.

    A database error never ends the loop: it waits as the relay's other loops do
    (``reconnect``) and looks again."""

    def __init__(self, engine: Engine, look: Callable[[Connection], object], name: str, stop: threading.Event,
                 reconnect: Reconnector) -> None:
        self.engine = engine
        self.look = look
        self.name = name
        self.stop = stop
        self.reconnect = reconnect

    def run(self) -> None:
        """Look until ``stop`` is set."""
        failures = 0
        due = time.monotonic() + HEAD_SECONDS
        while not self.stop.wait(max(0.0, due - time.monotonic())):
            began = time.monotonic()
            try:
                with self.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                    self.look(conn)
                failures = self.reconnect.recovered(failures, self.name)
            except DBAPIError as exc:
                failures = self.reconnect.backoff(failures, self.name, exc, self.stop)
            due = next_head_scan(time.monotonic() - began)


#: Payload of a jobs notification saying the ready jobs changed ahead of every dispatcher's
#: hint (``queries.jobs_notify_head``): released or reaped jobs, which keep their place.
HEAD_PAYLOAD = "head"
#: Prefix of a jobs notification the router sends with the jobs it made ready
#: (``queries.event_route_many``): ``ready <priority> <run_at as epoch seconds>``, the first of
#: them in claim order, so a relay whose claims went past that key claims from it again.
READY_PAYLOAD = "ready "
#: Prefix of an events notification (the events' trigger since migration 0009): ``from <id>``,
#: the first event id the inserting statement wrote.
EVENTS_PAYLOAD = "from "


def ready_key(payload: str) -> ClaimKey | None:
    """The claim-order key a ``ready`` notification carries, less a millisecond (the epoch
    seconds are rounded: a claim after this key must not miss the job), or None when
    ``payload`` is not one (another payload, or malformed)."""
    try:
        _, priority, epoch = payload.split(" ")
        return int(priority), datetime.fromtimestamp(float(epoch) - 0.001, UTC), 0
    except (ValueError, OverflowError, OSError):
        return None


class Wakeup:
    """Wakes the job runner's dispatcher for one of two reasons, told apart: :meth:`set`
    says due jobs may be waiting (a NOTIFY on ``outbox_jobs``, the router created jobs, the
    reaper took some back); :meth:`poke` says a worker has an outcome to write. The
    dispatcher only polls the jobs table on the first reason (or after ``poll_interval``),
    but writes outcomes at once on the second. ``set`` has the meaning of
    ``threading.Event.set``, so a Wakeup goes wherever an event of "jobs ready" did.

    A runner with several dispatchers gives each a :meth:`branch`: every ``set``, ``rewind``
    and ``poke`` of this Wakeup reaches every branch, and each branch is waited on (and
    cleared) by its own dispatcher alone, so no dispatcher takes another's wake-up."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._jobs = False
        self._poked = False
        self._rewind: ClaimKey | Literal["head"] | None = None
        self._branches: tuple[Wakeup, ...] = ()

    def branch(self) -> Wakeup:
        """A new Wakeup that receives every wake-up of this one from now on (for one
        dispatcher of several; :meth:`wait` on this one is then never called)."""
        child = Wakeup()
        with self._cond:
            self._branches = (*self._branches, child)
        return child

    def set(self) -> None:
        """Due jobs may be waiting."""
        with self._cond:
            self._jobs = True
            self._cond.notify_all()
        for child in self._branches:
            child.set()

    def rewind(self) -> None:
        """Due jobs may be waiting that sort before the key the dispatcher last claimed
        (released or reaped jobs keep their early ``run_at``): its next claim starts at the
        head of the ready jobs. Implies :meth:`set`."""
        with self._cond:
            self._rewind = "head"
            self._jobs = True
            self._cond.notify_all()
        for child in self._branches:
            child.rewind()

    def lower(self, key: ClaimKey) -> None:
        """Jobs became ready at claim-order key ``key`` (priority, run_at, id) or after it
        (the router created them, or promoted them): the next claim starts no later than
        just before ``key``. Implies :meth:`set`."""
        with self._cond:
            if self._rewind is None or (self._rewind != "head" and key < self._rewind):
                self._rewind = key
            self._jobs = True
            self._cond.notify_all()
        for child in self._branches:
            child.lower(key)

    def take_rewind(self) -> ClaimKey | Literal["head"] | None:
        """Where the next claim must start since the last call, and clears it: ``"head"``
        after :meth:`rewind`, the lowest key given to :meth:`lower`, or None (wherever the
        claims got to)."""
        with self._cond:
            rewind, self._rewind = self._rewind, None
            return rewind

    def poke(self) -> None:
        """An outcome (or a stop) wants the dispatcher's attention."""
        for child in self._branches:
            child.poke()
        if self._poked:  # already pending: the dispatcher takes every queued outcome when it wakes
            return
        with self._cond:
            self._poked = True
            self._cond.notify_all()

    def wait_poke(self, timeout: float) -> bool:
        """Block until :meth:`poke` (an outcome, or a stop, waiting) or ``timeout`` seconds;
        returns and clears whether it was poked. A jobs hint (:meth:`set`) neither ends the
        wait nor is cleared: :meth:`wait` still returns it."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._poked:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            self._poked = False
            return True

    def wait(self, timeout: float | None) -> tuple[bool, bool]:
        """Block until :meth:`set` or :meth:`poke` (or ``timeout`` seconds, None = forever);
        returns and clears ``(jobs_hint, poked)``."""
        with self._cond:
            if not (self._jobs or self._poked):
                self._cond.wait(timeout)
            woke = (self._jobs, self._poked)
            self._jobs = self._poked = False
            return woke


class Cooldown:
    """The shortest time between the starts of two rounds of one loop (the router, a
    dispatcher), setting ``wake_cooldown`` in seconds: wake-ups that come closer together
    share the next round. A loop calls :meth:`wait` before a round, :meth:`started` as the
    round begins and :meth:`skip` after a round whose batch came back full (more work may be
    waiting: the next round starts at once). Not thread-safe: one per loop.

    What the cooldown may hold back is the loop's to say, through the ``pause`` it gives
    :meth:`wait`: the router's stop event; for a dispatcher, a wait that ends as soon as an
    outcome is waiting (:meth:`Wakeup.wait_poke`), so the cooldown batches claims and
    routing but never holds a finished job's outcome (issue 26, item 8: held outcomes were
    lost with a SIGKILLed process and their jobs ran again)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._next = 0.0  # time.monotonic() before which no round starts

    def wait(self, pause: Callable[[float], object]) -> None:
        """Wait until the cooldown since the last round's start has passed, through
        ``pause(seconds)``: a wait of at most that long that returns early when the round
        is not to wait any longer (the loop's stop event's ``wait``, say)."""
        left = self._next - time.monotonic()
        if left > 0:
            pause(left)

    def holding(self) -> bool:
        """Whether the cooldown since the last round's start has not passed yet."""
        return time.monotonic() < self._next

    def started(self) -> None:
        """A round begins now."""
        self._next = time.monotonic() + self.seconds

    def skip(self) -> None:
        """The round's batch came back full: no cooldown before the next one."""
        self._next = 0.0


class Listener:
    """Sets ``wake_router`` on ``outbox_events`` notifications and ``wake_workers`` on
    ``outbox_jobs`` ones, until ``stop`` is set. ``url`` is a SQLAlchemy URL; ``reconnect`` is
    the relay's shared reconnect policy (default: one of its own with ``reconnect_max``
    seconds of backoff for errors other than disconnects); ``schema`` the schema whose
    channels it listens on (default ``public``); ``on_events`` is called with the first id an
    events notification names (``from <id>``, the router's :class:`~outbox.relay.router.RouteHint`)."""

    def __init__(self, url: URL, wake_router: threading.Event, wake_workers: threading.Event | Wakeup,
                 stop: threading.Event, *, reconnect: Reconnector | None = None, reconnect_max: float = 10.0,
                 keepalive: float = 15.0, schema: str = "public",
                 on_events: Callable[[int], None] | None = None) -> None:
        self.events_channel = notify_channel(EVENTS_CHANNEL, schema)
        self.jobs_channel = notify_channel(JOBS_CHANNEL, schema)
        self.conninfo = url.set(drivername="postgresql").render_as_string(hide_password=False)
        self.wake_router = wake_router
        self.wake_workers = wake_workers
        self.stop = stop
        self.reconnect = reconnect or Reconnector(reconnect_max)
        self.keepalive = keepalive
        self.on_events = on_events
        self.connected = threading.Event()
        self.reconnects = 0
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start listening in a daemon thread; returns at once (see :attr:`connected`)."""
        self._thread = threading.Thread(target=self._run, name="outbox-listener", daemon=True)
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        """Wait (at most ``timeout`` seconds) until the listener, once ``stop`` is set, has
        closed its connection, so nothing of the relay stays connected after it stopped."""
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        failures = 0
        while not self.stop.is_set():
            try:
                with psycopg.connect(self.conninfo, autocommit=True, connect_timeout=5,
                                     application_name="outbox-listener") as conn:
                    # Quoted: a channel of another schema has a dot in its name (validated names only).
                    conn.execute(f'LISTEN "{self.events_channel}"')
                    conn.execute(f'LISTEN "{self.jobs_channel}"')
                    self.connected.set()
                    if failures:
                        log.info("listening again after %d failed tries", failures)
                        self.reconnects += 1
                    failures = self.reconnect.recovered(0, "listener")  # the other loops retry at once
                    # Anything may have been published while we were not listening.
                    self.wake_router.set()
                    self.wake_workers.set()
                    self._listen(conn)
            except psycopg.Error as exc:
                self.connected.clear()
                failures += 1
                if failures == 1:
                    log.warning("LISTEN connection lost (%s); reconnecting with backoff", type(exc).__name__)
                self.reconnect.backoff(failures - 1, "listener", exc, self.stop, log_failure=False)
        self.connected.clear()

    def _listen(self, conn: psycopg.Connection) -> None:
        last_check = time.monotonic()
        while not self.stop.is_set():
            for note in conn.notifies(timeout=STOP_CHECK, stop_after=64):
                if note.channel == self.events_channel:
                    if self.on_events is not None and note.payload.startswith(EVENTS_PAYLOAD):
                        with contextlib.suppress(ValueError):
                            self.on_events(int(note.payload[len(EVENTS_PAYLOAD):]))
                    self.wake_router.set()
                elif note.payload == HEAD_PAYLOAD and isinstance(self.wake_workers, Wakeup):
                    self.wake_workers.rewind()
                elif (note.payload.startswith(READY_PAYLOAD) and isinstance(self.wake_workers, Wakeup)
                      and (key := ready_key(note.payload)) is not None):
                    self.wake_workers.lower(key)
                else:
                    self.wake_workers.set()
            if time.monotonic() - last_check >= self.keepalive:
                conn.execute("SELECT 1")
                last_check = time.monotonic()
