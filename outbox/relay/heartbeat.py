"""The heartbeat: renews the leases of every claim a runner holds.

Every lease/3 (of the shortest lease of its consumers) one statement,
``job_heartbeat_many``, renews every claim held, buffered ones included, each with its
own lease (``WHERE id AND fence AND status = 'running'``). A claim whose row does not come
back (reaped after a pause, released, re-claimed) has lost its lease: the job is told
(``job.lease_lost``; ``job.check_lease()`` raises) and its result will be dropped, unless
its outcome is being written at that moment (the completion itself took the row). The jobs
one beat finds lost are logged in one WARNING line (count, consumers, a few ids), each at
DEBUG. A claim
that is renewed gets a new local bound (``sent + lease``), which the starter and the
transactional executor check before they rely on the claim.

A data error confines itself to the jobs that cause it (:mod:`outbox.db.poison`): each is
dead-lettered naming the error (fenced) or, where even that fails, reported not owned so
its lease runs out. Database errors are retried, never more than half a second apart:
leases are at stake.
"""

from __future__ import annotations

import logging
import time

from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError

from outbox.db import poison
from outbox.db.jobs import bury_job, heartbeat_jobs
from outbox.job import Job
from outbox.relay.claim import jobs_of
from outbox.relay.claims import HeldClaims, Signals
from outbox.relay.counters import Counters
from outbox.relay.reconnect import Reconnector
from outbox.telemetry.logs import job_fields, job_summary
from outbox.telemetry.metrics import RelayMetrics

log = logging.getLogger(__name__)


class Heartbeater:
    """Renews the leases of ``claims`` every ``interval`` seconds on pooled autocommit
    connections of ``engine`` (tables of ``schema``) until ``signals.stopped``; counts lost
    leases in ``stats["lease_lost"]``. Runs in its own thread (:meth:`run`)."""

    def __init__(self, engine: Engine, claims: HeldClaims, interval: float, signals: Signals,
                 reconnect: Reconnector, stats: Counters, schema: str, *,
                 metrics: RelayMetrics | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.claims = claims
        self.interval = interval
        self.signals = signals
        self.reconnect = reconnect
        self.stats = stats
        self.schema = schema

    def run(self) -> None:
        failures = 0
        while not self.signals.stopped.wait(self.interval if not failures else 0):
            claims = self.claims.renewable()
            if not claims:
                continue
            sent = time.monotonic()
            try:
                with self.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                    owned = self.beat(conn, jobs_of(claims))
                failures = self.reconnect.recovered(failures, "heartbeat")
            except (DBAPIError, poison.SystemicError) as exc:
                failures = self.reconnect.backoff(failures, "heartbeat", exc, self.signals.stopped, cap=0.5)
                continue
            for claim in claims:
                if claim.fence in owned:
                    claim.renewed(sent)
            lost = self.claims.lost(claims, owned)
            for claim in lost:
                claim.job.mark_lease_lost()
                self.stats.add("lease_lost")
                log.debug("lease lost: job %s (%s) fence %s was taken back; its result will be dropped",
                          claim.id, claim.consumer, claim.fence, extra=claim.fields(outcome="lease_lost"))
            first = self.claims.first_reports(lost)
            if first:
                text, fields = job_summary(jobs_of(first), "lease_lost")
                log.warning("lease lost on %s: the claims were taken back (this relay paused, or cut off from its "
                            "database, for longer than the lease); what their handlers report will be dropped",
                            text, extra=fields)
            if self.metrics is not None and lost:
                self.metrics.jobs("lease_lost", (claim.consumer for claim in lost))

    def beat(self, conn: Connection, jobs: list[Job]) -> set[int]:
        """Renew the leases of ``jobs``; returns the fences still owned. A data error is
        confined to the jobs that cause it: each is dead-lettered naming the error
        (fenced), or, where even that fails, reported not owned, so its worker is told and
        its lease runs out."""
        parts, poisoned = poison.isolate(jobs, lambda part: heartbeat_jobs(conn, list(part), schema=self.schema))
        owned: set[int] = set().union(*parts)
        for job, exc in poisoned:
            error = f"Renewing the lease failed for this job: {poison.describe_error(exc)}"
            buried = poison.try_record(lambda: bury_job(conn, job, error, schema=self.schema))
            log.error("job %s (%s) fence %s: %s%s", job.id, job.consumer, job.fence, error,
                      "; dead-lettered" if buried else "; dead-lettering it failed too, its lease will run out",
                      extra=job_fields(job, outcome="dead" if buried else None, error=error))
            if buried and self.metrics is not None:
                self.metrics.jobs("dead", [job.consumer])
        return owned
