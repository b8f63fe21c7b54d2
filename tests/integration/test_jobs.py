"""Jobs: claim, heartbeat, fenced finish, reaper, redrive, prune and last_error, driven
through the named statements on a real PostgreSQL; the database clock is the reference."""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import threading

import pytest
import sqlalchemy as sa

from outbox import Job, Outbox, PermanentError
from outbox.admin import redrive
from outbox.db import queries
from outbox.db.jobs import claim_jobs, complete_and_claim_jobs, complete_jobs, fail_jobs, heartbeat_jobs, release_jobs
from outbox.db.retention import prune
from outbox.relay.maintenance import reap_expired
from outbox.relay.outcomes import MAX_ERROR_CHARS, Failure, format_error
from outbox.relay.router import route_all
from outbox.testing import wait_for

from .helpers import db_now, expire_lease, job_row, publish_events, routed_jobs, running_relay, subscribe

LEASES = {"a": 30.0}


def _claim(engine: sa.Engine, leases: dict[str, float] = LEASES, limit: int = 10, worker: str = "w1") -> list[Job]:
    with engine.begin() as conn:
        return claim_jobs(conn, leases, limit, worker)


def _status(engine: sa.Engine) -> dict[int, str]:
    with engine.connect() as c:
        return dict(c.execute(sa.text("SELECT id, status FROM outbox_jobs")).all())


def _reap(engine: sa.Engine, *job_ids: int):
    """Expire the leases of ``job_ids`` and run the reaper, in one transaction (so no
    heartbeat can renew the lease in between)."""
    with engine.begin() as conn:
        for job_id in job_ids:
            expire_lease(conn, job_id)
        return reap_expired(conn)


def _lock_timeout(conn: sa.Connection) -> None:
    conn.execute(sa.text("SET LOCAL lock_timeout = '3s'"))


# ---------------------------------------------------------------------------- claim


def test_claim_sets_running_attempt_fence_and_lease_from_the_database_clock(engine):
    ids = routed_jobs(engine, "order.placed", ["a"], n=3, max_attempts=4)
    with engine.begin() as conn:
        jobs = claim_jobs(conn, {"a": 2.5}, 10, "worker-1")
        now = db_now(conn)
        seq = conn.execute(sa.text("SELECT last_value FROM outbox_fence_seq")).scalar_one()
    assert sorted(j.id for j in jobs) == ids
    fences = [j.fence for j in jobs]
    assert len(set(fences)) == 3 and max(fences) == seq and min(fences) >= 1
    for job in jobs:
        row = job_row(engine, job.id)
        assert row["status"] == "running"
        assert row["attempts"] == 1 == job.attempt
        assert row["fence"] == job.fence
        assert row["lease_until"] == now + dt.timedelta(seconds=2.5)
        assert row["locked_by"] == "worker-1"
        assert (job.consumer, job.topic, job.max_attempts, job.lease_seconds) == ("a", "order.placed", 4, 2.5)
        assert job.payload == {"n": job.event_id - min(j.event_id for j in jobs)}
        assert job.idempotency_key == f"a:{job.event_id}"

    # Fences come from one global sequence: a new job's claim and a re-claim of an old job
    # both get a fence above every fence handed out before.
    more = routed_jobs(engine, "order.placed", ["a"], n=1)
    [new] = _claim(engine, {"a": 30.0})
    assert new.id == more[-1] and new.fence > max(fences)
    assert _reap(engine, jobs[0].id).retried == 1
    [again] = _claim(engine, {"a": 30.0})
    assert again.id == jobs[0].id and again.attempt == 2 and again.fence > new.fence


def test_concurrent_claimers_never_get_the_same_job(engine):
    routed_jobs(engine, "t", ["a"], n=300)
    claimed: list[list[int]] = [[] for _ in range(4)]
    start = threading.Barrier(4)

    def claimer(n: int) -> None:
        start.wait()
        while True:
            jobs = _claim(engine, limit=7, worker=f"w{n}")
            if not jobs:
                return
            claimed[n].extend(j.id for j in jobs)

    threads = [threading.Thread(target=claimer, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    every = [i for c in claimed for i in c]
    assert len(every) == len(set(every)) == 300
    assert sum(1 for c in claimed if c) >= 2


def test_claim_skips_rows_locked_by_another_claimer(engine):
    ids = routed_jobs(engine, "t", ["a"], n=6)
    with engine.connect() as one, engine.connect() as two:
        with one.begin():
            first = claim_jobs(one, LEASES, 3, "one")  # locks three rows, uncommitted
            with two.begin():
                _lock_timeout(two)  # waiting instead of skipping would fail here
                second = claim_jobs(two, LEASES, 10, "two")
    assert sorted(j.id for j in first + second) == ids
    assert not {j.id for j in first} & {j.id for j in second}


def test_claim_takes_only_the_consumers_asked_for_and_only_due_jobs(engine):
    routed_jobs(engine, "t", ["a", "b", "c"], n=4)
    with engine.begin() as c:
        future = c.execute(sa.text(
            "UPDATE outbox_jobs SET run_at = now() + interval '1 hour' "
            "WHERE id = (SELECT min(id) FROM outbox_jobs WHERE consumer = 'a') RETURNING id")).scalar_one()
    jobs = _claim(engine, {"a": 30.0, "b": 30.0}, limit=100)
    assert sorted(j.consumer for j in jobs) == ["a"] * 3 + ["b"] * 4
    assert future not in {j.id for j in jobs}
    status = _status(engine)
    assert status[future] == "ready"
    with engine.connect() as c:
        assert c.execute(sa.text("SELECT count(*) FROM outbox_jobs WHERE consumer = 'c' AND status = 'ready'")).scalar() == 4
    with engine.begin() as c:
        c.execute(sa.text("UPDATE outbox_jobs SET run_at = now() - interval '1 second' WHERE id = :id"), {"id": future})
    assert [j.id for j in _claim(engine, {"a": 30.0})] == [future]


# ------------------------------------------------------------------------ heartbeat


def test_heartbeat_extends_the_lease_and_reports_only_owned_jobs(engine):
    routed_jobs(engine, "t", ["a"], n=3)
    owned, stale, finished = _claim(engine, {"a": 5.0})
    _reap(engine, stale.id)  # back to ready: same fence, no longer running
    [reclaimed] = _claim(engine, {"a": 5.0})
    assert reclaimed.id == stale.id and reclaimed.fence > stale.fence
    with engine.begin() as c:
        assert complete_jobs(c, [finished]) == {finished.id}

    before = {j.id: job_row(engine, j.id) for j in (stale, finished)}
    with engine.begin() as conn:
        now = db_now(conn)
        alive = heartbeat_jobs(conn, [owned, stale, finished, owned.replace(fence=owned.fence - 1)])
    assert alive == {owned.fence}  # the claims still owned, by fence
    assert job_row(engine, owned.id)["lease_until"] == now + dt.timedelta(seconds=5)
    # The stale fence (now the re-claimed job's) and the done job are untouched.
    assert job_row(engine, stale.id) == before[stale.id]
    assert job_row(engine, finished.id) == before[finished.id]
    with engine.begin() as conn:
        # The old and the new claim of one job: only the new one is owned.
        assert heartbeat_jobs(conn, [stale, reclaimed]) == {reclaimed.fence}


# -------------------------------------------------------------------- fenced finish


@pytest.mark.parametrize("how", ["reclaimed", "reaped", "done"])
def test_complete_fail_release_with_a_stale_fence_change_nothing(engine, how):
    [job_id] = routed_jobs(engine, "t", ["a"], n=1, max_attempts=5)
    [old] = _claim(engine)
    if how in ("reclaimed", "reaped"):
        _reap(engine, job_id)
        if how == "reclaimed":
            [new] = _claim(engine)
            assert new.fence > old.fence
    else:
        with engine.begin() as c:
            complete_jobs(c, [old])
    before = job_row(engine, job_id)
    failure = Failure(delay=1.0, permanent=False, error="late")
    with engine.begin() as conn:
        assert complete_jobs(conn, [old]) == set()
        assert fail_jobs(conn, [(old, failure)]) == {}
        assert fail_jobs(conn, [(old, dataclasses.replace(failure, permanent=True))]) == {}
        assert release_jobs(conn, [old]) == set()
        assert heartbeat_jobs(conn, [old]) == set()
    assert job_row(engine, job_id) == before


def test_completion_deletes_the_job_when_done_jobs_are_not_kept(engine):
    """``keep_done=False`` (``retention_done = 0``): a fenced completion deletes the job's
    row in the same statement, by both completion statements; a job an operator asked to
    cancel while it ran is kept, ``cancelled``; every later report of a deleted job's claim
    (complete, fail, release, heartbeat) changes nothing; the event, with no job left, is
    pruned as a finished one."""
    ids = routed_jobs(engine, "t", ["a"], n=4, max_attempts=5)
    claimed = {j.id: j for j in _claim(engine)}
    with engine.begin() as c:
        c.execute(sa.text("UPDATE outbox_jobs SET cancel_requested = true WHERE id = :id"), {"id": ids[1]})
    rest = job_row(engine, ids[3])
    with engine.begin() as conn:
        assert complete_jobs(conn, [claimed[i] for i in ids[:2]], keep_done=False) == set(ids[:2])
        done, more = complete_and_claim_jobs(conn, [claimed[ids[2]]], LEASES, 5, "w1", keep_done=False)
    assert (done, more) == ({ids[2]}, [])
    assert _status(engine) == {ids[1]: "cancelled", ids[3]: "running"}
    assert job_row(engine, ids[1])["finished_at"] is not None
    assert job_row(engine, ids[3]) == rest
    gone = claimed[ids[0]]
    with engine.begin() as conn:
        assert complete_jobs(conn, [gone], keep_done=False) == set()
        assert complete_jobs(conn, [gone]) == set()
        assert fail_jobs(conn, [(gone, Failure(delay=0, permanent=True, error="late"))]) == {}
        assert release_jobs(conn, [gone]) == set()
        assert heartbeat_jobs(conn, [gone]) == set()
    assert _status(engine) == {ids[1]: "cancelled", ids[3]: "running"}
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE outbox_events SET routed_at = now() - interval '2 hours'"))
        assert prune(conn, done_older_than=3600, events_older_than=3600) == (0, 2)  # ids[0] and ids[2]'s events


def test_fail_retries_after_the_delay_then_dead_letters_at_max_attempts(engine):
    [job_id] = routed_jobs(engine, "t", ["a"], n=1, max_attempts=2)
    [job] = _claim(engine)
    with engine.begin() as conn:
        now = db_now(conn)
        assert fail_jobs(conn, [(job, Failure(delay=12.5, permanent=False, error="boom 1"))]) == {job_id: "ready"}
    row = job_row(engine, job_id)
    assert row["status"] == "ready" and row["attempts"] == 1
    assert row["run_at"] == now + dt.timedelta(seconds=12.5)
    assert row["lease_until"] is None and row["finished_at"] is None and row["last_error"] == "boom 1"
    assert _claim(engine) == []  # not due yet

    with engine.begin() as c:
        c.execute(sa.text("UPDATE outbox_jobs SET run_at = now() WHERE id = :id"), {"id": job_id})
    [job] = _claim(engine)
    assert job.attempt == 2
    run_at = job_row(engine, job_id)["run_at"]
    with engine.begin() as conn:
        now = db_now(conn)
        assert fail_jobs(conn, [(job, Failure(delay=12.5, permanent=False, error="boom 2"))]) == {job_id: "dead"}
    row = job_row(engine, job_id)
    assert (row["status"], row["attempts"], row["last_error"]) == ("dead", 2, "boom 2")
    assert row["finished_at"] == now and row["run_at"] == run_at and row["lease_until"] is None
    assert _claim(engine) == []


def test_permanent_failure_is_dead_at_once(engine):
    [job_id] = routed_jobs(engine, "t", ["a"], n=1, max_attempts=5)
    [job] = _claim(engine)
    with engine.begin() as conn:
        assert fail_jobs(conn, [(job, Failure(delay=1, permanent=True, error="no"))]) == {job_id: "dead"}
    assert job_row(engine, job_id)["attempts"] == 1


def test_permanent_error_in_a_handler_dead_letters_via_the_relay(engine, settings, caplog):
    caplog.set_level(logging.INFO)
    ob = Outbox()
    calls = []

    @ob.subscriber("t", consumer="p", max_attempts=5)
    def handler(job: Job) -> None:
        calls.append(job.attempt)
        raise PermanentError("order 7 does not exist")

    publish_events(engine, "t", [{"n": 1}])
    with running_relay(ob, settings()):
        wait_for(lambda: _status(engine) and set(_status(engine).values()) == {"dead"}, what="dead job")
    [row] = _rows(engine)
    assert row["attempts"] == 1 and calls == [1]
    assert row["last_error"].startswith("PermanentError: order 7 does not exist")
    assert any("dead-lettered job" in r.getMessage() for r in caplog.records)


def _rows(engine: sa.Engine) -> list[dict]:
    with engine.connect() as c:
        return [dict(r) for r in c.execute(sa.text("SELECT * FROM outbox_jobs ORDER BY id")).mappings()]


# --------------------------------------------------------------------------- reaper


def test_reaper_returns_expired_leases_or_dead_letters_the_last_attempt(engine):
    routed_jobs(engine, "t", ["a"], n=3, max_attempts=1)
    with engine.begin() as c:  # the first job gets a second attempt allowed
        c.execute(sa.text("UPDATE outbox_jobs SET max_attempts = 2 WHERE id = (SELECT min(id) FROM outbox_jobs)"))
    retry, last, healthy = _claim(engine)
    with engine.begin() as conn:
        expire_lease(conn, retry.id)
        expire_lease(conn, last.id)
        now = db_now(conn)
        result = reap_expired(conn)
    assert (result.retried, result.dead) == (1, 1)

    r = job_row(engine, retry.id)
    assert (r["status"], r["attempts"], r["fence"], r["lease_until"], r["finished_at"]) == (
        "ready", 1, retry.fence, None, None)
    assert r["run_at"] == now
    assert "lease expired" in r["last_error"] and "LeaseExpired" in r["last_error"]
    d = job_row(engine, last.id)
    assert (d["status"], d["attempts"], d["finished_at"], d["lease_until"]) == ("dead", 1, now, None)
    assert "lease expired" in d["last_error"] and "attempt 1 of 1" in d["last_error"]
    assert job_row(engine, healthy.id)["status"] == "running"
    with engine.begin() as conn:
        assert reap_expired(conn) == type(result)(0, 0)


def test_reaper_skips_a_job_whose_completion_holds_the_row_lock(engine):
    [job_id] = routed_jobs(engine, "t", ["a"], n=1, max_attempts=1)
    [job] = _claim(engine)
    with engine.begin() as c:
        expire_lease(c, job_id)  # lease over, but the worker is finishing right now
    with engine.connect() as finisher, engine.connect() as reaper:
        with finisher.begin():
            assert complete_jobs(finisher, [job]) == {job_id}  # row locked, not committed
            with reaper.begin():
                _lock_timeout(reaper)  # a reaper that waited would time out here
                result = reap_expired(reaper)
            assert (result.retried, result.dead) == (0, 0)
    row = job_row(engine, job_id)
    assert row["status"] == "done" and row["last_error"] is None
    with engine.begin() as conn:
        assert reap_expired(conn).dead == 0


# ------------------------------------------------------------- redrive and pruning


def test_redrive_puts_dead_jobs_back_with_a_fresh_budget(engine):
    ids = routed_jobs(engine, "t", ["a"], n=3, max_attempts=1)
    jobs = _claim(engine)
    with engine.begin() as conn:
        fail_jobs(conn, [(j, Failure(0.0, False, "x")) for j in jobs[:2]])
        complete_jobs(conn, jobs[2:])
    with engine.begin() as conn:
        assert sorted(redrive(conn, ids=[ids[0], ids[2]])) == [ids[0]]  # the done one is left alone
        assert redrive(conn, consumer="nobody") == []
    row = job_row(engine, ids[0])
    assert (row["status"], row["attempts"], row["finished_at"]) == ("ready", 0, None)
    assert job_row(engine, ids[1])["status"] == "dead"
    assert job_row(engine, ids[2])["status"] == "done"
    with engine.begin() as conn:
        assert redrive(conn, every=True) == [ids[1]]
    assert sorted(j.id for j in _claim(engine)) == ids[:2]


def test_prune_deletes_old_done_jobs_and_finished_events_only(engine):
    subscribe(engine, "t", ["a"])
    ev = publish_events(engine, "t", [{"n": i} for i in range(6)])
    lonely_old, lonely_new = publish_events(engine, "nobody", [{}, {}])
    route_all(engine)
    jobs = {j.event_id: j for j in _claim(engine, limit=10)}
    with engine.begin() as conn:
        complete_jobs(conn, [jobs[ev[0]], jobs[ev[1]]])       # ev0 old done, ev1 recent done
        fail_jobs(conn, [(jobs[ev[2]], Failure(0, True, "x"))])  # dead
        fail_jobs(conn, [(jobs[ev[3]], Failure(0, False, "x"))])  # ready again
        # ev4 stays running; ev5's job is released to ready
        release_jobs(conn, [jobs[ev[5]]])
        conn.execute(sa.text("UPDATE outbox_jobs SET finished_at = now() - interval '2 hours', "
                             "updated_at = now() - interval '2 hours', created_at = now() - interval '2 hours'"
                             " WHERE event_id <> :recent"), {"recent": ev[1]})
        conn.execute(sa.text("UPDATE outbox_jobs SET finished_at = NULL WHERE status <> 'done' AND status <> 'dead'"))
        conn.execute(sa.text("UPDATE outbox_events SET routed_at = now() - interval '2 hours', "
                             "created_at = now() - interval '2 hours' WHERE id <> :new"), {"new": lonely_new})
    with engine.begin() as conn:
        assert prune(conn, done_older_than=3600, events_older_than=3600) == (1, 2)  # ev0's job; ev0 + lonely_old
    with engine.connect() as c:
        left_jobs = set(c.execute(sa.text("SELECT event_id FROM outbox_jobs")).scalars())
        left_events = set(c.execute(sa.text("SELECT id FROM outbox_events")).scalars())
    assert left_jobs == {ev[1], ev[2], ev[3], ev[4], ev[5]}
    assert left_events == {ev[1], ev[2], ev[3], ev[4], ev[5], lonely_new}
    with engine.begin() as conn:
        assert prune(conn, 3600, 3600) == (0, 0)


# ------------------------------------------------------------ idempotency and errors


def test_idempotency_key_is_stable_across_retries(engine):
    ids = routed_jobs(engine, "t", ["a", "b"], n=1, max_attempts=3)
    first = {j.consumer: j for j in _claim(engine, {"a": 30.0, "b": 30.0})}
    with engine.begin() as conn:
        fail_jobs(conn, [(j, Failure(0.0, False, "x")) for j in first.values()])
    second = {j.consumer: j for j in _claim(engine, {"a": 30.0, "b": 30.0})}
    _reap(engine, *ids)
    third = {j.consumer: j for j in _claim(engine, {"a": 30.0, "b": 30.0})}
    for c in "ab":
        assert [first[c].attempt, second[c].attempt, third[c].attempt] == [1, 2, 3]
        assert first[c].idempotency_key == second[c].idempotency_key == third[c].idempotency_key
        assert len({first[c].fence, second[c].fence, third[c].fence}) == 3
    assert first["a"].idempotency_key != first["b"].idempotency_key


class _BadStr(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no text for you")


NASTY = {
    "huge": lambda: ValueError("x" * 5_000_000),
    "nul": lambda: ValueError("before\x00after\x00"),
    "surrogate": lambda: ValueError("half a pair: \ud800 and \udfff"),
    "bad_str": lambda: _BadStr(),
    "huge_nul_surrogate": lambda: RuntimeError(("\x00\ud83d" + "é" * 10) * 300_000),
}


def test_last_error_is_bounded_and_stored_for_any_exception_text(engine, settings):
    ob = Outbox()
    for name, make in NASTY.items():
        def handler(job: Job, make=make) -> None:
            raise make()

        ob.subscriber("t", consumer=name, max_attempts=1)(handler)
    publish_events(engine, "t", [{"n": 1}])
    with running_relay(ob, settings()):
        wait_for(lambda: list(_status(engine).values()).count("dead") == len(NASTY), what="all dead")
    errors = {r["consumer"]: r["last_error"] for r in _rows(engine)}
    for name, text in errors.items():
        assert 0 < len(text) <= MAX_ERROR_CHARS, name
        assert "\x00" not in text
        text.encode("utf-8")  # valid text
        assert "Traceback" not in text.splitlines()[0]
    assert errors["huge"].startswith("ValueError: xxxx") and "truncated" in errors["huge"]
    assert errors["nul"].startswith("ValueError: before")
    assert "after" in errors["nul"]
    assert errors["surrogate"].startswith("ValueError: half a pair:")
    assert errors["bad_str"].startswith("_BadStr: <str() raised RuntimeError>")
    assert errors["huge_nul_surrogate"].startswith("RuntimeError: ")
    # The traceback (innermost frames) comes along: it names the handler's raise.
    assert "raise make()" in errors["nul"]


def test_format_error_is_bounded_for_every_limit():
    for make in NASTY.values():
        try:
            raise make()
        except Exception as exc:  # noqa: BLE001
            for limit in (100, 1000, MAX_ERROR_CHARS):
                text = format_error(exc, limit)
                assert len(text) <= limit and "\x00" not in text
                text.encode("utf-8")


def test_handler_returning_a_value_logs_a_warning_and_is_done(engine, settings, caplog):
    ob = Outbox()

    @ob.subscriber("t", consumer="returns")
    def handler(job: Job) -> str:
        return "something"

    publish_events(engine, "t", [{"n": 1}, {"n": 2}])
    with running_relay(ob, settings()):
        wait_for(lambda: set(_status(engine).values()) == {"done"} and len(_status(engine)) == 2, what="done")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "returned str" in r.getMessage()]
    assert len(warnings) == 1 and "returns" in warnings[0].getMessage()


# --------------------------------------------------------------------- plan guard


def _plan(conn: sa.Connection, statement: sa.TextClause, params: dict) -> str:
    rows = conn.execute(sa.text("EXPLAIN " + statement.text), params).scalars()
    return "\n".join(rows)


def test_claim_and_route_use_their_partial_indexes_with_many_done_rows(engine):
    subscribe(engine, "t", ["a", "b"])
    with engine.begin() as c:
        c.execute(sa.text("""
            INSERT INTO outbox_events (topic, payload, created_at, routed_at)
            SELECT 't', jsonb_build_object('n', g), now() - interval '1 day', now() - interval '1 day'
            FROM generate_series(1, 200000) g
        """))
        c.execute(sa.text("""
            INSERT INTO outbox_jobs (event_id, consumer, status, attempts, max_attempts, fence, finished_at)
            SELECT id, 'a', 'done', 1, 5, id, now() - interval '1 hour' FROM outbox_events
        """))
    publish_events(engine, "t", [{"n": i} for i in range(5)])  # a few unrouted
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
        c.execute(sa.text("ANALYZE outbox_events"))
        c.execute(sa.text("ANALYZE outbox_jobs"))
    with engine.connect() as conn:
        route_plan = _plan(conn, queries.in_schema("public").event_route_many, {"limit": 500, "skip": [], "only": None, "channel": "outbox_jobs", "after": 0})
        conn.rollback()
        claim_plan = _plan(conn, queries.in_schema("public").job_claim_many, {
            "consumers": ["a", "b"], "leases": [30.0, 30.0], "limit": 50, "worker": "w"})
    assert "ix_outbox_events_unrouted" in route_plan, route_plan
    assert "ix_outbox_jobs_ready" in claim_plan, claim_plan
    for plan in (route_plan, claim_plan):
        assert "Seq Scan on outbox_jobs" not in plan, plan
        assert "Seq Scan on outbox_events" not in plan, plan


def test_release_hands_the_job_back_without_counting_the_attempt(engine):
    [job_id] = routed_jobs(engine, "t", ["a"], n=1)
    due = job_row(engine, job_id)["run_at"]
    [job] = _claim(engine)
    with engine.begin() as conn:
        assert release_jobs(conn, [job]) == {job_id}
    row = job_row(engine, job_id)
    # Due as before: it keeps its place in the queue rather than going behind newer jobs.
    assert (row["status"], row["attempts"], row["run_at"], row["lease_until"]) == ("ready", 0, due, None)
    [again] = _claim(engine)
    assert again.attempt == 1 and again.fence > job.fence
