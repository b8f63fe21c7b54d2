"""The producer: claims jobs for a runner's workers and feeds them in claim order.

**Room.** A runner holds at most ``concurrency + ahead + prefetch`` claims whose handlers
have not returned: ``concurrency`` running, ``ahead`` handed to the pool and waiting for a
thread while handlers are quick (:mod:`outbox.relay.pacing`), and up to ``prefetch`` in the
buffer. :meth:`Producer.room` says how many to claim now (at most the claim batch, none
while claims are paused after a claim that fails for every job).

**Claim rounds.** :meth:`Producer.claiming` shapes a round's claim (a
:class:`ClaimRequest`): it reserves idle worker slots for the first ``start_now`` jobs the
claim returns and counts the room it asks for as taken. The completer sends it with the
round's completions (``job_complete_many`` then ``job_claim_after_many``, pipelined: one
round trip and one commit); :meth:`Producer.hand_over` then gives the first ``start_now``
jobs to the workers at once, and the rest join the buffer, listed in the relay's row of
``outbox_relays`` by the claim (architecture notes, "Attempts and crashes"). A
forwarder's jobs always join the buffer, listed: the starter unlists them just before the
forwarder sends them, so an attempt is charged when its message is handed to the broker,
not when it is claimed. After a data error (the completer then writes the completions by
halves) the claim runs alone, and by halves (:mod:`outbox.db.poison`): a ready job whose
claim fails alone is dead-lettered naming the error, or quarantined.

**The claim-order hint.** Claims start after the claim-order key ``(priority, run_at, id)``
of the last job claimed, so neither a backlog nor the index entries of jobs claimed before
(which a long snapshot elsewhere keeps) are read again every round; before a key announced
by a wake-up (jobs routed or promoted there, ``Wakeup.lower``), from the head after a
``head`` NOTIFY (jobs handed back keep their early place, ``Wakeup.rewind``), and before
what the runner's look-out finds there, on a connection of its own, that nothing announced
(:class:`ClaimHint`).

**The consumers** a claim takes are :meth:`Producer.claim_leases`: every consumer of the
registry, with its lease. A consumer claimed by a path of its own (in a transaction of its
own) is left out of that list and claimed after the round's outcomes in
:meth:`Producer.claim_limited`.

The starter (:mod:`outbox.relay.starter`) hands the buffered jobs to workers as they come free.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import psycopg

from outbox import backoff
from outbox.db import poison
from outbox.db.jobs import (
    BufferMark,
    bury_ready_job,
    claim_candidates,
    complete_and_claim_rows,
)
from outbox.job import Job
from outbox.registry import Subscriber
from outbox.relay import flow
from outbox.relay.claim import Claim
from outbox.relay.claims import HeldClaims, Reservation
from outbox.relay.counters import Counters
from outbox.relay.notify import ClaimKey, Wakeup
from outbox.relay.pacing import Pacing
from outbox.settings import OutboxSettings
from outbox.telemetry.metrics import RelayMetrics

log = logging.getLogger(__name__)

class ClaimHint:
    """The claim-order key ``(priority, run_at, id)`` claims start after, shared by the
    producers of one runner (one per dispatcher): each claims after the key of the last job
    the latest claim of any of them returned, so none reads again through the index entries
    of jobs claimed before, which a long-held snapshot elsewhere keeps from being removed
    (performance notes, "Issue 28").

    A job that becomes ready before the hint is announced, and the next claim starts before
    it (:meth:`start`): the router's new jobs and promoted ones (``Wakeup.lower``, with their
    first key), released and reaped ones (``Wakeup.rewind``: from the head). What nothing
    announces (a failed job retried at a more urgent priority than the hint's, a wake-up
    missed while the listener reconnected) the runner's look-out finds and announces the
    same way (:class:`outbox.relay.notify.Lookout`, ``JobRunner.look_behind``).

    Always the latest claim's key, never the furthest seen: a claim from the head (after a
    rewind: jobs handed back keep their early place) may take only part of what sorts before
    the old key, and the next claim must go on from where it stopped, not jump back past the
    rest (kept at the furthest key, handed-back jobs waited a second per claim's worth,
    test_sigterm_under_heavy_load)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._key: ClaimKey | None = None

    def key(self) -> ClaimKey | None:
        """The key the next claim starts after unless lowered (None: no claim took a job yet)."""
        with self._lock:
            return self._key

    def start(self, rewind: ClaimKey | Literal["head"] | None = None) -> ClaimKey | None:
        """The key the next claim starts after, or None (from the head): the hint, lowered
        to ``rewind`` (what ``Wakeup.take_rewind`` returned), or None when ``rewind`` says
        ``"head"`` or when there is no hint yet."""
        with self._lock:
            if rewind == "head" or self._key is None:
                return None
            if rewind is not None and rewind < self._key:
                return rewind
            return self._key

    def claimed(self, last: ClaimKey | None) -> None:
        """A claim returned; ``last`` is the key of its last job (None: it claimed none, and
        the hint stays where it was)."""
        if last is not None:
            with self._lock:
                self._key = last


@dataclass(slots=True)
class ClaimRequest:
    """One claim of a dispatcher round, as the producer shaped it (:meth:`Producer.claiming`):
    up to ``room.asked`` jobs (the room it holds, ``room.start_now`` worker slots reserved for
    its first jobs) of ``leases``' consumers (consumer -> lease seconds) for relay
    ``worker_id``, after the claim-order key ``after`` (None: from the head), leaving out the
    quarantined ids ``skip``, the relay's row written by ``mark``. The completer sends it in
    the statement that writes the round's completions (:meth:`send`: one round trip, one
    commit), which fills in ``rows`` (the claimed jobs' rows, in claim order; None: not sent), ``last``
    (the key of the last one) and ``returned``; the producer then hands the jobs over
    (:meth:`Producer.hand_over`)."""

    room: Reservation
    leases: dict[str, float]
    worker_id: str
    after: ClaimKey | None
    mark: BufferMark
    skip: list[int]
    #: time.monotonic() when the request was made: the database's now() of the claim is
    #: later, so the claims' lease bounds count from here (a safe lower bound).
    sent: float = field(default_factory=time.monotonic)
    rows: list[Any] | None = None
    last: ClaimKey | None = None
    returned: float = 0.0

    def send(self, conn: psycopg.Connection[Any], done: list[Job], *, keep_done: bool, schema: str) -> set[int]:
        """Complete ``done`` (fenced; ``keep_done`` false: deleted) and make this claim, in one
        transaction and one round trip (``job_complete_many`` then ``job_claim_after_many``) on
        ``conn``; returns the ids completed (a job of ``done`` missing from them was a stale
        report). Raises what either statement raises, neither then kept."""
        completed, self.rows, self.last = complete_and_claim_rows(
            conn, done, self.leases, self.room.asked, self.worker_id, self.after, buffer=self.mark, skip=self.skip,
            keep_done=keep_done, schema=schema)
        self.returned = time.monotonic()
        return completed


class Producer:
    """Claims jobs of ``leases``' consumers (consumer -> lease seconds) for the runner
    holding ``claims``; jobs for idle slots go to ``start`` (the workers' queue, or the
    forwarder for a forwarder's jobs), the rest
    to the buffer. ``wake`` carries the ``head`` rewind; claims are counted in ``stats``.
    ``hint`` and ``quarantine`` are shared by the producers of one runner (one per
    dispatcher): each claims after the last job the latest of their claims took and skips the rows
    any of them quarantined."""

    def __init__(self, settings: OutboxSettings, claims: HeldClaims, leases: dict[str, float], worker_id: str,
                 wake: Wakeup, start: Callable[[list[Claim]], None], stats: Counters, *, hint: ClaimHint, quarantine: poison.Quarantine,
                 subscribers: Mapping[str, Subscriber] | None = None, metrics: RelayMetrics | None = None,
                 pacing: Pacing | None = None) -> None:
        self.settings = settings
        self.pacing = pacing or Pacing(settings, claims)  # the runner's, shared by its dispatchers
        self.metrics = metrics
        self.claims = claims
        self.leases = leases
        self.worker_id = worker_id
        self.wake = wake
        self.start = start
        self.stats = stats
        self.schema = settings.schema_name
        # Claim-order key (priority, run_at, id) of the last job claimed: claims start after
        # it (ClaimHint says when they start before it).
        self.hint = hint  # shared by the runner's producers, as is the quarantine
        # Ready jobs whose claim fails alone and could not even be dead-lettered (poison.py).
        self.quarantine = quarantine
        self.claim_failures = 0  # claims in a row that failed for every job (poison.SystemicError)
        self.claims_paused_until = 0.0
        # Flow control (architecture notes, "Flow control"): capped and rate-limited consumers
        # are claimed on a path of their own, which says when it is next worth a round trip.
        self.flow = flow.FlowControl(subscribers or {}, leases, worker_id, settings.poll_interval,
                                     schema=self.schema)
        self._excluded: Callable[[], frozenset[str]] = frozenset
        self._leases_without: tuple[frozenset[str], dict[str, float]] = (frozenset(), leases)

    def exclude(self, consumers: Callable[[], frozenset[str]]) -> None:
        """Leave out of every claim the consumers ``consumers()`` names at the time (the
        forwarders whose broker is unreachable: their jobs wait in the table)."""
        self._excluded = consumers

    def claim_leases(self) -> dict[str, float]:
        """The consumers the main claim statement takes, with their lease seconds: all
        of them but those excluded now (:meth:`exclude`)."""
        excluded = self._excluded()
        if excluded != self._leases_without[0]:
            self._leases_without = (excluded, {c: lease for c, lease in self.leases.items() if c not in excluded})
        return self._leases_without[1]

    def room(self) -> int:
        """How many jobs to claim now: room in the buffer, at most the claim batch (the
        setting, or :class:`~outbox.relay.pacing.Pacing`'s while it adapts); none
        while claims are paused (:meth:`pause`), or while hung handlers hold every
        worker slot (:mod:`outbox.relay.watchdog`: their slots count as taken, so otherwise the
        room is the same)."""
        now = time.monotonic()
        if now < self.claims_paused_until or self.claims.all_hung():
            return 0
        self.pacing.update(now)
        return max(0, min(self.pacing.claim_batch(), self.limit() - self.claims.taken()))

    def limit(self) -> int:
        """Most claims the runner holds whose handlers have not returned (or whose broker has
        not answered): the worker slots (``concurrency``, and the jobs handed ahead to the
        pool: :mod:`outbox.relay.pacing`) + the forwarding window + ``prefetch``."""
        return self.claims.worker_slots() + self.claims.window + self.settings.prefetch

    def worth_claiming(self, want: int) -> bool:
        """A claim of its own (no completions to carry it) is worth its round trip when it
        can take half a batch, or when a worker would otherwise sit idle."""
        return self.claims.has_idle_worker() or want >= max(
            1, min(self.pacing.claim_batch(), self.settings.prefetch) // 2)

    @contextlib.contextmanager
    def claiming(self, want: int) -> Iterator[ClaimRequest]:
        """A claim of up to ``want`` jobs for this round, in the room it reserves
        (:meth:`HeldClaims.reserving`: fewer when another dispatcher's claim in flight took
        the room meanwhile; idle worker slots reserved for its first jobs). Inside the block
        the completer sends it with the round's completions (:meth:`ClaimRequest.send`), then
        :meth:`hand_over` gives its jobs out; a block left before the hand-over (an error)
        gives the room back."""
        with self.claims.reserving(want, self.limit()) as room:
            # jobs became ready, or were handed back, ahead of the hint
            after = self.hint.start(self.wake.take_rewind()) if room.asked > 0 else None
            yield ClaimRequest(
                room, self.claim_leases(), self.worker_id, after,
                BufferMark(self.worker_id, room.start_now, self.claims.forwarding), self.quarantine.ids())

    def hand_over(self, conn: psycopg.Connection[Any], request: ClaimRequest) -> bool:
        """The jobs ``request`` claimed to the workers reserved for them and the rest into
        the buffer, listed by the same statement (:meth:`_hand_over`); returns whether the
        table is drained: the claim found fewer than it asked for (after the hint: what
        sorts before it is announced, or found by the runner's look-out). A request the completer could not
        send (a data error in its statement: it wrote the completions by halves) is claimed
        here first, alone, on ``conn`` (:meth:`_claim_by_halves`)."""
        want = request.room.asked
        if request.rows is None:
            claimed = self._claim_by_halves(conn, request)
            last = None
            returned = time.monotonic()
        else:
            claimed = [Claim.from_row(r, request.leases[r.consumer]) for r in request.rows]
            last, returned = request.last, request.returned
            if want:
                self.claim_failures = 0
        if self.metrics is not None:
            self.metrics.claim_round_trip(returned - request.sent)
        if want:
            self.hint.claimed(last)
            self.pacing.claimed(want, len(claimed))
        self._hand_over(claimed, request.room, request.sent)
        return want > 0 and len(claimed) < want

    def _hand_over(self, claimed: list[Claim], room: Reservation, sent: float) -> None:
        """Claims just made in ``room`` (a statement sent at ``sent``, monotonic), in claim
        order: the first ``room.start_now`` that are not a forwarder's to the workers reserved
        for them, the rest into the buffer (as the claim listed them: :class:`BufferMark`)."""
        for claim in claimed:
            claim.sent_at(sent)
        self.stats.add("claimed", len(claimed))
        if self.metrics is not None and claimed:
            self.metrics.jobs("claimed", [claim.consumer for claim in claimed])
        room.hand_over(claimed, self.start)

    def claim_limited(self, conn: psycopg.Connection[Any], room: int) -> int:
        """Claim up to ``room`` jobs of the capped or rate-limited consumers on their own path
        (:class:`outbox.relay.flow.FlowControl`: a transaction that locks their rows first), handed
        over like any claim: idle workers first, the rest buffered (listed by the same
        transaction). Returns how many were claimed."""
        with self.claims.reserving(room, self.limit()) as reserved:
            if not reserved.asked:
                return 0
            sent = time.monotonic()
            rows = self.flow.claim(conn, reserved.asked, self.worker_id, reserved.start_now, self._excluded(),
                                   self.claims.forwarding)
            if self.metrics is not None:
                self.metrics.claim_round_trip(time.monotonic() - sent)
            claimed = [Claim.from_row(r, self.leases[r.consumer]) for r in rows]
            self._hand_over(claimed, reserved, sent)
            return len(claimed)

    def _claim_by_halves(self, conn: psycopg.Connection[Any], request: ClaimRequest) -> list[Claim]:
        """After a data error of the round's statement (the completer has written the
        completions by halves): the claim (with the buffer list) alone and, if that fails
        too, by halves of its candidates, each half writing the buffer list as it then
        stands. A job that fails alone is dead-lettered naming the error (or quarantined);
        the others go on. Returns the claims made, in claim order."""
        mark, want, leases = request.mark, request.room.asked, request.leases
        start_left = mark.start_now
        claimed: list[Claim] = []

        def claim(only: list[int] | None) -> list[Claim]:
            nonlocal start_left
            part_mark = BufferMark(mark.relay, start_left, mark.forwarding)
            _, rows, _ = complete_and_claim_rows(
                conn, [], leases, want if only is None else len(only), self.worker_id, None,
                buffer=part_mark, skip=self.quarantine.ids(), only=only, schema=self.schema)
            got = [Claim.from_row(r, leases[r.consumer]) for r in rows]
            start_left -= len(part_mark.starts_now(got))
            return got

        if not want:  # only the buffer list to write: no row of a job to blame
            return claim(None)
        try:
            parts, poisoned = poison.whole_or_halves(
                "claiming", lambda: claim(None),
                lambda: claim_candidates(conn, list(leases), want, self.quarantine.ids(), schema=self.schema),
                lambda part: claim(list(part)))
        except poison.SystemicError as exc:
            self.pause(exc)
            return claimed
        self.claim_failures = 0
        for part in parts:
            claimed += part
        for job_id, failure in poisoned:
            error = f"Claiming failed for this job: {poison.describe_error(failure)}"
            dead = poison.try_record(lambda: bury_ready_job(conn, job_id, error, schema=self.schema))
            if dead is None:
                self.quarantine.add(job_id, failure, "claiming")
            elif dead:
                self.stats.add("dead")
                log.error("dead-lettered job %s: %s", job_id, error,
                          extra={"job_id": job_id, "outcome": "dead", "error": error})
        return claimed

    def pause(self, exc: poison.SystemicError) -> None:
        """Every job a claim takes fails: claim nothing for a capped, growing while (the
        rounds go on writing outcomes and starting buffered jobs); logged once per episode."""
        self.claim_failures += 1
        delay = backoff.retry_delay(self.claim_failures, base=1.0, cap=max(1.0, self.settings.reconnect_max),
                                    jitter=0.25)
        self.claims_paused_until = time.monotonic() + delay
        if self.claim_failures == 1:
            log.error("claiming paused: the claim fails for every job it takes, so none is dead-lettered (%s); "
                      "trying again with backoff", exc)
