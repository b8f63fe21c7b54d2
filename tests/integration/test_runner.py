"""The job runner's dispatcher: completions and the next claim in one round trip and one
transaction, the prefetch buffer, and its own connection's recovery. Real PostgreSQL
throughout."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa

from outbox import Job, Outbox
from outbox.db import jobs
from outbox.db.jobs import claim_jobs, complete_and_claim_after, complete_and_claim_jobs, complete_jobs
from outbox.relay.relay import Relay
from outbox.relay.router import route_all
from outbox.testing import wait_for

from .helpers import job_row, publish_events, routed_jobs, running_relay, subscribe

TIMEOUT = 15
LEASES = {"a": 30.0}


def _statuses(engine: sa.Engine) -> dict[int, str]:
    with engine.connect() as c:
        return dict(c.execute(sa.text("SELECT id, status FROM outbox_jobs ORDER BY id")).all())


def _psycopg(engine: sa.Engine) -> psycopg.Connection:
    url = engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    return psycopg.connect(url, autocommit=True)


def _blocking_app() -> tuple[Outbox, threading.Event, list[Job]]:
    """Consumer ``a`` on ``t`` whose handler records its job and blocks until the gate opens."""
    ob = Outbox()
    gate = threading.Event()
    running: list[Job] = []

    @ob.subscriber("t", consumer="a")
    def handler(job: Job) -> None:
        running.append(job)
        gate.wait(TIMEOUT)

    return ob, gate, running


# ------------------------------------------------------------- the statement


def test_complete_and_claim_completes_fenced_and_claims_in_claim_order(engine):
    ids = routed_jobs(engine, "t", ["a"], n=6)
    with engine.begin() as conn:
        first = claim_jobs(conn, LEASES, 2, "w1")
    assert [j.id for j in first] == ids[:2]
    with _psycopg(engine) as conn:  # the runner's path: a bare psycopg connection, autocommit
        completed, claimed = complete_and_claim_jobs(conn, first, LEASES, 3, "w1")
    assert completed == set(ids[:2])
    assert [j.id for j in claimed] == ids[2:5]
    assert all(j.fence > max(f.fence for f in first) for j in claimed)
    assert len({j.fence for j in claimed}) == 3
    assert [j.attempt for j in claimed] == [1, 1, 1] and all(j.payload == {"n": i} for i, j in
                                                             zip(range(2, 5), claimed))
    assert _statuses(engine) == {ids[0]: "done", ids[1]: "done", ids[2]: "running", ids[3]: "running",
                                 ids[4]: "running", ids[5]: "ready"}
    for job in claimed:
        row = job_row(engine, job.id)
        assert (row["fence"], row["locked_by"], row["attempts"]) == (job.fence, "w1", 1)


def test_complete_and_claim_holds_no_claimed_row_while_it_waits_for_a_completion_lock(engine):
    """The combined statement waits only in its completion (locked rows in id order) and must
    take all of those locks before it locks a row to claim: otherwise it holds a claimed row
    while it waits, and a session that holds the awaited row and then wants the claimed one
    (a heartbeat whose older snapshot still saw that row running) deadlocks with it. Here the
    session holds the job being completed and then takes the ready job NOWAIT while the
    statement waits; the statement then completes and claims it."""
    ids = routed_jobs(engine, "t", ["a"], n=2)
    with engine.begin() as conn:
        [running] = claim_jobs(conn, LEASES, 1, "w1")
    assert running.id == ids[0]
    result: dict[str, Any] = {}
    with _psycopg(engine) as holder, _psycopg(engine) as dispatcher:
        holder.execute("BEGIN")
        holder.execute("SELECT 1 FROM outbox_jobs WHERE id = %s FOR UPDATE", (running.id,))
        pid = dispatcher.info.backend_pid

        def combined() -> None:
            result["out"] = complete_and_claim_jobs(dispatcher, [running], LEASES, 5, "w1")

        thread = threading.Thread(target=combined)
        thread.start()
        with _psycopg(engine) as probe:
            wait_for(lambda: probe.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s",
                                           (pid,)).fetchone()[0] == "Lock", timeout=TIMEOUT,
                     what="the combined statement waiting for the completion's lock")
        # The ready job must not be locked by the waiting statement.
        holder.execute("SELECT 1 FROM outbox_jobs WHERE id = %s FOR UPDATE NOWAIT", (ids[1],))
        holder.execute("COMMIT")
        thread.join(TIMEOUT)
    completed, claimed = result["out"]
    assert completed == {ids[0]} and [j.id for j in claimed] == [ids[1]]


def test_complete_and_claim_with_a_stale_fence_changes_nothing_but_still_claims(engine):
    ids = routed_jobs(engine, "t", ["a"], n=3)
    with engine.begin() as conn:
        [old] = claim_jobs(conn, LEASES, 1, "w1")
        complete_jobs(conn, [old])
    before = job_row(engine, old.id)
    with engine.begin() as conn:  # the SQLAlchemy path runs the same statement
        completed, claimed = complete_and_claim_jobs(conn, [old], LEASES, 5, "w2")
    assert completed == set()
    assert job_row(engine, old.id) == before
    assert [j.id for j in claimed] == ids[1:]


def test_complete_and_claim_never_claims_the_rows_it_completes(engine):
    """Both halves run on one snapshot: a job completed by the statement was running in it,
    so the claim cannot take it, even when it asks for every job there is."""
    ids = routed_jobs(engine, "t", ["a"], n=4)
    with engine.begin() as conn:
        held = claim_jobs(conn, LEASES, 4, "w1")
    with _psycopg(engine) as conn:
        completed, claimed = complete_and_claim_jobs(conn, held, LEASES, 100, "w1")
    assert completed == set(ids) and claimed == []
    assert set(_statuses(engine).values()) == {"done"}


@pytest.mark.parametrize("pipeline", [True, False], ids=["pipelined", "plain"])
def test_complete_and_claim_is_one_transaction(engine, monkeypatch, pipeline):
    """The completion and the claim are two statements, sent in one round trip (pipeline mode)
    or, without it, one by one in a transaction: either way a claim that fails with a data
    error (here a claim-order key that is no timestamp) leaves the completion unwritten, as the
    one statement they replace did, so the poison handling may run both again by halves."""
    if pipeline and not jobs.PIPELINE:
        pytest.skip("this libpq has no pipeline mode")
    monkeypatch.setattr(jobs, "PIPELINE", pipeline)
    ids = routed_jobs(engine, "t", ["a"], n=3)
    with engine.begin() as conn:
        [held] = claim_jobs(conn, LEASES, 1, "w1")
    with _psycopg(engine) as conn:
        with pytest.raises(psycopg.errors.DataError):
            complete_and_claim_after(conn, [held], LEASES, 2, "w1", (0, "not a time", 0))
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        assert _statuses(engine) == {ids[0]: "running", ids[1]: "ready", ids[2]: "ready"}
        completed, claimed, last = complete_and_claim_after(conn, [held], LEASES, 2, "w1", None)
    assert completed == {held.id} and [j.id for j in claimed] == ids[1:]
    assert last is not None and last[2] == ids[2]
    assert _statuses(engine) == {ids[0]: "done", ids[1]: "running", ids[2]: "running"}


# ------------------------------------------------------------- prefetch buffer


def test_the_rounds_completion_is_planned_for_its_parameters_every_time(engine):
    """Many rounds on one connection: psycopg prepares the claim (from its fifth run) but never
    the completion, whose generic plan would rescan every (id, fence) pair once per job (a
    nested loop: 165 ms against 6 ms for a batch of 500)."""
    ids = routed_jobs(engine, "t", ["a"], n=8)
    with _psycopg(engine) as conn:
        done: list[Job] = []
        for _ in range(8):
            _, done = complete_and_claim_jobs(conn, done, LEASES, 1, "w1")
        prepared = [r[0] for r in conn.execute("SELECT statement FROM pg_prepared_statements").fetchall()]
    assert _statuses(engine) == {**{i: "done" for i in ids[:7]}, ids[7]: "running"}
    assert any("outbox_relays" in text for text in prepared), prepared  # the claim lists the buffer
    assert not any("deleted AS" in text for text in prepared), prepared  # the completion: never


@pytest.mark.parametrize("dispatchers", [1, 2])
def test_runner_holds_at_most_concurrency_plus_prefetch_and_releases_the_buffer_on_stop(engine, settings, dispatchers):
    """With two dispatchers as with one: their claims share the room (each counts what the
    other's claim in flight asked for), so the relay holds 7 claims, not 7 each."""
    ob, gate, running = _blocking_app()
    publish_events(engine, "t", [{"n": i} for i in range(40)])
    relay = Relay(ob, settings(concurrency=2, prefetch=5, claim_batch=50, shutdown_grace=0.5, dispatchers=dispatchers))
    relay.start()
    try:
        wait_for(lambda: len(running) == 2, timeout=TIMEOUT, what="both workers busy")
        wait_for(lambda: list(_statuses(engine).values()).count("running") == 7, timeout=TIMEOUT,
                 what="2 running + 5 buffered claims")
        assert relay.runner.in_flight() == 7
        with pytest.raises(AssertionError):  # no claim beyond the room comes back (polls every 0.2 s)
            wait_for(lambda: list(_statuses(engine).values()).count("running") > 7, timeout=0.6, what="an over-claim")
        with engine.connect() as c:
            buffered = list(c.execute(sa.text(
                "SELECT id FROM outbox_jobs WHERE status = 'running' AND id <> ALL(:ids)"),
                {"ids": [j.id for j in running]}).scalars())
    finally:
        relay.stop()  # grace 0.5 s: the two running handlers are still blocked
        gate.set()
    assert len(buffered) == 5
    # Every claim still held at shutdown went back at once, attempt not counted.
    for job_id in buffered + [j.id for j in running]:
        row = job_row(engine, job_id)
        assert (row["status"], row["attempts"], row["lease_until"]) == ("ready", 0, None), row


def test_stop_releases_the_buffer_at_once_while_handlers_still_run(engine, settings):
    ob, gate, running = _blocking_app()
    publish_events(engine, "t", [{"n": i} for i in range(10)])
    relay = Relay(ob, settings(concurrency=2, prefetch=4, shutdown_grace=TIMEOUT))
    relay.start()
    stopper = threading.Thread(target=relay.stop)
    try:
        # Both handlers started, not only claimed: a claim handed to a worker that has not
        # picked it up yet is released at once too (under load the stop came first and all
        # six were released, so "both handlers still run" did not hold).
        wait_for(lambda: list(_statuses(engine).values()).count("running") == 6 and len(running) == 2,
                 timeout=TIMEOUT, what="2 handlers running + 4 buffered claims")
        stopper.start()  # the grace period outlasts this test's waits: the handlers stay blocked
        wait_for(lambda: list(_statuses(engine).values()).count("running") == 2, timeout=TIMEOUT / 2,
                 what="the 4 buffered claims released while both handlers still run")
        assert stopper.is_alive() and len(running) == 2
        for job_id, status in _statuses(engine).items():
            if status != "running":
                assert (status, job_row(engine, job_id)["attempts"]) == ("ready", 0)
    finally:
        gate.set()
        if stopper.ident:
            stopper.join(TIMEOUT)
        else:
            relay.stop()
    assert set(_statuses(engine).values()) <= {"done", "ready"}


def test_buffered_jobs_are_heartbeated(engine, settings):
    ob = Outbox()
    gate = threading.Event()

    @ob.subscriber("t", consumer="a", lease=1.5)
    def handler(job: Job) -> None:
        gate.wait(TIMEOUT)

    publish_events(engine, "t", [{"n": i} for i in range(4)])
    with running_relay(ob, settings(concurrency=1, prefetch=3)) as relay:
        try:
            wait_for(lambda: list(_statuses(engine).values()).count("running") == 4, timeout=TIMEOUT,
                     what="1 running + 3 buffered")
            with engine.connect() as c:
                first = dict(c.execute(sa.text("SELECT id, lease_until FROM outbox_jobs")).all())

            def renewed() -> bool:
                with engine.connect() as c:
                    now = dict(c.execute(sa.text("SELECT id, lease_until FROM outbox_jobs")).all())
                return all(now[i] is not None and now[i] > first[i] for i in first)

            # Lease 1.5 s, heartbeat every 0.5 s: within 3 s every claim, buffered ones included,
            # has been renewed, and the reaper (every 0.2 s) has taken none back.
            wait_for(renewed, timeout=TIMEOUT, what="every held lease renewed")
            assert relay.stats["reaped"] == 0
            gate.set()
            wait_for(lambda: set(_statuses(engine).values()) == {"done"}, timeout=TIMEOUT, what="all done")
            with engine.connect() as c:
                attempts = set(c.execute(sa.text("SELECT attempts FROM outbox_jobs")).scalars())
            assert attempts == {1}
        finally:
            gate.set()


def test_prefetch_zero_claims_only_for_idle_workers(engine, settings):
    ob, gate, running = _blocking_app()
    publish_events(engine, "t", [{"n": i} for i in range(10)])
    with running_relay(ob, settings(concurrency=3, prefetch=0)) as relay:
        try:
            wait_for(lambda: len(running) == 3, timeout=TIMEOUT, what="three workers busy")
            relay.wake_workers.set()  # a wake-up must not make it claim past its idle workers
            wait_for(lambda: relay.runner.in_flight() == 3, timeout=TIMEOUT, what="three claims")
            assert list(_statuses(engine).values()).count("running") == 3
        finally:
            gate.set()
    wait_for(lambda: set(_statuses(engine).values()) <= {"done", "ready"}, timeout=TIMEOUT, what="settled")


# ------------------------------------------------------------- its connection


def test_dispatcher_reconnects_when_its_connection_is_terminated(engine, settings, caplog):
    caplog.set_level(logging.INFO)
    ob = Outbox()
    done: list[int] = []

    @ob.subscriber("t", consumer="a")
    def handler(job: Job) -> None:
        done.append(job.id)

    with running_relay(ob, settings(concurrency=2)):
        publish_events(engine, "t", [{"n": 1}])
        wait_for(lambda: len(done) == 1, timeout=TIMEOUT, what="first job")
        with engine.connect() as c:  # end every session of the relay, the dispatcher's included
            killed = c.execute(sa.text(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE datname = current_database() AND application_name = 'outbox-relay'")).scalar_one()
        assert killed >= 1
        publish_events(engine, "t", [{"n": i} for i in range(2, 12)])
        wait_for(lambda: list(_statuses(engine).values()) == ["done"] * 11,  # one snapshot, not two
                 timeout=TIMEOUT, what="jobs published after the kill done")
    assert len(done) == len(set(done)) == 11  # none ran twice: no completion was lost


def test_a_buffered_job_whose_lease_ran_out_is_handed_back_not_started(engine, settings, caplog):
    """A job that waited in the buffer past its lease (the process was paused, say) may
    already be someone else's: the worker does not start it; it hands it back (fenced,
    attempt not counted) and the job runs later under a new claim."""
    caplog.set_level(logging.WARNING)
    ob = Outbox()
    gate = threading.Event()
    seen: list[tuple[int, int, int]] = []  # (job id, fence, attempt) of every handler start

    @ob.subscriber("t", consumer="a")
    def handler(job: Job) -> None:
        seen.append((job.id, job.fence, job.attempt))
        if job.payload["n"] == 0:
            gate.wait(TIMEOUT)

    publish_events(engine, "t", [{"n": 0}])
    with running_relay(ob, settings(concurrency=1, prefetch=3)) as relay:
        try:
            wait_for(lambda: len(seen) == 1, timeout=TIMEOUT, what="the first job blocking the only worker")
            publish_events(engine, "t", [{"n": 1}])
            wait_for(lambda: relay.runner.in_flight() == 2, timeout=TIMEOUT, what="the second job in the buffer")
            with relay.runner.claims.lock:  # as if the process had been paused past the buffered job's lease
                [buffered] = [c for c in relay.runner.claims.inflight.values() if c.job.payload["n"] == 1]
            buffered.lease_bound = 0.0
            gate.set()
            wait_for(lambda: set(_statuses(engine).values()) == {"done"} and len(seen) == 2, timeout=TIMEOUT,
                     what="both jobs done")
        finally:
            gate.set()
    second = [s for s in seen if s[0] == buffered.id]
    assert len(second) == 1 and second[0][1] > buffered.fence  # never started under the stale claim
    assert second[0][2] == 1  # the hand-back did not count an attempt
    assert any(r.getMessage().startswith(f"1 job (a 1; id {buffered.id}) not started") for r in caplog.records)


# ------------------------------------------------------------- wake-up cooldown


def test_wake_ups_closer_than_the_cooldown_share_a_routing_round(engine, settings):
    """Ten events committed one by one about 20 ms apart, each with its NOTIFY, are routed
    in at most three rounds when the cooldown is half a second (a round's events share its
    ``routed_at``); without a cooldown each NOTIFY started a round of its own."""
    ob = Outbox()
    ob.subscriber("t", consumer="a")(lambda job: None)
    with running_relay(ob, settings(wake_cooldown=0.5, poll_interval=5.0)):
        ids = []
        for i in range(10):
            ids += publish_events(engine, "t", [{"n": i}])
            time.sleep(0.02)  # a stream of commits, not a wait for a condition
        with engine.connect() as c:
            def routed() -> bool:
                return c.execute(sa.text("SELECT count(*) FROM outbox_events WHERE routed_at IS NOT NULL"
                                         " AND id = ANY(:ids)"), {"ids": ids}).scalar_one() == 10
            wait_for(routed, timeout=TIMEOUT, what="the ten events routed")
            rounds = c.execute(sa.text("SELECT count(DISTINCT routed_at) FROM outbox_events WHERE id = ANY(:ids)"),
                               {"ids": ids}).scalar_one()
    assert 1 <= rounds <= 3


def test_full_batches_are_not_held_back_by_the_cooldown(engine, settings):
    """A backlog is routed and claimed in full batches back to back: 300 events in batches
    of 20 (15 routing rounds, 45 claims of 20 jobs) with a cooldown of 1 s would need a
    minute of pauses if the cooldown applied to full batches; only a claim that comes back
    short (it caught up with the router) is followed by one."""
    ob = Outbox()
    for consumer in ("a", "b", "c"):
        ob.subscriber("t", consumer=consumer)(lambda job: None)
    publish_events(engine, "t", [{"n": i} for i in range(300)])
    def all_done() -> bool:
        statuses = _statuses(engine)
        return len(statuses) == 900 and set(statuses.values()) == {"done"}

    with running_relay(ob, settings(wake_cooldown=1.0, route_batch=20, claim_batch=20, concurrency=20, prefetch=0)):
        wait_for(all_done, timeout=15, what="the backlog done without a cooldown between full batches")


# ------------------------------------------------------------- claim-order hint


def test_claim_after_a_key_skips_what_sorts_before_it(engine):
    from outbox.db.jobs import complete_and_claim_after, release_jobs

    ids = routed_jobs(engine, "t", ["a"], n=6)
    with _psycopg(engine) as conn:
        _, first, last = complete_and_claim_after(conn, [], LEASES, 2, "w1", None)
        assert [j.id for j in first] == ids[:2] and last[2] == ids[1]
        release_jobs(conn, first[:1])  # ready again, and it sorts before the key
        _, after, last = complete_and_claim_after(conn, [], LEASES, 10, "w1", last)
        assert [j.id for j in after] == ids[2:] and last[2] == ids[5]
        _, head, _ = complete_and_claim_after(conn, [], LEASES, 10, "w1", None)
        assert [j.id for j in head] == ids[:1]


def test_a_more_urgent_job_is_claimed_from_the_head_while_a_backlog_runs_after_the_hint(engine, settings):
    """The dispatcher claims after the last key it claimed, and from the head at least every
    HINT_SECONDS: a job that sorts before its hint waits at most that long behind a backlog."""
    ob = Outbox()
    finished: dict[str, list[int]] = {"bulk": [], "urgent": []}

    @ob.subscriber("bulk", consumer="bulk", priority=5)
    def bulk(job: Job) -> None:
        time.sleep(0.01)
        finished["bulk"].append(job.id)

    @ob.subscriber("urgent", consumer="urgent", priority=0)
    def urgent(job: Job) -> None:
        finished["urgent"].append(job.id)

    publish_events(engine, "bulk", [{"n": i} for i in range(1500)])
    with running_relay(ob, settings(concurrency=2, prefetch=10, claim_batch=10)):
        wait_for(lambda: len(finished["bulk"]) >= 100, timeout=TIMEOUT, what="the backlog under way")
        publish_events(engine, "urgent", [{"n": 0}])
        wait_for(lambda: finished["urgent"], timeout=TIMEOUT, what="the urgent job")
        assert len(finished["bulk"]) < 1500  # it did not wait for the backlog to drain


# ------------------------------------------------------------- stop during a claim


def test_stop_while_a_claim_is_in_flight_releases_every_job_it_returns(engine, settings):
    """SIGTERM while both workers are busy and the dispatcher's claim is still executing:
    the claim returns its jobs after the grace period ran out and stop() queued the
    workers' stop markers. Every one of them is released (ready, attempt not counted)
    before stop() returns; none is left running under a relay that exited. The
    interleaving is forced: a lock on outbox_events holds the claim (which joins that
    table) until 1 s after stop() began, past its 0.5 s grace."""
    ob, gate, running = _blocking_app()
    subscribe(engine, "t", ["a"])
    publish_events(engine, "t", [{"n": i} for i in range(22)])
    route_all(engine)
    with engine.begin() as c:  # only two jobs are due at first: both workers take one and block
        c.execute(sa.text("UPDATE outbox_jobs SET run_at = now() + interval '1 day' WHERE id > "
                          "(SELECT min(id) + 1 FROM outbox_jobs)"))
    relay = Relay(ob, settings(concurrency=2, prefetch=20, listen=False), route=False, maintain=False)
    stopper = threading.Thread(target=relay.stop, kwargs={"grace": 0.5})
    blocker = engine.connect()
    try:
        relay.start()
        wait_for(lambda: len(running) == 2, timeout=TIMEOUT, what="both workers busy")
        blocker.begin()
        blocker.execute(sa.text("LOCK TABLE outbox_events IN ACCESS EXCLUSIVE MODE"))
        with engine.begin() as c:
            c.execute(sa.text("UPDATE outbox_jobs SET run_at = now() WHERE status = 'ready'"))
        wait_for(lambda: _claim_waiting_on_a_lock(engine), timeout=TIMEOUT, what="the claim blocked on the lock")
        stopper.start()
        wait_for(relay.runner.signals.stop_claiming.is_set, timeout=TIMEOUT, what="stop() under way")
        time.sleep(1.0)  # the fault's timing: the claim returns after the grace period is over
    finally:
        blocker.rollback()
        blocker.close()
    stopper.join(15)
    gate.set()
    assert not stopper.is_alive()
    wait_for(lambda: relay.runner.stats["claimed"] == 22, timeout=TIMEOUT, what="the claim to have returned")
    with engine.connect() as c:
        rows = c.execute(sa.text("SELECT status, attempts, count(*) FROM outbox_jobs GROUP BY 1, 2")).all()
        assert [tuple(r) for r in rows] == [("ready", 0, 22)]
        assert c.execute(sa.text("SELECT count(*) FROM outbox_relays")).scalar_one() == 0  # a clean stop removes its row


def _claim_waiting_on_a_lock(engine: sa.Engine) -> bool:
    with engine.connect() as c:
        return bool(c.execute(sa.text(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
            " AND application_name = 'outbox-relay'")).scalar_one())


def test_two_dispatchers_run_every_job_once_both_claiming_and_stop_clean(engine, settings):
    """``dispatchers=2``: both dispatchers claim and complete (each round of one runs while
    the other's rows are handled), every job runs once and ends done at its first attempt,
    the relay never holds more than concurrency + prefetch claims whose handler has not
    returned, and a clean stop removes the relay's row (the last dispatcher to stop removes
    it). The claims held may exceed that by the jobs whose outcome the other dispatcher is
    writing: with one dispatcher the round that writes them also claims, with two a claim
    can return first (seen: 52 held, 40 of them finishing)."""
    ob = Outbox()
    ran: list[int] = []
    lock = threading.Lock()

    @ob.subscriber("t", consumer="a")
    def handler(job: Job) -> None:
        with lock:
            ran.append(job.id)

    subscribe(engine, "t", ["a"])
    relay = Relay(ob, settings(concurrency=8, prefetch=40, claim_batch=20, dispatchers=2))
    claims_by: list[list[int]] = [[], []]
    for n, dispatcher in enumerate(relay.runner.dispatchers):  # counts what each one's claims return
        real = dispatcher.producer._hand_over

        def counted(claimed: list[Job], start_now: int, sent: float, real: Any = real, n: int = n) -> None:
            claims_by[n].append(len(claimed))
            real(claimed, start_now, sent)

        dispatcher.producer._hand_over = counted  # type: ignore[method-assign]
    relay.start()
    held: list[int] = []
    try:
        for _ in range(10):
            publish_events(engine, "t", [{"n": i} for i in range(300)])
            held.append(relay.runner.claims.count_unfinished())
        wait_for(lambda: len(ran) >= 3000 and relay.runner.in_flight() == 0, timeout=60, what="3,000 jobs run")
        held.append(relay.runner.claims.count_unfinished())
    finally:
        relay.stop()
    assert len(ran) == len(set(ran)) == 3000  # each job once
    with engine.connect() as c:
        rows = c.execute(sa.text("SELECT status, attempts, count(*) FROM outbox_jobs GROUP BY 1, 2")).all()
        assert [tuple(r) for r in rows] == [("done", 1, 3000)]
        assert c.execute(sa.text("SELECT count(*) FROM outbox_relays")).scalar_one() == 0
    assert all(sum(claims) > 0 for claims in claims_by), claims_by  # both dispatchers claimed jobs
    assert max(held) <= 48, held


# ------------------------------------------------------- the relay's buffer list


def test_a_claim_whose_reply_was_lost_gets_its_attempt_back(engine, settings):
    """A claim that committed but whose reply never reached the relay (the connection broke
    after the commit) leaves jobs running under the relay that it does not know of. They
    stay listed in its row of outbox_relays, so when their leases run out the reaper gives
    them their attempt back: with max_attempts=1 they still run, once, instead of dying."""
    from outbox.db.jobs import BufferMark, complete_and_claim_after, relay_seen

    ob = Outbox()
    ran: list[int] = []

    @ob.subscriber("t", consumer="a", lease=1, max_attempts=1)
    def handler(job: Job) -> None:
        ran.append(job.id)

    subscribe(engine, "t", ["a"], lease=1, max_attempts=1)
    publish_events(engine, "t", [{"n": i} for i in range(10)])
    route_all(engine)
    relay = Relay(ob, settings(concurrency=2, reap_interval=0.2))
    with _psycopg(engine) as conn:  # the lost round, as the dispatcher would have sent it
        relay_seen(conn, relay.worker_id, [])
        _, orphans, _ = complete_and_claim_after(conn, [], {"a": 1.0}, 5, relay.worker_id, None,
                                                 buffer=BufferMark(relay.worker_id, 0))
    assert len(orphans) == 5
    relay.start()
    try:
        wait_for(lambda: list(_statuses(engine).values()) == ["done"] * 10, timeout=TIMEOUT, what="all ten done")
    finally:
        relay.stop()
    with engine.connect() as c:
        attempts = c.execute(sa.text("SELECT id, attempts FROM outbox_jobs ORDER BY id")).all()
    assert [a for _, a in attempts] == [1] * 10
    assert sorted(ran) == sorted(i for i, _ in attempts)  # each ran once


def test_a_busy_relay_keeps_its_row_seen(engine, settings, monkeypatch):
    """A relay whose dispatcher is never idle still refreshes last_seen_at every
    RELAY_SEEN_INTERVAL, so pruning never takes it for a dead relay (its buffer list would
    go with the row)."""
    import outbox.relay.dispatcher

    monkeypatch.setattr(outbox.relay.dispatcher, "RELAY_SEEN_INTERVAL", 0.3)
    ob = Outbox()
    ob.subscriber("t", consumer="a")(lambda job: None)
    subscribe(engine, "t", ["a"])
    with running_relay(ob, settings(concurrency=1, prefetch=0)) as relay:
        wait_for(lambda: _relay_age(engine, relay.worker_id) is not None, timeout=TIMEOUT, what="the relay's row")
        seen = set()
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:  # a steady trickle: a round every few milliseconds
            publish_events(engine, "t", [{"n": 0}])
            seen.add(_relay_seen_at(engine, relay.worker_id))
    # Refreshed while busy (about every 0.3 s; a loaded machine may stretch that, so no bound
    # on the age): a relay that refreshed its row only when idle shows one value here.
    assert len(seen) >= 3, sorted(seen)


def _relay_seen_at(engine: sa.Engine, worker_id: str) -> Any:
    with engine.connect() as c:
        return c.execute(sa.text("SELECT last_seen_at FROM outbox_relays WHERE id = :id"), {"id": worker_id}).scalar()


def _relay_age(engine: sa.Engine, worker_id: str) -> float | None:
    with engine.connect() as c:
        return c.execute(sa.text("SELECT extract(epoch FROM now() - last_seen_at) FROM outbox_relays WHERE id = :id"),
                         {"id": worker_id}).scalar()
