"""The runner's record of one claim it holds: :class:`Claim`.

A claim is one attempt at one job, from the statement that claimed it to the statement that
writes its outcome (or its release). The :class:`~outbox.job.Job` inside is what the handler
sees (its input, ``lease_lost``, ``cancel_requested``, ``check_lease()``); the runner's own
bookkeeping lives here, beside it, and never on the job:

* where the claim found the job in the queue (:attr:`Claim.order`), which the buffer keeps
  (:class:`outbox.relay.claims.HeldClaims`);
* the lease: the database's ``lease_until`` of the claim, and the runner's own conservative
  bound of it by its monotonic clock (:attr:`Claim.lease_bound`, renewed by each heartbeat),
  by which a buffered job whose lease ran out is handed back, not started;
* the timings the relay's metrics and log lines report: when the claim was sent, when the
  handler started and how long it ran.

The record is made by the producer from a claim's row (:meth:`Claim.from_row`) and read and
written by the runner's threads (producer, starter, workers, forwarder, heartbeat,
completer); a field changes in one thread at a time, as the claim passes from one part to
the next (:mod:`outbox.relay.runner`).
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any

from outbox.db.jobs import claim_order, job_from_row
from outbox.job import Job
from outbox.telemetry.logs import job_fields


class Claim:
    """One claim this runner holds of :attr:`job` (see the module notes). ``id``,
    ``fence`` and ``consumer`` are the job's, kept here for the runner's bookkeeping (a
    fence names one claim; a job id may be held twice). ``lease_bound`` is a
    ``time.monotonic()`` (``inf``: no bound known); ``sent``, ``started`` are
    ``time.monotonic()`` readings (0: not yet, or already accounted for by the metrics);
    ``ran`` is the handler's run time in seconds (0: not run)."""

    __slots__ = ("job", "id", "fence", "consumer", "order", "lease_until", "lease_bound", "sent", "started", "ran")

    def __init__(self, job: Job, order: tuple[Any, ...] = (), lease_until: datetime | None = None) -> None:
        self.job = job
        self.id = job.id
        self.fence = job.fence
        self.consumer = job.consumer
        #: (priority, run_at, id): where the claim found the job in the queue. The buffer keeps
        #: this order, so a job claimed late that sorts early (released by a relay that
        #: stopped, reaped) starts before the buffered backlog, as it would have in the table.
        self.order = order
        #: The claim's ``lease_until`` by the database clock (None: not known).
        self.lease_until = lease_until
        #: time.monotonic() by which the lease has surely expired if no heartbeat renewed it:
        #: used only to not start (or send) a buffered job whose lease ran out while the
        #: process was paused; never to write anything.
        self.lease_bound = float("inf")
        self.sent = 0.0
        self.started = 0.0
        self.ran = 0.0

    @classmethod
    def from_row(cls, row: Any, lease_seconds: float) -> Claim:
        """The claim of a row of a claim statement that returned ``priority`` and ``run_at``
        besides the columns of ``job_claim_many`` (read by name; its claim order:
        :func:`~outbox.db.jobs.claim_order`)."""
        return cls(job_from_row(row, lease_seconds), claim_order(row), row.lease_until)

    def sent_at(self, sent: float) -> None:
        """The claim's statement was sent at ``sent`` (``time.monotonic()``): the lease runs
        out no later than ``sent`` + the lease, the database's ``now()`` being later."""
        self.sent = sent
        self.lease_bound = sent + self.job.lease_seconds

    def renewed(self, sent: float) -> None:
        """A heartbeat sent at ``sent`` (``time.monotonic()``) renewed the lease."""
        self.lease_bound = sent + self.job.lease_seconds

    @property
    def lease_lost(self) -> bool:
        """Whether the job's lease is lost (:attr:`outbox.job.Job.lease_lost`)."""
        return self.job.lease_lost

    def fields(self, **more: Any) -> dict[str, Any]:
        """The structured fields of a log line about this claim's job
        (:func:`outbox.telemetry.logs.job_fields`), with the handler's run time once it ran."""
        return job_fields(self.job, duration=self.ran, **more)

    def __repr__(self) -> str:
        return f"Claim({self.job!r}, order={self.order!r})"


def jobs_of(claims: Iterable[Claim]) -> list[Job]:
    """The jobs of ``claims`` (an iterable of :class:`Claim`), in order."""
    return [claim.job for claim in claims]
