"""The claims one job runner holds, and the signals its parts stop by.

:class:`HeldClaims` is the one piece of state the runner's parts share (architecture notes,
"The job runner"): the producer adds the claims it takes, the starter moves buffered ones
to workers, the workers post outcomes, the completer forgets what it has written, the
heartbeat renews what is held, and ``stop()`` releases what is left. Everything in it is
read and changed under one lock, so each part sees one consistent picture:

* ``inflight``: every claim held, by fence (a fence names one claim, while a job id may be
  held twice: an attempt that outlived its lease, and the re-claim that took it over);
* ``buffer``: claimed jobs whose handler has not started, in claim order; ``buffered``
  holds their fences until the starter's statement has unlisted them from the relay's row
  of ``outbox_relays`` (``stop()`` leaves those to the dispatcher);
* ``expected``: jobs asked for by claims in flight (a runner with several dispatchers
  has several), counted as taken until each claim has handed its jobs over, so two
  claims never both fill the same room;
* ``issued``: worker slots taken: jobs handed to a worker whose handler has not returned
  (a hung one included, after its timeout), plus slots reserved by a claim in flight that
  will hand jobs over, so none is over-issued. There are ``concurrency`` slots (one per
  thread) and ``ahead`` more (:mod:`outbox.relay.pacing`: jobs handed to the pool that wait
  in its queue for the next thread, while handlers are quick); ``finished`` counts the
  handlers that returned and ``acknowledged`` the forwarded jobs their broker answered, for
  the pacing's measures of their rates;
* ``forward_issued``: jobs of forwarders (:meth:`outbox.Outbox.forward`) handed to the
  forwarder and not yet acknowledged by their broker. They take no worker slot but a place
  in the forwarding window (``window``: messages in flight at once, the relay's
  ``forward_window``), so a broker's acknowledgements, not the worker threads, pace them.
  A forwarder's job is always buffered first (listed) and handed over by the starter only
  when the window has room, so a claim it has not sent costs no attempt. A full window is
  topped up once an eighth of it is free (or as much as the buffer holds): a hand-off of
  dozens, not one statement per acknowledgement, while the broker keeps seven eighths in
  flight;
* ``hung``: of the slots taken, those held by handlers that ran past their timeout (their
  attempt already failed, their thread still running: :mod:`outbox.relay.watchdog`);
* ``finishing``: fences whose outcome is being written (a heartbeat that misses their row
  does not take it for a lost lease); ``released``: fences released at shutdown while
  their handler ran (their late result is expected to be stale);
* ``reported``: fences whose loss a summary line has named (a lost lease, a buffered lease
  run out, a stale report), so the parts that notice it later log it at DEBUG only
  (:mod:`outbox.telemetry.logs`, "One line per state change").

A claim takes its room through one call that cannot be left half done: ``with
held.reserving(want, limit) as room:`` counts what it asks for in ``expected`` and reserves
its worker slots in ``issued``; ``room.hand_over(claimed, start)`` takes the jobs in (the
first ones to the reserved slots, the rest into the buffer) once; leaving the block gives
back what the claim did not use (everything, when it failed before the hand-over).
"""

from __future__ import annotations

import collections
import contextlib
import heapq
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from outbox.relay.claim import Claim


@dataclass(frozen=True, slots=True)
class Signals:
    """How the runner's threads are told to stop, in order: ``stop_claiming`` (claim no
    more), ``draining`` (release buffered claims, start no handler), ``stopped`` (every
    loop ends). Each dispatcher says when it has no claim in flight any more
    (:attr:`outbox.relay.dispatcher.Dispatcher.closed`)."""

    stop_claiming: threading.Event = field(default_factory=threading.Event)
    draining: threading.Event = field(default_factory=threading.Event)
    stopped: threading.Event = field(default_factory=threading.Event)


class HeldClaims:
    """The claims a runner with ``concurrency`` worker slots holds (see the module notes);
    the jobs of the consumers in ``forwarding`` go to the forwarder instead, up to
    ``window`` at once. Thread-safe: every method takes :attr:`lock`; :attr:`changed` (on
    the same lock) is notified when the buffer grows or a slot comes free."""

    def __init__(self, concurrency: int, window: int = 0, forwarding: Iterable[str] = ()) -> None:
        self.concurrency = concurrency
        self.window = window
        # Room in the forwarding window worth a hand-off when the buffer holds more.
        self.refill = max(1, window // 8)
        self.forwarding = frozenset(forwarding)
        self.forward_issued = 0
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.inflight: dict[int, Claim] = {}
        self.buffer: collections.deque[Claim] = collections.deque()
        self.buffered: set[int] = set()
        self.issued = 0
        self.ahead = 0  # slots beyond the threads, set by outbox.relay.pacing.Pacing
        self.finished = 0
        self.acknowledged = 0
        self.expected = 0
        self.hung = 0
        self.finishing: set[int] = set()
        self.released: set[int] = set()
        self.reported: set[int] = set()

    def _slots(self) -> int:
        """(Caller holds the lock.) Worker slots: one per thread, and ``ahead`` more unless a
        handler is hung past its timeout (its thread may never come back for the queue)."""
        return self.concurrency + (0 if self.hung else self.ahead)

    def waiting_for_thread(self) -> bool:
        """Whether jobs wait for a worker thread: more handed to the pool than it has
        threads, or buffered ones with every thread busy."""
        with self.lock:
            return self.issued > self.concurrency or (self.issued >= self.concurrency and bool(self.buffer))

    def add_threads(self, n: int) -> None:
        """The pool has ``n`` more worker threads (an elastic pool grew), or, ``n`` negative,
        that many fewer (a growth that did not pay is taken back)."""
        with self.changed:
            self.concurrency += n
            if self.buffer:
                self.changed.notify()

    def retire_thread(self, floor: int) -> bool:
        """An idle thread beyond ``floor`` asks to end: True (and one slot fewer) when the pool
        has more than ``floor`` threads and one of them is free."""
        with self.lock:
            if self.concurrency > floor and self.issued < self.concurrency:
                self.concurrency -= 1
                return True
            return False

    def worker_slots(self) -> int:
        """Worker slots now: ``concurrency``, plus ``ahead`` while no handler is hung."""
        with self.lock:
            return self._slots()

    def pool_sizes(self) -> tuple[int, int]:
        """(threads, slots beyond them) now, read together: ``concurrency`` and what
        :meth:`worker_slots` adds to it."""
        with self.lock:
            return self.concurrency, self._slots() - self.concurrency

    def get(self, fence: int) -> Claim | None:
        """The claim held with ``fence`` (None: not held, or no longer)."""
        with self.lock:
            return self.inflight.get(fence)

    def count(self) -> int:
        """Claims held: buffered, running, or waiting for their outcome to be written."""
        with self.lock:
            return len(self.inflight)

    def count_unfinished(self) -> int:
        """Claims held whose handler has not returned: buffered or running (:meth:`count`
        without the ones whose outcome is being written)."""
        with self.lock:
            return len(self.inflight.keys() - self.finishing)

    def taken(self) -> int:
        """Slots taken, forwarded jobs in flight, jobs buffered and jobs asked for by claims
        in flight: what counts against the worker slots + ``window`` + ``prefetch``."""
        with self.lock:
            return self._taken()

    def _taken(self) -> int:
        """(Caller holds the lock.) What :meth:`taken` says."""
        return self.issued + self.forward_issued + len(self.buffer) + self.expected

    @contextlib.contextmanager
    def reserving(self, want: int, limit: int) -> Iterator[Reservation]:
        """Room for a claim of up to ``want`` jobs about to be sent, with at most ``limit``
        held in all (:class:`Reservation`): ``asked`` (``want``, or less when other claims in
        flight took the room meanwhile) counted as taken until the block ends, and idle worker
        slots reserved for the first ``start_now`` of the jobs it returns, so the starter does
        not hand buffered jobs to them meanwhile. The claim's jobs are taken in with
        :meth:`Reservation.hand_over`; slots it did not fill, or all of them when the block
        is left without a hand-over (the claim failed), are given back at its end."""
        with self.lock:
            asked = max(0, min(want, limit - self._taken()))
            self.expected += asked
            start_now = max(0, min(asked, self._slots() - self.issued))
            self.issued += start_now
        reservation = Reservation(self, asked, start_now)
        try:
            yield reservation
        finally:
            with self.changed:
                self.expected -= asked
                unused = 0 if reservation.handed_over else start_now
                if unused:
                    self.issued -= unused
                    if self.buffer:
                        self.changed.notify()

    def has_idle_worker(self) -> bool:
        """Whether more workers (and places in the forwarding window) are idle than buffered
        jobs wait for them."""
        with self.lock:
            return self._slots() - self.issued + self.window - self.forward_issued > len(self.buffer)

    def is_forwarded(self, claim: Claim) -> bool:
        """Whether ``claim`` belongs to a forwarder (its sink sends it; no worker runs it)."""
        return claim.consumer in self.forwarding

    def can_start(self) -> bool:
        """(Caller holds the lock.) Whether a buffered job could start now: one for a
        worker while a worker slot is free, or one for the forwarder while its window has
        room."""
        if not self.buffer:
            return False
        workers = self.issued < self._slots()
        if not self.forwarding:
            return workers
        window = self.forward_room() > 0
        return any(window if claim.consumer in self.forwarding else workers for claim in self.buffer)

    def forward_room(self) -> int:
        """(Caller holds the lock.) How many buffered jobs may go to the forwarder now: the
        room in the forwarding window, once it is at least an eighth of the window or all the
        buffer holds (0 before: the broker still has most of the window in flight, and a
        hand-off of a few jobs would cost a statement for each acknowledgement)."""
        room = self.window - self.forward_issued
        return room if room >= min(self.refill, len(self.buffer)) else 0

    def has_buffer(self) -> bool:
        with self.lock:
            return bool(self.buffer)

    def buffer_fences(self) -> list[int]:
        """Fences of the buffered claims still listed in the relay's row."""
        with self.lock:
            return list(self.buffered)

    def take_buffer(self) -> list[Claim]:
        """Everything still buffered, off the buffer (to be released)."""
        with self.lock:
            claims = list(self.buffer)
            self.buffer.clear()
            for claim in claims:
                self.buffered.discard(claim.fence)
        return claims

    def abandon_buffer(self) -> int:
        """Forget the buffered claims (closing without a database); returns how many."""
        with self.lock:
            n = len(self.buffer)
            for claim in self.buffer:
                self.inflight.pop(claim.fence, None)
            self.buffered.clear()
            self.buffer.clear()
        return n

    def _unreserve(self, n: int) -> None:
        """Give back ``n`` reserved slots a claim did not fill."""
        if n:
            with self.changed:
                self.issued -= n
                if self.buffer:
                    self.changed.notify()

    def _issue(self, claims: list[Claim]) -> None:
        """Hold claims just made for the worker slots reserved for them (never listed as
        buffered). A forwarder's claims never come here: they are always buffered, and the
        starter hands them to the forwarder (:meth:`take_startable`)."""
        with self.lock:
            for claim in claims:
                self.inflight[claim.fence] = claim

    def _hold(self, claims: list[Claim]) -> None:
        """Take claims just made into the buffer (the relay's row lists them), keeping
        claim order: jobs claimed from the head after a hint (handed back by another relay)
        sort before the backlog already buffered, and start first."""
        if not claims:
            return
        with self.changed:
            for claim in claims:
                self.inflight[claim.fence] = claim
                self.buffered.add(claim.fence)
            if self.buffer and claims[0].order < self.buffer[-1].order:
                merged = heapq.merge(self.buffer, claims, key=lambda c: c.order)
                self.buffer = collections.deque(merged)
            else:
                self.buffer.extend(claims)
            self.changed.notify()

    def take_startable(self, now: float) -> tuple[list[Claim], list[Claim], list[Claim]]:
        """(Caller holds the lock.) Off the buffer, in claim order: as many jobs for the
        workers as slots are idle, and as many forwarded jobs as the window has room for,
        their places taken; and the ones whose lease ran out (by monotonic ``now``) while
        they waited. Returns (jobs for the workers, jobs for the forwarder, expired)."""
        claims: list[Claim] = []
        forwards: list[Claim] = []
        expired: list[Claim] = []
        free = self._slots() - self.issued
        room = self.forward_room() if self.forwarding else 0
        kept: collections.deque[Claim] = collections.deque()
        while self.buffer and (free > 0 or room > 0):
            claim = self.buffer.popleft()
            forwarded = claim.consumer in self.forwarding
            if (room if forwarded else free) <= 0:
                kept.append(claim)
            elif claim.lease_lost or now >= claim.lease_bound:
                self.buffered.discard(claim.fence)
                expired.append(claim)
            elif forwarded:
                forwards.append(claim)
                room -= 1
            else:
                claims.append(claim)
                free -= 1
        if kept:
            self.buffer.extendleft(reversed(kept))
        self.issued += len(claims)
        self.forward_issued += len(forwards)
        return claims, forwards, expired

    def put_back(self, claims: list[Claim]) -> None:
        """Jobs the starter took could not be unlisted: back at the head, still listed, their
        places given back."""
        with self.changed:
            forwarded = sum(1 for claim in claims if claim.consumer in self.forwarding)
            self.issued -= len(claims) - forwarded
            self.forward_issued -= forwarded
            self.buffer.extendleft(reversed(claims))

    def unlisted(self, claims: list[Claim]) -> None:
        """The starter's statement unlisted ``claims`` from the relay's row."""
        with self.lock:
            for claim in claims:
                self.buffered.discard(claim.fence)

    def slot_freed(self, claim: Claim) -> None:
        """``claim``'s handler returned (a forwarded job: its broker answered): its slot is
        free, its outcome about to be written."""
        with self.changed:
            forwarded = claim.consumer in self.forwarding
            if forwarded:
                self.forward_issued -= 1
                self.acknowledged += 1
            else:
                self.issued -= 1
                self.finished += 1
            self.finishing.add(claim.fence)
            # The starter sleeps while the buffer is empty, and needs no wake-up for a place
            # in the window before it is worth a hand-off.
            if self.buffer and (not forwarded or self.forward_room() > 0):
                self.changed.notify()

    def hang(self) -> int:
        """A handler ran past its timeout and keeps its slot; returns how many slots hung
        handlers hold now."""
        with self.lock:
            self.hung += 1
            return self.hung

    def unhang(self) -> int:
        """A hung handler returned at last: its slot is free; returns how many are still hung."""
        with self.changed:
            self.hung -= 1
            self.issued -= 1
            if self.buffer:
                self.changed.notify()
            return self.hung

    def all_hung(self) -> bool:
        """Whether hung handlers hold every slot (nothing claimed could run)."""
        with self.lock:
            return self.hung >= self.concurrency

    def mark_finishing(self, fence: int) -> None:
        """The outcome of claim ``fence`` is about to be written: a heartbeat that misses the
        row from now on must not take it for a lost lease."""
        with self.lock:
            self.finishing.add(fence)

    def unmark_finishing(self, fence: int) -> None:
        with self.lock:
            self.finishing.discard(fence)

    def forget(self, claims: Iterable[Claim]) -> None:
        """``claims``' outcomes are written (or given up): no longer held."""
        with self.lock:
            for claim in claims:
                self.inflight.pop(claim.fence, None)
                self.finishing.discard(claim.fence)
                self.reported.discard(claim.fence)

    def renewable(self) -> list[Claim]:
        """The claims a heartbeat should renew: every one held whose lease is not lost."""
        with self.lock:
            return [j for j in self.inflight.values() if not j.lease_lost]

    def lost(self, claims: list[Claim], owned: set[int]) -> list[Claim]:
        """Of ``claims`` just heartbeated, those still held and not finishing whose fence is
        not in ``owned``: their lease is lost."""
        with self.lock:
            return [j for j in claims
                    if j.fence not in owned and j.fence in self.inflight and j.fence not in self.finishing]

    def first_reports(self, claims: Iterable[Claim]) -> list[Claim]:
        """Of ``claims``, which this relay no longer owns, those no summary line has
        named yet, now marked named (until forgotten): a job lost in one fault is summarised
        once, by the first part that notices (heartbeat, starter or completer)."""
        with self.lock:
            first = [j for j in claims if j.fence not in self.reported]
            self.reported.update(j.fence for j in first)
            return first

    def unfinished(self) -> list[Claim]:
        """Claims neither buffered nor finishing: handlers still running (shutdown)."""
        with self.lock:
            return [j for j in self.inflight.values() if j.fence not in self.finishing and j.fence not in self.buffered]

    def released_at_shutdown(self, claims: list[Claim]) -> None:
        """``claims`` were released while their handlers ran: no longer held."""
        with self.lock:
            for claim in claims:
                if self.inflight.pop(claim.fence, None) is not None:
                    self.released.add(claim.fence)

    def was_released(self, claim: Claim) -> bool:
        with self.lock:
            return claim.fence in self.released

    def wake_all(self) -> None:
        with self.changed:
            self.changed.notify_all()


class Reservation:
    """The room one claim in flight holds in :class:`HeldClaims` (made by
    :meth:`HeldClaims.reserving`, valid inside its block): ``asked`` jobs counted as taken,
    ``start_now`` worker slots reserved. :meth:`hand_over` takes the claim's jobs in, once."""

    __slots__ = ("held", "asked", "start_now", "handed_over")

    def __init__(self, held: HeldClaims, asked: int, start_now: int) -> None:
        self.held = held
        self.asked = asked
        self.start_now = start_now
        self.handed_over = False

    def hand_over(self, claimed: list[Claim], start: Callable[[list[Claim]], None]) -> list[Claim]:
        """Take in ``claimed`` (in claim order): the first ``start_now`` that are not a
        forwarder's fill the reserved slots (the slots they do not fill are given back) and
        go to ``start`` at once; the rest join the buffer, as the claim listed them in the
        relay's row. Returns the claims started. Raises ``RuntimeError`` if called twice."""
        if self.handed_over:
            raise RuntimeError("a reservation's claims are handed over once")
        held = self.held
        self.handed_over = True
        forwarding = held.forwarding
        first = [claim for claim in claimed if claim.consumer not in forwarding][:self.start_now]
        held._unreserve(self.start_now - len(first))
        held._issue(first)
        start(first)
        started = {claim.fence for claim in first}
        held._hold([claim for claim in claimed if claim.fence not in started])
        return first
