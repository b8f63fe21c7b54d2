"""The producer: claims jobs for a runner's workers and feeds them in claim order.

**Room.** A runner holds at most ``concurrency + prefetch`` claims whose handlers have
not returned: ``concurrency`` running and up to ``prefetch`` in the buffer.
:meth:`Producer.room` says how many to claim now (at most ``claim_batch``, none while
claims are paused after a claim that fails for every job).

**Claim rounds.** :meth:`Producer.claim` runs the round's completions (the completer's,
``job_complete_many``) and then the claim (``job_claim_after_many``) in one transaction,
one round trip and one commit (:func:`outbox.db.jobs.complete_and_claim_after`). Before it, idle worker slots are reserved for the first ``start_now`` jobs it
claims; those go to the workers at once, and the rest join the buffer, listed in the
relay's row of ``outbox_relays`` by the claim (architecture notes, "Attempts and
crashes"). A forwarder's jobs always join the buffer, listed: the starter unlists them
just before the forwarder sends them, so an attempt is charged when its message is
handed to the broker, not when it is claimed. A data error runs the completions and then the claim by halves
(:mod:`outbox.relay.poison`): a ready job whose claim fails alone is dead-lettered naming the
error, or quarantined.

**The claim-order hint.** Claims start after the claim-order key ``(priority, run_at, id)``
of the last job claimed, so a backlog is not rescanned from the head every round; for at
most ``HINT_SECONDS`` after the last claim from the head, or until a ``head`` NOTIFY says
jobs were handed back ahead of it (``Wakeup.take_rewind``), or until a hinted claim comes
back short (there may be ready jobs before the hint).

**The consumers** a claim takes are :meth:`Producer.claim_leases`: every consumer of the
registry, with its lease. A consumer claimed by a path of its own (in a transaction of its
own) is left out of that list and claimed next to the combined round in
:meth:`Producer.claim`.

**The starter** (:class:`Starter`) hands buffered jobs to workers as they come free, on a
connection of its own: one small statement unlists all it hands over at once
(``relay_buffer_remove``), and only then do their handlers start.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import psycopg
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError

from outbox import backoff
from outbox.db.engine import is_disconnect
from outbox.db.jobs import (
    BufferMark,
    bury_ready_job,
    claim_candidates,
    complete_and_claim_after,
    complete_jobs,
    job_from_claim_row,
    relay_buffer_remove,
)
from outbox.job import Job
from outbox.registry import Subscriber
from outbox.relay import flow, poison
from outbox.relay.claims import HeldClaims, Signals
from outbox.relay.completer import Completer
from outbox.relay.counters import Counters
from outbox.relay.notify import Wakeup
from outbox.relay.outcomes import Outcome
from outbox.relay.reconnect import Reconnector
from outbox.settings import OutboxSettings
from outbox.telemetry.logs import job_fields, job_summary
from outbox.telemetry.metrics import RelayMetrics

log = logging.getLogger(__name__)

#: Longest a dispatcher claims after its hint (the key of the last job it claimed) before it
#: claims from the head of the ready jobs again, seconds: how long a job that sorts before
#: the hint (released, retried early, more urgent) may wait behind a backlog.
HINT_SECONDS = 1.0


class ClaimHint:
    """The claim-order key ``(priority, run_at, id)`` claims start after, shared by the
    producers of one runner (one per dispatcher): each claims after the key of the last job
    the latest claim of any of them returned, so none walks far through the index entries
    of jobs another one just claimed. Valid for ``HINT_SECONDS`` after the last claim from
    the head (module notes).

    Always the latest claim's key, never the furthest seen: a claim from the head (after a
    rewind: jobs handed back keep their early place) may take only part of what sorts before
    the old key, and the next claim must go on from where it stopped, not jump back past the
    rest (kept at the furthest key, handed-back jobs waited a second per claim's worth,
    test_sigterm_under_heavy_load)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._key: tuple[int, Any, int] | None = None
        self._until = 0.0

    def get(self) -> tuple[int, Any, int] | None:
        """The key to claim after, or None: claim from the head."""
        with self._lock:
            return self._key if time.monotonic() < self._until else None

    def claimed(self, hinted: bool, short: bool, last: tuple[int, Any, int] | None) -> None:
        """A claim returned: it started after the hint (``hinted``) or at the head, came back
        ``short`` (fewer than asked), and ``last`` is the key of its last job (None: none)."""
        with self._lock:
            if not hinted:
                self._until = time.monotonic() + HINT_SECONDS
            # Short after the hint: there may be ready jobs before it; the next claim starts at the head.
            self._key = None if (hinted and short) else last


class Producer:
    """Claims jobs of ``leases``' consumers (consumer -> lease seconds) for the runner
    holding ``claims``; jobs for idle slots go to ``start`` (the workers' queue, or the
    forwarder for a forwarder's jobs), the rest
    to the buffer. ``wake`` carries the ``head`` rewind; claims are counted in ``stats``.
    ``hint`` and ``quarantine`` are shared by the producers of one runner (one per
    dispatcher): each claims after the last job the latest of their claims took and skips the rows
    any of them quarantined."""

    def __init__(self, settings: OutboxSettings, claims: HeldClaims, leases: dict[str, float], worker_id: str,
                 wake: Wakeup, start: Callable[[list[Job]], None], completer: Completer,
                 stats: Counters, *, hint: ClaimHint, quarantine: poison.Quarantine,
                 subscribers: Mapping[str, Subscriber] | None = None, metrics: RelayMetrics | None = None) -> None:
        self.settings = settings
        self.metrics = metrics
        self.claims = claims
        self.leases = leases
        self.worker_id = worker_id
        self.wake = wake
        self.start = start
        self.completer = completer
        self.stats = stats
        self.schema = settings.schema_name
        # Claim-order key (priority, run_at, id) of the last job claimed: claims start after
        # it, until HINT_SECONDS after the last claim from the head.
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
        """The consumers the combined claim statement takes, with their lease seconds: all
        of them but those excluded now (:meth:`exclude`)."""
        excluded = self._excluded()
        if excluded != self._leases_without[0]:
            self._leases_without = (excluded, {c: lease for c, lease in self.leases.items() if c not in excluded})
        return self._leases_without[1]

    def room(self) -> int:
        """How many jobs to claim now: room in the buffer, at most ``claim_batch``; none
        while claims are paused (:meth:`pause`), or while hung handlers hold every
        worker slot (:mod:`outbox.relay.watchdog`: their slots count as taken, so otherwise the
        room is the same)."""
        if time.monotonic() < self.claims_paused_until or self.claims.all_hung():
            return 0
        return max(0, min(self.settings.claim_batch, self.limit() - self.claims.taken()))

    def limit(self) -> int:
        """Most claims the runner holds whose handlers have not returned (or whose broker has
        not answered): ``concurrency`` + the forwarding window + ``prefetch``."""
        return self.settings.concurrency + self.claims.window + self.settings.prefetch

    def worth_claiming(self, want: int) -> bool:
        """A claim of its own (no completions to carry it) is worth its round trip when it
        can take half a batch, or when a worker would otherwise sit idle."""
        return self.claims.has_idle_worker() or want >= max(
            1, min(self.settings.claim_batch, self.settings.prefetch) // 2)

    def claim(self, conn: psycopg.Connection[Any], done: list[Job], want: int) -> tuple[set[int], set[int], bool]:
        """Complete ``done`` (fenced) and claim up to ``want`` jobs on ``conn`` (fewer when
        another dispatcher's claim in flight took the room meanwhile: :meth:`HeldClaims.expect`);
        returns (ids completed, ids of ``done`` dead-lettered, whether the table is drained:
        a claim from the head of the ready jobs found fewer than it asked for; a short claim
        after the hint says nothing). Claimed jobs go to idle workers at once (their slots
        were reserved before the statement, so they were never listed as buffered) and the
        rest into the buffer, listed by the same statement."""
        want = self.claims.expect(want, self.limit())
        try:
            return self._claim(conn, done, want)
        finally:
            self.claims.unexpect(want)

    def _claim(self, conn: psycopg.Connection[Any], done: list[Job], want: int) -> tuple[set[int], set[int], bool]:
        start_now = self.claims.reserve(want)
        sent = time.monotonic()  # the database's now() of the claim is later: a safe lower bound
        rewound = want > 0 and self.wake.take_rewind()  # jobs were handed back ahead of the hint
        after = self.hint.get() if want > 0 and not rewound else None
        hinted = after is not None
        mark = BufferMark(self.worker_id, start_now, self.claims.forwarding)
        buried: set[int] = set()
        try:
            try:
                completed, claimed, last = complete_and_claim_after(
                    conn, done, self.claim_leases(), want, self.worker_id, after,
                    buffer=mark, skip=self.quarantine.ids(), keep_done=self.settings.keep_done,
                    schema=self.schema)
            except psycopg.Error as exc:
                if not poison.is_data_error(exc):
                    raise
                log.warning("claim and completion failed (%s); running them by halves to find the rows that "
                            "cause it", poison.describe_error(exc))
                completed, buried, claimed = self._claim_by_halves(conn, done, want, mark)
                last, hinted = None, True  # claim from the head next time
            else:
                if want:
                    self.claim_failures = 0
        except BaseException:
            self.claims.unreserve(start_now)
            raise
        if self.metrics is not None:
            self.metrics.claim_round_trip(time.monotonic() - sent)
        if want:
            # Found fewer than asked after the hint: there may be ready jobs before it
            # (released, retried early, more urgent); the next claim starts at the head.
            self.hint.claimed(hinted, len(claimed) < want, last)
        self._hand_over(claimed, start_now, sent)
        return completed, buried, want > 0 and len(claimed) < want and not hinted

    def _hand_over(self, claimed: list[Job], start_now: int, sent: float) -> None:
        """Jobs just claimed (a statement sent at ``sent``, monotonic), in claim order: the
        first ``start_now`` that are not a forwarder's to the workers reserved for them, the
        rest into the buffer (as the claim listed them: :class:`BufferMark`)."""
        for job in claimed:
            job._lease_bound = sent + job.lease_seconds
            job._claim_sent = sent
        self.stats.add("claimed", len(claimed))
        if self.metrics is not None and claimed:
            self.metrics.jobs("claimed", [job.consumer for job in claimed])
        first = BufferMark(None, start_now, self.claims.forwarding).starts_now(claimed)
        self.claims.unreserve(start_now - len(first))
        self.claims.issue(first)
        self.start(first)
        started = {job.fence for job in first}
        self.claims.hold([job for job in claimed if job.fence not in started])

    def claim_limited(self, conn: psycopg.Connection[Any], room: int) -> int:
        """Claim up to ``room`` jobs of the capped or rate-limited consumers on their own path
        (:class:`outbox.relay.flow.FlowControl`: a transaction that locks their rows first), handed
        over like any claim: idle workers first, the rest buffered (listed by the same
        transaction). Returns how many were claimed."""
        room = self.claims.expect(room, self.limit())
        try:
            return self._claim_limited(conn, room) if room else 0
        finally:
            self.claims.unexpect(room)

    def _claim_limited(self, conn: psycopg.Connection[Any], room: int) -> int:
        start_now = self.claims.reserve(room)
        sent = time.monotonic()
        try:
            rows = self.flow.claim(conn, room, self.worker_id, start_now, self._excluded(), self.claims.forwarding)
        except BaseException:
            self.claims.unreserve(start_now)
            raise
        if self.metrics is not None:
            self.metrics.claim_round_trip(time.monotonic() - sent)
        claimed = [job_from_claim_row(r, self.leases[r.consumer]) for r in rows]
        self._hand_over(claimed, start_now, sent)
        return len(claimed)

    def _claim_by_halves(self, conn: psycopg.Connection[Any], done: list[Job], want: int,
                         mark: BufferMark) -> tuple[set[int], set[int], list[Job]]:
        """After a data error of the combined round: the completions by halves, then
        the claim (with the buffer list) alone and, if that fails too, by halves of its
        candidates, each half writing the buffer list as it then stands. A job that fails
        alone is dead-lettered naming the error (or quarantined); the others go on.
        Returns (ids completed, ids of ``done`` dead-lettered, jobs claimed in claim order)."""
        completed, buried = self.completer.by_halves(
            "completing", done, lambda part: complete_jobs(conn, list(part), keep_done=self.settings.keep_done,
                                                    schema=self.schema))
        start_left = mark.start_now
        claimed: list[Job] = []
        leases = self.claim_leases()

        def claim(only: list[int] | None) -> list[Job]:
            nonlocal start_left
            part_mark = BufferMark(mark.relay, start_left, mark.forwarding)
            _, got, _ = complete_and_claim_after(
                conn, [], leases, want if only is None else len(only), self.worker_id, None,
                buffer=part_mark, skip=self.quarantine.ids(), only=only, schema=self.schema)
            start_left -= len(part_mark.starts_now(got))
            return got

        if not want:  # only the buffer list to write: no row of a job to blame
            return completed, buried, claim(None)
        try:
            parts, poisoned = poison.whole_or_halves(
                "claiming", lambda: claim(None),
                lambda: claim_candidates(conn, list(leases), want, self.quarantine.ids(), schema=self.schema),
                lambda part: claim(list(part)))
        except poison.SystemicError as exc:
            self.pause(exc)
            return completed, buried, claimed
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
        return completed, buried, claimed

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


class Starter:
    """Hands buffered jobs of ``claims`` to idle workers (``start``: the workers' queue, or
    the forwarder for a forwarder's jobs), on a connection of
    its own from ``engine``; a buffered job whose lease ran out is posted for release
    through ``release(job)``. Runs in its own thread (:meth:`run`) until ``signals.stopped``."""

    def __init__(self, engine: Engine, settings: OutboxSettings, claims: HeldClaims, worker_id: str,
                 start: Callable[[list[Job]], None], release: Callable[[Job, Outcome], None], signals: Signals,
                 reconnect: Reconnector) -> None:
        self.engine = engine
        self.settings = settings
        self.claims = claims
        self.worker_id = worker_id
        self.start = start
        self.release = release
        self.signals = signals
        self.reconnect = reconnect

    def run(self) -> None:
        """Take as many jobs from the head of the buffer as workers are idle, unlist them in
        the relay's row (``relay_buffer_remove``, one small statement for all of them), and
        only once that has committed give them to the workers. So a job whose handler may
        have started is never listed, and a worker that finishes waits one short round trip,
        shared by every worker that came free meanwhile, not for the dispatcher's claim. A
        buffered job whose lease ran out while it waited (the process was paused, or
        starved) is released instead (fenced: a no-op if it was reaped or re-claimed); the
        ones found together are logged in one WARNING line, each at DEBUG."""
        claims, signals = self.claims, self.signals
        failures = 0
        conn: Any = None
        while True:
            with claims.changed:
                while not signals.stopped.is_set() and (signals.draining.is_set() or not claims.can_start()):
                    claims.changed.wait(0.5)
                if signals.stopped.is_set():
                    break
                jobs, forwards, expired = claims.take_startable(time.monotonic())
                jobs += forwards
            for job in expired:
                log.debug("job %s (%s) fence %s not started: its lease ran out while it waited in the buffer",
                          job.id, job.consumer, job.fence, extra=job_fields(job, outcome="released"))
            first = claims.first_reports(expired)
            if first:
                text, fields = job_summary(first, "released")
                log.warning("%s not started: the claims' leases ran out while they waited in the buffer (a pause, "
                            "or a starved process); handing them back", text, extra=fields)
            for job in expired:
                claims.mark_finishing(job)
                self.release(job, Outcome.RELEASE)
            if not jobs:
                continue
            try:
                if conn is None:
                    conn = self.engine.raw_connection()
                    conn.driver_connection.autocommit = True
                relay_buffer_remove(conn.driver_connection, self.worker_id, [j.fence for j in jobs],
                                    schema=self.settings.schema_name)
                failures = self.reconnect.recovered(failures, "starting buffered jobs")
            except (DBAPIError, psycopg.Error) as exc:
                claims.put_back(jobs)
                if conn is not None and (is_disconnect(exc) or conn.driver_connection is None
                                         or conn.driver_connection.closed or conn.driver_connection.broken):
                    try:
                        conn.invalidate()
                    except Exception:  # noqa: BLE001 - it is being thrown away
                        pass
                    conn = None
                failures = self.reconnect.backoff(failures, "starting buffered jobs", exc, signals.stopped)
                continue
            claims.unlisted(jobs)
            self.start(jobs)
        if conn is not None:
            try:
                conn.close()
            except Exception:  # noqa: BLE001
                pass
