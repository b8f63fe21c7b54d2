"""Attempt history (issue 32, item 1) on a real PostgreSQL: the claim sets ``started_at``;
every statement that ends an attempt other than as ``done`` appends one entry to
``outbox_jobs.history`` (attempt, started_at, ended_at, relay, outcome, error), each field
checked against the database clock of the transactions that began and ended the attempt;
the done path writes none; the history is bounded; redrive and retry keep it; and
``outbox-relay jobs show``, ``outbox.admin.job_detail`` and ``event_trace`` show it."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import threading
import time
from typing import Any

import pytest
import sqlalchemy as sa

from outbox import Job, Outbox, PermanentError, admin
from outbox.db import queries
from outbox.db.jobs import (
    bury_job,
    bury_ready_job,
    claim_jobs,
    complete_and_claim_jobs,
    complete_jobs,
    fail_jobs,
    relay_seen,
    release_jobs,
    snooze_jobs,
)
from outbox.errors import AdminError
from outbox.ops.cli import main
from outbox.relay import transaction
from outbox.relay.maintenance import reap_expired
from outbox.relay.outcomes import Failure, Snoozed, format_error
from outbox.testing import drain, wait_for

from .helpers import db_now, expire_lease, job_row, publish_events, routed_jobs, running_relay

LEASES = {"a": 30.0}


def _claim(engine: sa.Engine, worker: str = "w1") -> tuple[Job, dt.datetime]:
    """Claim the one due job of ``a`` as ``worker``; returns it and the claim's ``now()``."""
    with engine.begin() as c:
        [job] = claim_jobs(c, LEASES, 1, worker)
        return job, db_now(c)


def _history(engine: sa.Engine, job_id: int) -> list[dict[str, Any]] | None:
    """The stored ``history`` of job ``job_id``, timestamps parsed (None: SQL NULL)."""
    raw = job_row(engine, job_id)["history"]
    if raw is None:
        return None
    return [{**e, **{k: dt.datetime.fromisoformat(e[k]) if e[k] else None for k in ("started_at", "ended_at")}}
            for e in raw]


def _entry(attempt: int, started: dt.datetime | None, ended: dt.datetime, relay: str | None, outcome: str,
           error: str | None) -> dict[str, Any]:
    return {"attempt": attempt, "started_at": started, "ended_at": ended, "relay": relay, "outcome": outcome,
            "error": error}


def _fail(engine: sa.Engine, job: Job, *, permanent: bool = False, error: str = "RuntimeError: boom",
          timed_out: bool = False) -> tuple[str, dt.datetime]:
    with engine.begin() as c:
        statuses = fail_jobs(c, [(job, Failure(0.0, permanent, error, timed_out))])
        return statuses[job.id], db_now(c)


# ---------------------------------------------------------------------- each outcome


def test_the_claim_sets_started_at_and_each_failure_appends_its_attempt(engine):
    [job_id] = routed_jobs(engine, "t", ["a"], max_attempts=3)
    job, claimed = _claim(engine, "w1")
    assert job_row(engine, job_id)["started_at"] == claimed
    assert _history(engine, job_id) is None  # nothing ended yet
    assert _fail(engine, job, error="RuntimeError: first")[0] == "ready"
    job2, claimed2 = _claim(engine, "w2")
    status, ended2 = _fail(engine, job2, error="TimeoutError: slow", timed_out=True)
    job3, claimed3 = _claim(engine, "w3")
    status3, ended3 = _fail(engine, job3, error="RuntimeError: last")
    assert (status, status3) == ("ready", "dead")
    history = _history(engine, job_id)
    assert history is not None
    assert [h["ended_at"] > h["started_at"] for h in history] == [True] * 3
    assert history[1:] == [_entry(2, claimed2, ended2, "w2", "timed out", "TimeoutError: slow"),
                           _entry(3, claimed3, ended3, "w3", "dead", "RuntimeError: last")]
    assert {k: history[0][k] for k in ("attempt", "started_at", "relay", "outcome", "error")} == {
        "attempt": 1, "started_at": claimed, "relay": "w1", "outcome": "failed", "error": "RuntimeError: first"}
    row = job_row(engine, job_id)
    assert row["started_at"] == claimed3 and row["last_error"] == "RuntimeError: last"


def test_a_permanent_error_and_a_timeout_through_the_executor(engine, settings):
    """drain runs the relay's executor and statements: PermanentError -> dead at once; a
    ``def`` handler past its timeout and an ``async def`` one cancelled at it -> timed out."""
    ob = Outbox()

    @ob.subscriber("p", consumer="perm", max_attempts=5)
    def perm(job: Job) -> None:
        raise PermanentError("no way")

    @ob.subscriber("s", consumer="slow_def", timeout=0.05, max_attempts=5)
    def slow_def(job: Job) -> None:
        if job.attempt == 1:
            time.sleep(0.3)

    @ob.subscriber("s", consumer="slow_async", timeout=0.05, max_attempts=5)
    async def slow_async(job: Job) -> None:
        if job.attempt == 1:
            await asyncio.sleep(5)

    publish_events(engine, "p", [{"n": 1}])
    publish_events(engine, "s", [{"n": 1}])
    results = drain(engine, ob, run_retries=True, settings=settings())
    by_consumer = {r.consumer: r for r in results}
    history = {c: (_history(engine, r.job_id), job_row(engine, r.job_id)) for c, r in by_consumer.items()}
    [dead] = history["perm"][0]
    assert (dead["attempt"], dead["outcome"], dead["relay"]) == (1, "dead", history["perm"][1]["locked_by"])
    assert dead["error"].startswith("PermanentError: no way") and dead["error"] == history["perm"][1]["last_error"]
    for consumer in ("slow_def", "slow_async"):
        entries, row = history[consumer]
        [timed_out] = entries  # attempt 2 is done: no entry, the row is its record
        assert (timed_out["attempt"], timed_out["outcome"]) == (1, "timed out"), consumer
        assert timed_out["error"].startswith("HandlerTimeoutError: handler timed out after 0.05 s")
        assert row["status"] == "done" and row["attempts"] == 2


def test_a_timeout_the_relays_watchdog_reports(engine, settings):
    """A ``def`` handler the relay cannot stop: its watchdog fails the attempt (``timed
    out``, the relay's worker id), the next attempt is done."""
    ob = Outbox()
    release = threading.Event()

    @ob.subscriber("t", consumer="hangs", timeout=0.3, max_attempts=3)
    def hangs(job: Job) -> None:
        if job.attempt == 1:
            release.wait(10)

    [event] = publish_events(engine, "t", [{"n": 1}])
    try:
        with running_relay(ob, settings(concurrency=2), worker_id="relay-x:1:a"):
            wait_for(lambda: _done(engine, event), timeout=30, what="the second attempt done")
            release.set()  # the hung first attempt returns; its result is dropped
    finally:
        release.set()
    [job_id] = _job_ids(engine, event)
    [entry] = _history(engine, job_id)
    assert (entry["attempt"], entry["outcome"], entry["relay"]) == (1, "timed out", "relay-x:1:a")
    assert entry["error"].startswith("HandlerTimeoutError: handler timed out after 0.3 s")
    detail = _detail(engine, job_id)
    assert [(a.attempt, a.outcome, a.relay) for a in detail.history] == [
        (1, "timed out", "relay-x:1:a"), (2, "done", "relay-x:1:a")]
    assert detail.history[1].started_at == detail.started_at and detail.history[1].ended_at == detail.finished_at


def _job_ids(engine: sa.Engine, event: int) -> list[int]:
    with engine.connect() as c:
        return list(c.execute(sa.text("SELECT id FROM outbox_jobs WHERE event_id = :e"), {"e": event}).scalars())


def _done(engine: sa.Engine, event: int) -> bool:
    with engine.connect() as c:
        return c.execute(sa.text("SELECT bool_and(status = 'done') FROM outbox_jobs WHERE event_id = :e"),
                         {"e": event}).scalar() is True


def _detail(engine: sa.Engine, job_id: int) -> admin.JobDetail:
    with engine.connect() as c:
        detail = admin.job_detail(c, job_id)
    assert detail is not None
    return detail


def test_lease_expired_through_the_reaper_then_dead_on_the_last_attempt(engine):
    [job_id] = routed_jobs(engine, "t", ["a"], max_attempts=2)
    job, claimed = _claim(engine, "w1")
    with engine.begin() as c:
        expire_lease(c, job_id)
        lease_until = job_row(c, job_id)["lease_until"]
        assert reap_expired(c).retried == 1
        reaped = db_now(c)
    note = job_row(engine, job_id)["last_error"]
    assert note.startswith("LeaseExpired: lease expired at ") and "(worker w1, fence " in note
    assert _history(engine, job_id) == [_entry(1, claimed, reaped, "w1", "lease expired", note)]
    assert lease_until < reaped
    job2, claimed2 = _claim(engine, "w2")
    with engine.begin() as c:
        expire_lease(c, job_id)
        assert reap_expired(c).dead == 1
        reaped2 = db_now(c)
    # The worker that lost its claim reports a completion: stale, nothing written.
    with engine.begin() as c:
        assert complete_jobs(c, [job, job2]) == set()
    history = _history(engine, job_id)
    assert history[1] == _entry(2, claimed2, reaped2, "w2", "dead", job_row(engine, job_id)["last_error"])
    assert len(history) == 2


def test_an_unstarted_claim_reaped_or_released_from_the_buffer_is_no_attempt(engine):
    """A claim its relay lists as buffered never started: the reaper gives the attempt back
    and the release hands it back, neither appending an entry; once unlisted, a release
    appends ``released``."""
    routed_jobs(engine, "t", ["a"], n=2)
    with engine.begin() as c:
        first, second = sorted(claim_jobs(c, LEASES, 2, "relay-b:2:x"), key=lambda j: j.id)
        relay_seen(c, "relay-b:2:x", [first.fence, second.fence])
    with engine.begin() as c:
        expire_lease(c, first.id)
        result = reap_expired(c)
    assert (result.retried, result.dead, result.unstarted) == (0, 0, 1)
    with engine.begin() as c:
        assert release_jobs(c, [second]) == {second.id}
    for job in (first, second):
        row = job_row(engine, job.id)
        assert (row["status"], row["attempts"], row["history"]) == ("ready", 0, None)
    with engine.begin() as c:
        [again] = [j for j in claim_jobs(c, LEASES, 2, "relay-b:2:x") if j.id == second.id]
        released_at = db_now(c)
    with engine.begin() as c:
        assert release_jobs(c, [again]) == {again.id}
        ended = db_now(c)
    assert _history(engine, second.id) == [_entry(1, released_at, ended, "relay-b:2:x", "released", None)]


def test_snooze_and_release_append_an_attempt_that_is_not_counted(engine):
    [job_id] = routed_jobs(engine, "t", ["a"])
    job, claimed = _claim(engine)
    with engine.begin() as c:
        assert snooze_jobs(c, [(job, Snoozed(0.0))]) == {job_id}
        snoozed = db_now(c)
    job2, claimed2 = _claim(engine, "w2")
    assert job2.attempt == 1  # the snooze gave the attempt back
    with engine.begin() as c:
        assert release_jobs(c, [job2]) == {job_id}
        released = db_now(c)
    assert _history(engine, job_id) == [_entry(1, claimed, snoozed, "w1", "snoozed", None),
                                        _entry(1, claimed2, released, "w2", "released", None)]
    row = job_row(engine, job_id)
    assert (row["attempts"], row["snoozes"], row["status"]) == (0, 1, "ready")


@pytest.mark.parametrize("how", ["complete", "fail", "snooze", "release", "reap", "transactional"])
def test_a_cancel_while_running_appends_cancelled_by_whichever_statement_ends_the_attempt(engine, how):
    [job_id] = routed_jobs(engine, "t", ["a"])
    job, claimed = _claim(engine)
    assert admin.cancel(engine, [job_id]).requested == [job_id]
    error = None
    with engine.begin() as c:
        if how == "complete":  # a lease-mode handler that returned after the cancel
            assert complete_jobs(c, [job]) == {job_id}
        elif how == "fail":
            error = "RuntimeError: failed anyway"
            assert fail_jobs(c, [(job, Failure(0.0, False, error))]) == {job_id: "cancelled"}
        elif how == "snooze":
            assert snooze_jobs(c, [(job, Snoozed(5.0))]) == {job_id}
        elif how == "release":
            assert release_jobs(c, [job]) == {job_id}
        elif how == "reap":
            expire_lease(c, job_id)
            reap_expired(c)
            error = job_row(c, job_id)["last_error"]
        else:  # job_complete found the cancel; the worker records it after the rollback
            transaction.set_limits(c, job.lease_seconds, job.fence)
            found = c.execute(queries.job_complete, {"id": job_id, "fence": job.fence, "keep_done": True}).one()
            assert (found.completed, found.cancel_requested) == (0, True)
            assert c.execute(queries.job_cancel_claimed, {"id": job_id, "fence": job.fence}).all()
        ended = db_now(c)
    assert job_row(engine, job_id)["status"] == "cancelled"
    assert _history(engine, job_id) == [_entry(1, claimed, ended, "w1", "cancelled", error)]


def test_poison_rows_are_dead_with_the_statement_s_error(engine):
    first, second = routed_jobs(engine, "t", ["a"], n=2)
    job, claimed = _claim(engine)
    assert job.id == first
    with engine.begin() as c:
        assert bury_job(c, job, "Completing failed for this job: a trigger said no")
        ended = db_now(c)
        assert bury_ready_job(c, second, "Claiming failed for this job: bad row")
        ended2 = db_now(c)
    assert _history(engine, first) == [
        _entry(1, claimed, ended, "w1", "dead", "Completing failed for this job: a trigger said no")]
    # A ready job whose claim failed: the attempt it would have been, never started.
    assert _history(engine, second) == [_entry(1, None, ended2, None, "dead", "Claiming failed for this job: bad row")]


# ---------------------------------------------------------------------- done, bounds


def test_the_done_path_writes_no_history(engine, settings):
    ids = routed_jobs(engine, "t", ["a"], n=4)
    with engine.begin() as c:
        claimed = claim_jobs(c, LEASES, 3, "w1")
        claimed_at = db_now(c)
    by_id = {j.id: j for j in claimed}
    with engine.begin() as c:
        assert complete_jobs(c, [by_id[ids[0]]]) == {ids[0]}
    with engine.begin() as c:  # the runner's round: completions and the next claim together
        done, more = complete_and_claim_jobs(c, [by_id[ids[1]]], LEASES, 5, "w1")
    assert done == {ids[1]} and [j.id for j in more] == [ids[3]]
    with engine.begin() as c:  # a transactional handler's completion
        transaction.set_limits(c, 30.0, by_id[ids[2]].fence)
        assert c.execute(queries.job_complete, {"id": ids[2], "fence": by_id[ids[2]].fence,
                                                "keep_done": True}).one().completed == 1
    for job_id in ids[:3]:
        row = job_row(engine, job_id)
        assert (row["status"], row["history"], row["started_at"]) == ("done", None, claimed_at)
        [attempt] = _detail(engine, job_id).history
        assert (attempt.attempt, attempt.outcome, attempt.relay, attempt.error) == (1, "done", "w1", None)
        assert (attempt.started_at, attempt.ended_at) == (claimed_at, row["finished_at"])
    running = _detail(engine, ids[3])
    assert [(a.outcome, a.ended_at) for a in running.history] == [("running", None)]
    # A relay running no-op handlers: every job done, not one history written.
    ob = Outbox()
    ob.subscriber("u", consumer="b")(lambda job: None)
    publish_events(engine, "u", [{"n": i} for i in range(20)])
    with running_relay(ob, settings()):
        wait_for(lambda: _count(engine, "consumer = 'b' AND status = 'done'") == 20, timeout=30, what="all done")
    assert _count(engine, "consumer = 'b' AND (history IS NOT NULL OR started_at IS NULL)") == 0


def _count(engine: sa.Engine, where: str) -> int:
    with engine.connect() as c:
        return c.execute(sa.text(f"SELECT count(*) FROM outbox_jobs WHERE {where}")).scalar_one()


def test_the_history_keeps_the_newest_entries_only(engine):
    [job_id] = routed_jobs(engine, "t", ["a"])
    ended: list[dt.datetime] = []
    for _ in range(queries.HISTORY_KEPT + 5):
        job, _claimed = _claim(engine)
        with engine.begin() as c:
            snooze_jobs(c, [(job, Snoozed(0.0))])
            ended.append(db_now(c))
    job, _claimed = _claim(engine)
    big = format_error(RuntimeError("x" * 100_000))  # bounded like last_error
    _fail(engine, job, error=big)
    history = _history(engine, job_id)
    assert len(history) == queries.HISTORY_KEPT == 100
    assert [h["ended_at"] for h in history[:-1]] == ended[-(queries.HISTORY_KEPT - 1):]
    assert history[-1]["outcome"] == "failed" and history[-1]["error"] == big and len(big) <= 8192


def test_redrive_and_retry_keep_the_history(engine, db_url, capsys):
    [job_id] = routed_jobs(engine, "t", ["a"], max_attempts=1)
    job, _ = _claim(engine)
    _fail(engine, job, error="RuntimeError: once")
    with engine.begin() as c:
        assert admin.redrive(c, [job_id]) == [job_id]
    job2, _ = _claim(engine, "w2")
    assert job2.attempt == 1
    with engine.begin() as c:
        fail_jobs(c, [(job2, Failure(3600.0, False, "RuntimeError: twice"))])
    assert job_row(engine, job_id)["status"] == "dead"  # its one attempt used again
    with engine.begin() as c:
        assert admin.redrive(c, [job_id]) == [job_id]
        c.execute(sa.text("UPDATE outbox_jobs SET run_at = now() + interval '1 hour' WHERE id = :i"), {"i": job_id})
        assert admin.retry(c, [job_id]) == [job_id]
    assert [(h["attempt"], h["relay"], h["outcome"]) for h in _history(engine, job_id)] == [
        (1, "w1", "dead"), (1, "w2", "dead")]


# -------------------------------------------------------------- jobs show, admin, trace


def _cli(db_url, *argv: str) -> list[str]:
    return [*argv, "--database-url", db_url.render_as_string(hide_password=False)]


def test_jobs_show_prints_each_attempt_and_json_gives_every_field(engine, db_url, capsys):
    [job_id] = routed_jobs(engine, "order.placed", ["a"], max_attempts=3)
    job, _ = _claim(engine, "host-1:42:ab")
    hostile = "ValueError: \x1b[2J<b>bad</b>\nTraceback (most recent call last):\n  File x\n"
    _fail(engine, job, error=hostile)
    job2, _ = _claim(engine, "host-2:7:cd")
    with engine.begin() as c:
        complete_jobs(c, [job2])
    capsys.readouterr()
    assert main(_cli(db_url, "jobs", "show", str(job_id))) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == f"job {job_id}: a, event {job.event_id} (order.placed)"
    assert lines[1].startswith("status done, attempts 2/3")
    header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("attempt"))
    first, second = lines[header + 1], lines[header + 2]
    assert first.split()[:2] == ["1", "failed"] and "host-1:42:ab" in first
    assert "ValueError: \\x1b[2J<b>bad</b>" in first and "\x1b" not in out  # control characters escaped
    assert second.split()[:2] == ["2", "done"] and "host-2:7:cd" in second
    assert main(_cli(db_url, "jobs", "show", str(job_id), "--json")) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["id"] == job_id and shown["status"] == "done" and shown["topic"] == "order.placed"
    assert [(a["attempt"], a["outcome"], a["relay"], a["error"]) for a in shown["history"]] == [
        (1, "failed", "host-1:42:ab", hostile), (2, "done", "host-2:7:cd", None)]
    assert shown["history"][1]["started_at"] == shown["started_at"]
    assert shown["history"][1]["ended_at"] == shown["finished_at"]
    assert main(_cli(db_url, "jobs", "show", "999999")) == 1
    assert "no job 999999" in capsys.readouterr().err
    assert main(_cli(db_url, "jobs", "show")) == 2
    assert "jobs show: name the job" in capsys.readouterr().err
    assert main(_cli(db_url, "jobs", "show", str(job_id), "--consumer", "a")) == 2
    assert "takes --json only, not --consumer" in capsys.readouterr().err


def test_jobs_show_of_a_job_never_attempted(engine, db_url, capsys):
    [job_id] = routed_jobs(engine, "t", ["a"])
    capsys.readouterr()
    assert main(_cli(db_url, "jobs", "show", str(job_id))) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "no attempt yet"


def test_the_event_trace_gives_each_job_its_attempts(engine):
    ids = routed_jobs(engine, "t", ["a", "b"])
    with engine.begin() as c:
        [job] = claim_jobs(c, {"a": 30.0}, 1, "w1")
        fail_jobs(c, [(job, Failure(0.0, True, "KeyError: 'vat'"))])
    with engine.connect() as c:
        trace = admin.event_trace(c, job.event_id)
        assert admin.job_detail(c, 10**12) is None
        with pytest.raises(AdminError, match="not a job id"):
            admin.job_detail(c, 0)
    assert trace is not None
    by_consumer = {j.consumer: j for j in trace.jobs}
    assert set(by_consumer) == {"a", "b"} and {j.id for j in trace.jobs} == set(ids)
    [dead] = by_consumer["a"].history
    assert (dead.attempt, dead.outcome, dead.relay, dead.error) == (1, "dead", "w1", "KeyError: 'vat'")
    assert dead.started_at == by_consumer["a"].started_at and dead.ended_at == by_consumer["a"].finished_at
    assert by_consumer["b"].history == [] and by_consumer["b"].started_at is None
    assert admin.as_dict(trace)["jobs"][0]["history"][0]["outcome"] == "dead"
