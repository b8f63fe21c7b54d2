"""The completer: writes the outcomes of a runner's jobs.

Workers post how each handler ended (:class:`outbox.relay.outcomes.Outcome` or
:class:`outbox.relay.outcomes.Failure`); each dispatcher round hands what was posted to
:meth:`Completer.sort`, which makes the round's :class:`Round`: its outcomes split by the
statement still to write. The completer writes every one of them from that object, in this
order:

* completions (``Outcome.DONE``, :meth:`Completer.write_completions`): the round's claim
  (:class:`outbox.relay.producer.ClaimRequest`, as the producer shaped it) rides in the same
  round trip and transaction (``job_complete_many`` then ``job_claim_after_many``,
  pipelined: one round trip and one commit for both); the
  producer then hands the claimed jobs out. The flow goes one way: the producer shapes the
  claim, the completer sends it with the completions, the producer hands over what it
  returned;
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
:mod:`outbox.db.poison`) and dead-letters each job that fails alone, naming the error.

After the outcomes of a round other than releases are written, :meth:`Completer.finished`
is called with their jobs: the one place for a follow-up statement on them, the promotion
of ordered keys (:mod:`outbox.relay.ordering`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import psycopg

from outbox.db import poison
from outbox.db.jobs import bury_job, complete_jobs, fail_jobs, notify_head, release_jobs, snooze_jobs
from outbox.registry import Subscriber
from outbox.relay import ordering
from outbox.relay.claim import Claim, jobs_of
from outbox.relay.claims import HeldClaims
from outbox.relay.counters import Counters
from outbox.relay.notify import Wakeup
from outbox.relay.outcomes import Failure, Outcome, Snoozed
from outbox.relay.producer import ClaimRequest
from outbox.telemetry.logs import job_summary
from outbox.telemetry.metrics import RelayMetrics

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Round:
    """The outcomes one dispatcher round writes (:meth:`Completer.sort`), by statement:
    completions (``done``: ``job_complete_many``, the round's claim, ``job_claim_after_many``,
    riding with them), failed attempts, snoozes and releases (each a statement of its own); and
    ``finishing``: every claim of the round but the releases, whose ordered keys are
    promoted once their outcomes are written (:meth:`Completer.finished`)."""

    done: list[Claim]
    failed: list[tuple[Claim, Failure]]
    snoozed: list[tuple[Claim, Snoozed]]
    release: list[Claim]
    finishing: list[Claim]

    def pending(self) -> list[tuple[Claim, Any]]:
        """The round's outcomes still to write, in the order they are written."""
        return ([(c, Outcome.DONE) for c in self.done] + list(self.failed) + list(self.snoozed)
                + [(c, Outcome.RELEASE) for c in self.release])


class Completer:
    """Writes outcomes for the runner holding ``claims`` on the tables of ``schema``;
    ``connection()`` is the dispatcher's connection; counts go to ``stats`` (``completed``,
    ``retried``, ``dead``, ``stale``, ``released``, ``snoozed``) and, per consumer, to
    ``metrics`` when given (:mod:`outbox.telemetry.metrics`: each outcome counted here, where it is
    written, with the handlers' timings). At DEBUG it logs one line per finished job."""

    def __init__(self, claims: HeldClaims, connection: Callable[[], psycopg.Connection[Any]],
                 stats: Counters, schema: str, *, subscribers: Mapping[str, Subscriber] | None = None,
                 wake: Wakeup | None = None, metrics: RelayMetrics | None = None, keep_done: bool = True) -> None:
        self.claims = claims
        self.keep_done = keep_done  # a completion marks the job done (False: deletes its row)
        self.metrics = metrics
        self.connection = connection
        self.stats = stats
        self.schema = schema
        self.subscribers = subscribers or {}
        self.wake = wake
        self._unreported: list[Claim] = []  # this round's stale reports for its summary line (report)

    def sort(self, pending: list[tuple[Claim, Any]]) -> Round:
        """The round of ``pending`` (posted outcomes): split by the statement still to write
        them; the ones with nothing to write are accounted for and forgotten here."""
        finishing = [claim for claim, outcome in pending if outcome is not Outcome.RELEASE]
        unwritten: list[tuple[Claim, Any]] = []
        done: list[Claim] = []
        failed: list[tuple[Claim, Failure]] = []
        snoozed: list[tuple[Claim, Snoozed]] = []
        release: list[Claim] = []
        if self.metrics is not None:
            self.metrics.handlers_finished(claim for claim, _ in pending)
        for item in pending:
            claim, outcome = item
            if claim.lease_lost or outcome is Outcome.STALE or outcome is Outcome.COMMITTED or outcome is Outcome.CANCELLED:
                unwritten.append(item)
            elif outcome is Outcome.DONE:
                done.append(claim)
            elif outcome is Outcome.RELEASE:
                release.append(claim)
            elif isinstance(outcome, Snoozed):
                snoozed.append(item)
            else:
                failed.append(item)
        if unwritten:
            committed = [c for c, o in unwritten if o is Outcome.COMMITTED]
            self.stats.add("completed", len(committed))
            self._finished("done", committed)
            cancelled = [c for c, o in unwritten if o is Outcome.CANCELLED]
            self.stats.add("cancelled", len(cancelled))
            self._finished("cancelled", cancelled)
            for claim in cancelled:
                log.info("job %s (%s) cancelled: an operator cancelled it while it ran, so its handler's transaction "
                         "was rolled back (nothing of it committed)", claim.id, claim.consumer,
                         extra=claim.fields(outcome="cancelled"))
            self.stale([c for c, o in unwritten if o is not Outcome.COMMITTED and o is not Outcome.CANCELLED])
            self.claims.forget(c for c, _ in unwritten)
        return Round(done, failed, snoozed, release, finishing)

    def write_completions(self, this: Round, claim: ClaimRequest) -> None:
        """Write the completions of round ``this`` (fenced) with ``claim`` riding in the same
        statement (:meth:`ClaimRequest.send`: one round trip, one commit), and account for
        them (:meth:`completed`). On a data error the completions are written by halves
        (:meth:`by_halves`) and ``claim`` is left unsent, for the producer to make alone.
        Other errors propagate, nothing written."""
        done = this.done
        conn = self.connection()
        buried: set[int] = set()
        try:
            completed = claim.send(conn, jobs_of(done), keep_done=self.keep_done, schema=self.schema)
        except psycopg.Error as exc:
            if not poison.is_data_error(exc):
                raise
            log.warning("claim and completion failed (%s); running them by halves to find the rows that cause it",
                        poison.describe_error(exc))
            completed, buried = self.by_halves("completing", done, lambda part: complete_jobs(
                conn, jobs_of(part), keep_done=self.keep_done, schema=self.schema))
        self.completed(done, completed, buried)

    def completed(self, done: list[Claim], completed: set[int], buried: set[int]) -> None:
        """The claim statement completed the ids ``completed`` of ``done`` (and the
        by-halves fallback dead-lettered ``buried``); the rest were stale."""
        self.stats.add("completed", len(completed))
        if self.metrics is not None or log.isEnabledFor(logging.DEBUG):
            self._finished("done", [c for c in done if c.id in completed])
        if len(completed) + len(buried) < len(done):
            self.stale([c for c in done if c.id not in completed and c.id not in buried])
        self.claims.forget(done)

    def write_failures(self, failed: list[tuple[Claim, Failure]]) -> list[Claim]:
        """Record failed attempts (``job_fail_many``, by halves on a data error); returns
        the jobs that ended dead."""
        statuses, buried = self.by_halves("recording a failed attempt", failed, lambda part: fail_jobs(
            self.connection(), [(c.job, f) for c, f in part], schema=self.schema), claim_of=lambda item: item[0],
            merged={})
        self.log_failures(failed, statuses)
        self.stale([c for c, _ in failed if c.id not in statuses and c.id not in buried])
        self.claims.forget(c for c, _ in failed)
        for claim, failure in failed:
            if failure.timed_out:  # tell the hung handler, should it ever look (job.check_lease())
                claim.job.mark_lease_lost()
        return [c for c, _ in failed if statuses.get(c.id) == "dead" or c.id in buried]

    def write_snoozes(self, snoozed: list[tuple[Claim, Snoozed]]) -> None:
        """Put snoozed jobs back to ready after their delay, attempt not counted
        (``job_snooze_many``, by halves on a data error)."""
        changed, buried = self.by_halves("snoozing", snoozed, lambda part: snooze_jobs(
            self.connection(), [(c.job, s) for c, s in part], schema=self.schema), claim_of=lambda item: item[0])
        self.stats.add("snoozed", len(changed))
        for claim, snooze in snoozed:
            if claim.id in changed:
                log.info("job %s (%s) snoozed for %gs (attempt %s not counted)", claim.id, claim.consumer,
                         snooze.seconds, claim.job.attempt, extra=claim.fields(outcome="snoozed",
                                                                       delay_seconds=snooze.seconds))
        if self.metrics is not None:
            self.metrics.jobs("snoozed", (c.consumer for c, _ in snoozed if c.id in changed))
        self.stale([c for c, _ in snoozed if c.id not in changed and c.id not in buried])
        self.claims.forget(c for c, _ in snoozed)

    def write_releases(self, release: list[Claim]) -> None:
        """Hand jobs back as ready now, attempt not counted (``job_release_many``), and
        tell every relay to claim from the head (``jobs_notify_head``)."""
        released, buried = self.by_halves("releasing", release, lambda part: release_jobs(
            self.connection(), jobs_of(part), schema=self.schema))
        self.stats.add("released", len(released))
        self._finished("released", [c for c in release if c.id in released])
        if released:
            notify_head(self.connection(), schema=self.schema)
            # A coalescing consumer's job released after a newer event of its key was routed ends
            # superseded and leaves its ordered key: let the key go on (a no-op for the others).
            self.finished([c for c in release if c.id in released])
        self.stale([c for c in release if c.id not in released and c.id not in buried])
        self.claims.forget(release)

    def finished(self, claims: list[Claim]) -> None:
        """Called once a round's outcomes other than releases have committed, with their jobs
        (done, failed, snoozed, completed by a transactional handler, or stale): promote the
        next job of each ordered key among them (``job_promote_many``, :mod:`outbox.relay.ordering`),
        in a statement of its own, so its snapshot sees a job a router made ``pending`` while
        those outcomes were written. A key whose head is still unfinished (a retry, a snooze,
        a dead job that blocks) is left as it is. No statement runs when no job is ordered. A
        relay that stops before this runs leaves the keys to the reaper's sweep."""
        promoted = ordering.promote_finished(self.connection(), jobs_of(claims), self.subscribers, schema=self.schema)
        if promoted and self.wake is not None:
            self.stats.add("promoted", len(promoted))
            # An UPDATE sends no NOTIFY: claim the promoted jobs in the next round, from the first of them on.
            self.wake.lower(min((r.priority, r.run_at, 0) for r in promoted))

    def by_halves(self, doing: str, items: list[Any], run: Callable[[Any], Any],
                  claim_of: Callable[[Any], Claim] = lambda item: item, merged: Any = None) -> tuple[Any, set[int]]:
        """Run a fenced batch statement over ``items`` (claims, or (claim, failure) pairs);
        returns its result merged (a set of ids, or a dict) and the ids of the jobs it
        dead-lettered. On a data error it runs by halves (:func:`outbox.db.poison.isolate`) and
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
            claim = claim_of(item)
            error = f"{doing.capitalize()} failed for this job: {poison.describe_error(exc)}"
            buried = poison.try_record(lambda: bury_job(conn, claim.job, error, schema=self.schema))
            if buried is None:
                log.error("job %s (%s) fence %s: %s, and so did dead-lettering it; left to its lease",
                          claim.id, claim.consumer, claim.fence, error, extra=claim.fields(error=error))
            elif buried:
                self.stats.add("dead")
                buried_ids.add(claim.id)
                if self.metrics is not None:
                    self.metrics.jobs("dead", [claim.consumer])
                log.error("dead-lettered job %s (%s) fence %s: %s", claim.id, claim.consumer, claim.fence, error,
                          extra=claim.fields(outcome="dead", error=error))
        return merged, buried_ids

    def stale(self, claims: list[Claim]) -> None:
        """Count reports that changed nothing because the claim was no longer owned, and log
        each at DEBUG; those no summary has named yet (a lost lease the heartbeat reported
        was) wait for the round's summary line, :meth:`report`."""
        stale: list[Claim] = []
        for claim in claims:
            if self.claims.was_released(claim):
                log.info("result of job %s (%s) dropped: the relay released it at shutdown", claim.id, claim.consumer,
                         extra=claim.fields(outcome="released"))
            else:
                self.stats.add("stale")
                stale.append(claim)
                log.debug("stale report dropped: job %s (%s) fence %s no longer owns the job",
                          claim.id, claim.consumer, claim.fence, extra=claim.fields(outcome="stale"))
        self._unreported += self.claims.first_reports(stale)  # before the jobs are forgotten
        if self.metrics is not None and stale:
            self.metrics.jobs("stale", (claim.consumer for claim in stale))

    def report(self) -> None:
        """Log the round's stale reports no other line has named in one WARNING line (count,
        consumers, a few ids); called once at the end of each dispatcher round."""
        claims, self._unreported = self._unreported, []
        if claims:
            text, fields = job_summary(jobs_of(claims), "stale")
            log.warning("stale reports dropped for %s: this relay no longer owns the claims (taken back while it "
                        "held them); nothing was written", text, extra=fields)

    def log_failures(self, failed: list[tuple[Claim, Failure]], statuses: dict[int, str]) -> None:
        dead: list[str] = []
        retried: list[str] = []
        superseded: list[str] = []
        for claim, failure in failed:
            status = statuses.get(claim.id)
            if status == "dead":
                self.stats.add("dead")
                dead.append(claim.consumer)
                error = failure.error.splitlines()[0][:300]
                log.error("dead-lettered job %s (%s, event %s) after attempt %s/%s: %s", claim.id, claim.consumer,
                          claim.job.event_id, claim.job.attempt, claim.job.max_attempts, error,
                          extra=claim.fields(outcome="dead", error=error))
            elif status == "ready":
                self.stats.add("retried")
                retried.append(claim.consumer)
                error = failure.error.splitlines()[0][:200]
                log.info("job %s (%s) failed attempt %s/%s, retry in %.1fs: %s", claim.id, claim.consumer, claim.job.attempt,
                         claim.job.max_attempts, failure.delay, error,
                         extra=claim.fields(outcome="retried", delay_seconds=round(failure.delay, 3), error=error))
            elif status == "superseded":  # a coalescing consumer's: a newer event of its key waits to run
                self.stats.add("superseded")
                superseded.append(claim.consumer)
                error = failure.error.splitlines()[0][:200]
                log.info("job %s (%s) failed attempt %s/%s and is superseded, not retried: a newer event of its key "
                         "was routed while it ran: %s", claim.id, claim.consumer, claim.job.attempt,
                         claim.job.max_attempts, error, extra=claim.fields(outcome="superseded", error=error))
        if self.metrics is not None:
            if superseded:
                self.metrics.jobs("superseded", superseded)
            if dead:
                self.metrics.jobs("dead", dead)
            if retried:
                self.metrics.jobs("retried", retried)

    def _finished(self, outcome: str, claims: list[Claim]) -> None:
        """Count ``jobs`` (written as ``outcome``) per consumer and, at DEBUG, log one line each."""
        if not claims:
            return
        if self.metrics is not None:
            self.metrics.jobs(outcome, (c.consumer for c in claims))
        if log.isEnabledFor(logging.DEBUG):
            for claim in claims:
                log.debug("job %s (%s) %s", claim.id, claim.consumer, outcome, extra=claim.fields(outcome=outcome))
