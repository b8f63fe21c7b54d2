"""The completer: writes the outcomes of a runner's jobs.

Workers post how each handler ended (:class:`outbox.relay.outcomes.Outcome` or
:class:`outbox.relay.outcomes.Failure`); each dispatcher round hands what was posted to
:meth:`Completer.sort`, which splits it by the statement still to write:

* completions (``Outcome.DONE``) ride with the round's claim (``job_complete_many`` then
  ``job_claim_after_many``, run by the producer, one round trip for both);
  :meth:`Completer.completed` accounts for what the completion returned;
* failed attempts go to ``job_fail_many`` (:meth:`Completer.write_failures`): back to
  ``ready`` after the attempt's backoff, or ``dead`` when out of attempts or permanent;
* snoozes (:class:`outbox.relay.outcomes.Snoozed`: the handler raised ``Snooze``) go to
  ``job_snooze_many``: ready again after the delay, attempt given back, ``snoozes + 1``;
* releases (``Outcome.RELEASE``: no connection for a transactional handler, buffered
  claims while draining, a lease that ran out in the buffer) go to ``job_release_many``
  (attempt not counted) and a ``head`` NOTIFY, so every relay claims them at once;
* outcomes with nothing to write: ``COMMITTED`` (the handler's transaction completed the
  job), ``CANCELLED`` (the handler's transaction rolled back for an operator's cancel, which
  its worker recorded), ``STALE`` and any result of a claim whose lease was lost.

Every statement is fenced (``WHERE id AND fence AND status = 'running'``) and returns the
rows it changed; a job missing from them was a stale report: dropped, nothing changed, and
logged once per round for all of them (:meth:`Completer.report`: count, consumers, a few
ids; each at DEBUG), unless the heartbeat or the starter already named it. A data error in a batch statement runs it by halves (:meth:`Completer.by_halves`,
:mod:`outbox.relay.poison`) and dead-letters each job that fails alone, naming the error.

After the outcomes of a round other than releases are written, :meth:`Completer.finished`
is called with their jobs: the one place for a follow-up statement on them, the promotion
of ordered keys (:mod:`outbox.relay.ordering`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import psycopg

from outbox.db.jobs import bury_job, fail_jobs, notify_head, release_jobs, snooze_jobs
from outbox.job import Job
from outbox.registry import Subscriber
from outbox.relay import ordering, poison
from outbox.relay.claims import HeldClaims
from outbox.relay.counters import Counters
from outbox.relay.notify import Wakeup
from outbox.relay.outcomes import Failure, Outcome, Snoozed
from outbox.telemetry.logs import job_fields, job_summary
from outbox.telemetry.metrics import RelayMetrics

log = logging.getLogger(__name__)


class Completer:
    """Writes outcomes for the runner holding ``claims`` on the tables of ``schema``;
    ``connection()`` is the dispatcher's connection; counts go to ``stats`` (``completed``,
    ``retried``, ``dead``, ``stale``, ``released``, ``snoozed``) and, per consumer, to
    ``metrics`` when given (:mod:`outbox.telemetry.metrics`: each outcome counted here, where it is
    written, with the handlers' timings). At DEBUG it logs one line per finished job."""

    def __init__(self, claims: HeldClaims, connection: Callable[[], psycopg.Connection[Any]],
                 stats: Counters, schema: str, *, subscribers: Mapping[str, Subscriber] | None = None,
                 wake: Wakeup | None = None, metrics: RelayMetrics | None = None) -> None:
        self.claims = claims
        self.metrics = metrics
        self.connection = connection
        self.stats = stats
        self.schema = schema
        self.subscribers = subscribers or {}
        self.wake = wake
        self._unreported: list[Job] = []  # this round's stale reports for its summary line (report)

    def sort(self, pending: list[tuple[Job, Any]]) -> tuple[
            list[Job], list[tuple[Job, Failure]], list[tuple[Job, Snoozed]], list[Job]]:
        """Split posted outcomes into (completions, failures, snoozes, releases) still to
        write; the ones with nothing to write are accounted for and forgotten here."""
        unwritten: list[tuple[Job, Any]] = []
        done: list[Job] = []
        failed: list[tuple[Job, Failure]] = []
        snoozed: list[tuple[Job, Snoozed]] = []
        release: list[Job] = []
        if self.metrics is not None:
            self.metrics.handlers_finished(job for job, _ in pending)
        for item in pending:
            job, outcome = item
            if job.lease_lost or outcome is Outcome.STALE or outcome is Outcome.COMMITTED or outcome is Outcome.CANCELLED:
                unwritten.append(item)
            elif outcome is Outcome.DONE:
                done.append(job)
            elif outcome is Outcome.RELEASE:
                release.append(job)
            elif isinstance(outcome, Snoozed):
                snoozed.append(item)
            else:
                failed.append(item)
        if unwritten:
            committed = [j for j, o in unwritten if o is Outcome.COMMITTED]
            self.stats.add("completed", len(committed))
            self._finished("done", committed)
            cancelled = [j for j, o in unwritten if o is Outcome.CANCELLED]
            self.stats.add("cancelled", len(cancelled))
            self._finished("cancelled", cancelled)
            for job in cancelled:
                log.info("job %s (%s) cancelled: an operator cancelled it while it ran, so its handler's transaction "
                         "was rolled back (nothing of it committed)", job.id, job.consumer,
                         extra=job_fields(job, outcome="cancelled"))
            self.stale([j for j, o in unwritten if o is not Outcome.COMMITTED and o is not Outcome.CANCELLED])
            self.claims.forget(j for j, _ in unwritten)
        return done, failed, snoozed, release

    def completed(self, done: list[Job], completed: set[int], buried: set[int]) -> None:
        """The claim statement completed the ids ``completed`` of ``done`` (and the
        by-halves fallback dead-lettered ``buried``); the rest were stale."""
        self.stats.add("completed", len(completed))
        if self.metrics is not None or log.isEnabledFor(logging.DEBUG):
            self._finished("done", [j for j in done if j.id in completed])
        if len(completed) + len(buried) < len(done):
            self.stale([j for j in done if j.id not in completed and j.id not in buried])
        self.claims.forget(done)

    def write_failures(self, failed: list[tuple[Job, Failure]]) -> list[Job]:
        """Record failed attempts (``job_fail_many``, by halves on a data error); returns
        the jobs that ended dead."""
        statuses, buried = self.by_halves("recording a failed attempt", failed, lambda part: fail_jobs(
            self.connection(), list(part), schema=self.schema), job_of=lambda item: item[0], merged={})
        self.log_failures(failed, statuses)
        self.stale([j for j, _ in failed if j.id not in statuses and j.id not in buried])
        self.claims.forget(j for j, _ in failed)
        for job, failure in failed:
            if failure.timed_out:  # tell the hung handler, should it ever look (job.check_lease())
                job.mark_lease_lost()
        return [j for j, _ in failed if statuses.get(j.id) == "dead" or j.id in buried]

    def write_snoozes(self, snoozed: list[tuple[Job, Snoozed]]) -> None:
        """Put snoozed jobs back to ready after their delay, attempt not counted
        (``job_snooze_many``, by halves on a data error)."""
        changed, buried = self.by_halves("snoozing", snoozed, lambda part: snooze_jobs(
            self.connection(), list(part), schema=self.schema), job_of=lambda item: item[0])
        self.stats.add("snoozed", len(changed))
        for job, snooze in snoozed:
            if job.id in changed:
                log.info("job %s (%s) snoozed for %gs (attempt %s not counted)", job.id, job.consumer,
                         snooze.seconds, job.attempt, extra=job_fields(job, outcome="snoozed",
                                                                       delay_seconds=snooze.seconds))
        if self.metrics is not None:
            self.metrics.jobs("snoozed", (j.consumer for j, _ in snoozed if j.id in changed))
        self.stale([j for j, _ in snoozed if j.id not in changed and j.id not in buried])
        self.claims.forget(j for j, _ in snoozed)

    def write_releases(self, release: list[Job]) -> None:
        """Hand jobs back as ready now, attempt not counted (``job_release_many``), and
        tell every relay to claim from the head (``jobs_notify_head``)."""
        released, buried = self.by_halves("releasing", release, lambda part: release_jobs(
            self.connection(), list(part), schema=self.schema))
        self.stats.add("released", len(released))
        self._finished("released", [j for j in release if j.id in released])
        if released:
            notify_head(self.connection(), schema=self.schema)
        self.stale([j for j in release if j.id not in released and j.id not in buried])
        self.claims.forget(release)

    def finished(self, jobs: list[Job]) -> None:
        """Called once a round's outcomes other than releases have committed, with their jobs
        (done, failed, snoozed, completed by a transactional handler, or stale): promote the
        next job of each ordered key among them (``job_promote_many``, :mod:`outbox.relay.ordering`),
        in a statement of its own, so its snapshot sees a job a router made ``pending`` while
        those outcomes were written. A key whose head is still unfinished (a retry, a snooze,
        a dead job that blocks) is left as it is. No statement runs when no job is ordered. A
        relay that stops before this runs leaves the keys to the reaper's sweep."""
        promoted = ordering.promote_finished(self.connection(), jobs, self.subscribers, schema=self.schema)
        if promoted and self.wake is not None:
            self.stats.add("promoted", len(promoted))
            self.wake.set()  # an UPDATE sends no NOTIFY: claim the promoted jobs in the next round

    def by_halves(self, doing: str, items: list[Any], run: Callable[[Any], Any],
                  job_of: Callable[[Any], Job] = lambda item: item, merged: Any = None) -> tuple[Any, set[int]]:
        """Run a fenced batch statement over ``items`` (jobs, or (job, failure) pairs);
        returns its result merged (a set of ids, or a dict) and the ids of the jobs it
        dead-lettered. On a data error it runs by halves (:func:`outbox.relay.poison.isolate`) and
        dead-letters each job that fails alone, naming the error (fenced); a job even that
        fails for is left to its lease (the reaper meets the same error and quarantines
        it). ``merged`` is the empty result to merge into (default: a set). Other errors
        propagate."""
        parts, poisoned = poison.isolate(items, run)
        merged = set() if merged is None else merged
        for part in parts:
            merged.update(part)
        buried_ids: set[int] = set()
        if not poisoned:
            return merged, buried_ids
        conn = self.connection()
        for item, exc in poisoned:
            job = job_of(item)
            error = f"{doing.capitalize()} failed for this job: {poison.describe_error(exc)}"
            buried = poison.try_record(lambda: bury_job(conn, job, error, schema=self.schema))
            if buried is None:
                log.error("job %s (%s) fence %s: %s, and so did dead-lettering it; left to its lease",
                          job.id, job.consumer, job.fence, error, extra=job_fields(job, error=error))
            elif buried:
                self.stats.add("dead")
                buried_ids.add(job.id)
                if self.metrics is not None:
                    self.metrics.jobs("dead", [job.consumer])
                log.error("dead-lettered job %s (%s) fence %s: %s", job.id, job.consumer, job.fence, error,
                          extra=job_fields(job, outcome="dead", error=error))
        return merged, buried_ids

    def stale(self, jobs: list[Job]) -> None:
        """Count reports that changed nothing because the claim was no longer owned, and log
        each at DEBUG; those no summary has named yet (a lost lease the heartbeat reported
        was) wait for the round's summary line, :meth:`report`."""
        stale: list[Job] = []
        for job in jobs:
            if self.claims.was_released(job):
                log.info("result of job %s (%s) dropped: the relay released it at shutdown", job.id, job.consumer,
                         extra=job_fields(job, outcome="released"))
            else:
                self.stats.add("stale")
                stale.append(job)
                log.debug("stale report dropped: job %s (%s) fence %s no longer owns the job",
                          job.id, job.consumer, job.fence, extra=job_fields(job, outcome="stale"))
        self._unreported += self.claims.first_reports(stale)  # before the jobs are forgotten
        if self.metrics is not None and stale:
            self.metrics.jobs("stale", (job.consumer for job in stale))

    def report(self) -> None:
        """Log the round's stale reports no other line has named in one WARNING line (count,
        consumers, a few ids); called once at the end of each dispatcher round."""
        jobs, self._unreported = self._unreported, []
        if jobs:
            text, fields = job_summary(jobs, "stale")
            log.warning("stale reports dropped for %s: this relay no longer owns the claims (taken back while it "
                        "held them); nothing was written", text, extra=fields)

    def log_failures(self, failed: list[tuple[Job, Failure]], statuses: dict[int, str]) -> None:
        dead: list[str] = []
        retried: list[str] = []
        for job, failure in failed:
            status = statuses.get(job.id)
            if status == "dead":
                self.stats.add("dead")
                dead.append(job.consumer)
                error = failure.error.splitlines()[0][:300]
                log.error("dead-lettered job %s (%s, event %s) after attempt %s/%s: %s", job.id, job.consumer,
                          job.event_id, job.attempt, job.max_attempts, error,
                          extra=job_fields(job, outcome="dead", error=error))
            elif status == "ready":
                self.stats.add("retried")
                retried.append(job.consumer)
                error = failure.error.splitlines()[0][:200]
                log.info("job %s (%s) failed attempt %s/%s, retry in %.1fs: %s", job.id, job.consumer, job.attempt,
                         job.max_attempts, failure.delay, error,
                         extra=job_fields(job, outcome="retried", delay_seconds=round(failure.delay, 3), error=error))
        if self.metrics is not None:
            if dead:
                self.metrics.jobs("dead", dead)
            if retried:
                self.metrics.jobs("retried", retried)

    def _finished(self, outcome: str, jobs: list[Job]) -> None:
        """Count ``jobs`` (written as ``outcome``) per consumer and, at DEBUG, log one line each."""
        if not jobs:
            return
        if self.metrics is not None:
            self.metrics.jobs(outcome, (j.consumer for j in jobs))
        if log.isEnabledFor(logging.DEBUG):
            for job in jobs:
                log.debug("job %s (%s) %s", job.id, job.consumer, outcome, extra=job_fields(job, outcome=outcome))
