"""Each part of the job runner on its own, on a real database, with no relay running (as
River tests its producer and completer, PgQueuer its buffers, completion and heartbeat):
the producer, the completer, the starter, the executor and the heartbeat, each driven by
hand, its effect read back from the tables."""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa

from outbox import Job, Outbox, PermanentError, Snooze
from outbox.db import poison
from outbox.db.jobs import claim_jobs, relay_seen
from outbox.relay import transaction
from outbox.relay.claim import Claim
from outbox.relay.claims import HeldClaims, Signals
from outbox.relay.completer import Completer
from outbox.relay.counters import Counters
from outbox.relay.executor import JobExecutor, WorkerContext
from outbox.relay.heartbeat import Heartbeater
from outbox.relay.notify import Wakeup
from outbox.relay.outcomes import Failure, Outcome, Snoozed
from outbox.relay.producer import ClaimHint, Producer
from outbox.relay.reconnect import Reconnector
from outbox.relay.relay import register_subscriptions
from outbox.relay.router import route_all
from outbox.relay.starter import Starter
from outbox.testing import wait_for

from .helpers import job_row, publish_events, routed_jobs

TIMEOUT = 15
RELAY = "host:1:parts"
LEASES = {"a": 30.0}


@pytest.fixture
def conn(engine: sa.Engine) -> Any:
    """The dispatcher's kind of connection: bare psycopg, autocommit; the relay's row written."""
    url = engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(url, autocommit=True) as connection:
        relay_seen(connection, RELAY, [])
        yield connection


def listed(conn: Any) -> list[int]:
    """The fences the relay's row lists as buffered."""
    return sorted(conn.execute("SELECT buffered FROM outbox_relays WHERE id = %s", (RELAY,)).fetchone()[0])


def statuses(engine: sa.Engine) -> dict[int, str]:
    with engine.connect() as c:
        return dict(c.execute(sa.text("SELECT id, status FROM outbox_jobs ORDER BY id")).all())


def parts(settings: Any, conn: Any, held: HeldClaims, started: list[Claim], **overrides: Any,
          ) -> tuple[Producer, Completer, Counters]:
    """A producer and a completer on ``conn`` for consumer ``a``, sharing ``held``; claims
    handed to workers land in ``started``."""
    s = settings(**overrides)
    stats = Counters()
    producer = Producer(s, held, LEASES, RELAY, Wakeup(), started.extend, stats, hint=ClaimHint(),
                        quarantine=poison.Quarantine("job"))
    completer = Completer(held, lambda: conn, stats, s.schema_name, keep_done=s.keep_done)
    return producer, completer, stats


# ------------------------------------------------------------------ producer


def test_the_producer_gives_idle_workers_their_jobs_and_lists_the_rest_as_buffered(engine, settings, conn):
    ids = routed_jobs(engine, "t", ["a"], n=5)
    held = HeldClaims(concurrency=2)
    started: list[Claim] = []
    producer, completer, stats = parts(settings, conn, held, started)
    this = completer.sort([])
    with producer.claiming(5) as request:
        completer.write_completions(this, request)
        drained = producer.hand_over(conn, request)
    assert [c.id for c in started] == ids[:2]  # claim order, to the two reserved slots
    assert [c.id for c in held.buffer] == ids[2:]
    assert listed(conn) == sorted(c.fence for c in held.buffer)  # written by the claim's own statement
    assert all(c.lease_until is not None and c.order[2] == c.id for c in started)
    assert not drained and stats["claimed"] == 5 and held.taken() == 5
    assert set(statuses(engine).values()) == {"running"}


def test_a_claim_that_finds_fewer_jobs_than_asked_says_the_table_is_drained(engine, settings, conn):
    routed_jobs(engine, "t", ["a"], n=1)
    held = HeldClaims(concurrency=4)
    producer, completer, _ = parts(settings, conn, held, [])
    with producer.claiming(3) as request:
        completer.write_completions(completer.sort([]), request)
        assert producer.hand_over(conn, request)
    assert held.issued == 1  # the two slots it did not fill were given back


def test_a_claim_that_fails_gives_its_room_back(engine, settings, conn):
    routed_jobs(engine, "t", ["a"], n=2)
    held = HeldClaims(concurrency=2)
    producer, _, _ = parts(settings, conn, held, [])
    with pytest.raises(RuntimeError), producer.claiming(2):
        raise RuntimeError("the statement failed")
    assert (held.issued, held.expected, held.count()) == (0, 0, 0)


# ------------------------------------------------------------------ completer


def test_the_completer_writes_a_round_from_its_one_object(engine, settings, conn):
    ids = routed_jobs(engine, "t", ["a"], n=5, max_attempts=2)
    held = HeldClaims(concurrency=5)
    started: list[Claim] = []
    producer, completer, stats = parts(settings, conn, held, started)
    with producer.claiming(5) as request:
        completer.write_completions(completer.sort([]), request)
        producer.hand_over(conn, request)
    done, failed, dead, snoozed, released = started
    for c in started:
        held.slot_freed(c)
    this = completer.sort([(done, Outcome.DONE), (failed, Failure(0.0, False, "boom")),
                           (dead, Failure(0.0, True, "bad")), (snoozed, Snoozed(60.0)),
                           (released, Outcome.RELEASE)])
    assert (this.done, [c for c, _ in this.failed], [c for c, _ in this.snoozed], this.release) == (
        [done], [failed, dead], [snoozed], [released])
    assert this.finishing == [done, failed, dead, snoozed]  # a release frees no ordered key
    with producer.claiming(0) as request:  # the completions and a claim of nothing, one statement
        completer.write_completions(this, request)
        producer.hand_over(conn, request)
    assert completer.write_failures(this.failed) == [dead]
    completer.write_snoozes(this.snoozed)
    completer.write_releases(this.release)
    assert statuses(engine) == dict(zip(ids, ["done", "ready", "dead", "ready", "ready"], strict=True))
    assert job_row(engine, failed.id)["last_error"] == "boom"
    assert job_row(engine, snoozed.id)["attempts"] == 0  # a snooze gives its attempt back
    assert held.count() == 0
    assert (stats["completed"], stats["retried"], stats["dead"], stats["snoozed"], stats["released"]) == (1, 1, 1, 1, 1)


def test_a_stale_completion_changes_nothing_and_is_counted(engine, settings, conn):
    [job_id] = routed_jobs(engine, "t", ["a"], n=1)
    held = HeldClaims(concurrency=1)
    started: list[Claim] = []
    producer, completer, stats = parts(settings, conn, held, started)
    with producer.claiming(1) as request:
        completer.write_completions(completer.sort([]), request)
        producer.hand_over(conn, request)
    [old] = started
    held.slot_freed(old)
    with engine.begin() as c:  # reaped and claimed again meanwhile: a newer fence owns the job
        c.execute(sa.text("UPDATE outbox_jobs SET status = 'ready' WHERE id = :id"), {"id": job_id})
        [new] = claim_jobs(c, LEASES, 1, "someone-else")
    with producer.claiming(0) as request:
        completer.write_completions(completer.sort([(old, Outcome.DONE)]), request)
        producer.hand_over(conn, request)
    row = job_row(engine, job_id)
    assert (row["status"], row["fence"], stats["stale"], stats["completed"]) == ("running", new.fence, 1, 0)


# ------------------------------------------------------------------ starter


def test_the_starter_unlists_buffered_claims_before_it_starts_them_and_hands_back_expired_ones(
        engine, settings, conn):
    routed_jobs(engine, "t", ["a"], n=3)
    held = HeldClaims(concurrency=0)  # every job goes to the buffer first
    producer, completer, _ = parts(settings, conn, held, [])
    with producer.claiming(3) as request:
        completer.write_completions(completer.sort([]), request)
        producer.hand_over(conn, request)
    assert len(listed(conn)) == 3
    first, expired, _ = held.buffer
    expired.lease_bound = 0.0  # as if the process had been paused past its lease
    started: list[tuple[list[int], list[Claim]]] = []  # (fences listed when started, claims)
    released: list[tuple[Claim, Any]] = []
    signals = Signals()
    starter = Starter(engine, settings(), held, RELAY, lambda claims: started.append((listed(conn), claims)),
                      lambda c, outcome: released.append((c, outcome)), signals, Reconnector(1.0))
    thread = threading.Thread(target=starter.run, daemon=True)
    thread.start()
    try:
        held.concurrency = 2  # two workers come free
        held.wake_all()
        wait_for(lambda: len(started) == 1 and released, timeout=TIMEOUT, what="the start and the release")
    finally:
        signals.stopped.set()
        held.wake_all()
        thread.join(TIMEOUT)
    [(listed_then, claims)] = started
    assert first in claims and all(c.fence not in listed_then for c in claims)  # unlisted before they started
    assert released == [(expired, Outcome.RELEASE)] and expired.fence in held.finishing


# ------------------------------------------------------------------ executor


def test_the_executor_says_how_each_run_ended(engine, settings):
    ob = Outbox()
    ob.subscriber("t", consumer="ok")(lambda job: None)

    @ob.subscriber("t", consumer="fails")
    def fails(job: Job) -> None:
        raise RuntimeError("smtp down")

    @ob.subscriber("t", consumer="permanent")
    def permanent(job: Job) -> None:
        raise PermanentError("bad input")

    @ob.subscriber("t", consumer="snoozes")
    def snoozes(job: Job) -> None:
        raise Snooze(5)

    @ob.subscriber("t", consumer="writes", transactional=True)
    def writes(job: Job, session: Any) -> None:
        session.execute(sa.text("SELECT 1"))

    s = settings()
    register_subscriptions(engine, ob, s)
    publish_events(engine, "t", [{"n": 1}])
    route_all(engine)
    leases = {sub.consumer: 30.0 for sub in ob}
    with engine.begin() as c:
        jobs = {job.consumer: job for job in claim_jobs(c, leases, 10, RELAY)}
    executor = JobExecutor(s, transaction.HandlerConnections(engine, 1.0), held=lambda job: True,
                           stopping=threading.Event())
    context = WorkerContext(lambda: pytest.fail("no async handler here"))
    subs = {sub.consumer: sub for sub in ob}
    try:
        ran = {consumer: executor.run(job, subs[consumer], context) for consumer, job in jobs.items()}
    finally:
        context.close()
    assert ran["ok"] is Outcome.DONE and ran["snoozes"] == Snoozed(5)
    assert ran["writes"] is Outcome.COMMITTED and job_row(engine, jobs["writes"].id)["status"] == "done"
    assert isinstance(ran["fails"], Failure) and not ran["fails"].permanent
    assert ran["fails"].error.startswith("RuntimeError: smtp down") and ran["fails"].delay > 0
    assert isinstance(ran["permanent"], Failure) and ran["permanent"].permanent
    assert statuses(engine)[jobs["ok"].id] == "running"  # the executor writes nothing for a lease-mode run


# ------------------------------------------------------------------ heartbeat


def test_the_heartbeat_renews_held_leases_and_tells_a_job_whose_claim_was_taken(engine, settings, conn):
    routed_jobs(engine, "t", ["a"], n=2)
    held = HeldClaims(concurrency=2)
    started: list[Claim] = []
    producer, completer, _ = parts(settings, conn, held, started)
    with producer.claiming(2) as request:
        completer.write_completions(completer.sort([]), request)
        producer.hand_over(conn, request)
    kept, taken = started
    with engine.begin() as c:  # the reaper took one back meanwhile
        c.execute(sa.text("UPDATE outbox_jobs SET status = 'ready' WHERE id = :id"), {"id": taken.id})
    before = job_row(engine, kept.id)["lease_until"]
    bound = kept.lease_bound
    stats = Counters()
    signals = Signals()
    heart = Heartbeater(engine, held, 0.05, signals, Reconnector(1.0), stats, "public")
    thread = threading.Thread(target=heart.run, daemon=True)
    time.sleep(0.01)  # the renewed bound counts from a later send
    thread.start()
    try:
        wait_for(lambda: taken.job.lease_lost, timeout=TIMEOUT, what="the lost lease told")
    finally:
        signals.stopped.set()
        thread.join(TIMEOUT)
    assert not kept.job.lease_lost and kept.lease_bound > bound
    assert job_row(engine, kept.id)["lease_until"] > before
    assert stats["lease_lost"] == 1 and held.renewable() == [kept]


# ------------------------------------------------------------------ look-out


def test_the_look_out_finds_a_ready_job_before_the_claim_hint_and_lowers_it(engine, settings):
    """Claims start after the claim hint; a due ready job that sorts before it and that no
    wake-up announced (here: a job handed back by hand, which sends no NOTIFY) is found by
    the runner's look-out on a connection of its own, which lowers the next claim to just
    before it. Jobs the main claims do not take are not announced: a paused consumer's, an
    excluded consumer's (a forwarder whose broker is down), a quarantined one."""
    from outbox import admin
    from outbox.relay.runner import JobRunner

    ids = routed_jobs(engine, "t", ["a", "b"], n=2)
    ob = Outbox()
    ob.subscriber("t", consumer="a")(lambda job: None)
    ob.subscriber("t", consumer="b")(lambda job: None)
    wake = Wakeup()
    runner = JobRunner(engine, ob, settings(), RELAY, wake)
    with engine.connect() as c:
        keys = {r.id: (r.priority, r.run_at, r.id) for r in c.execute(sa.text(
            "SELECT id, consumer, priority, run_at FROM outbox_jobs ORDER BY priority, run_at, id"))}
        consumer_of = dict(c.execute(sa.text("SELECT id, consumer FROM outbox_jobs")).all())
    first = min(keys.values())
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        assert runner.look_behind(conn) is None  # no claim yet: claims start from the head
        runner.hint.claimed(max(keys.values()))
        assert wake.take_rewind() is None
        assert runner.look_behind(conn) == first
        assert wake.take_rewind() == (first[0], first[1], first[2] - 1)  # the next claim takes it first
        # Neither a paused consumer's job, nor an excluded consumer's, nor a quarantined one.
        owner = consumer_of[first[2]]
        others = min(k for k in keys.values() if consumer_of[k[2]] != owner)
        admin.pause(conn, owner)
        assert runner.look_behind(conn) == others  # the other consumer's first job
        assert wake.take_rewind() == (others[0], others[1], others[2] - 1)
        admin.resume(conn, owner)
        for dispatcher in runner.dispatchers:
            dispatcher.producer.exclude(lambda: frozenset({"a", "b"}))
        assert runner.look_behind(conn) is None
        for dispatcher in runner.dispatchers:
            dispatcher.producer.exclude(frozenset)
        for job_id in keys:
            runner.quarantine.add(job_id, RuntimeError("poison"), "claiming")
        assert runner.look_behind(conn) is None
    assert wake.take_rewind() is None  # nothing lowered the claims since
    assert len(ids) == 4
