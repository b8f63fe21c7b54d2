"""Coalescing per key (``coalesce=True``, docs/coalescing.md): of the jobs of one (consumer,
event key) only the newest event's waits and runs; older waiting ones end ``superseded``; a
running one is never superseded, and its attempt ends ``superseded`` rather than waiting
again. Each test drives the statements the relay runs (routing, claims, outcomes, the
reaper) on a real PostgreSQL; the races with a concurrent claim, failure or router are
played with two connections, the second statement in a thread that waits for the first's
row lock (``_blocked``) before the first commits."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from outbox import Job, Outbox, publish
from outbox.admin import jobs_page, status
from outbox.db import queries
from outbox.db.jobs import claim_jobs, complete_jobs, fail_jobs, release_jobs, snooze_jobs
from outbox.db.retention import prune
from outbox.ops.cli import main
from outbox.relay.maintenance import reap_expired
from outbox.relay.ordering import promote_finished
from outbox.relay.outcomes import Failure, Snoozed
from outbox.relay.router import RouteResult, register_subscriptions, route_batch
from outbox.settings import OutboxSettings

LEASE = 300.0


def _registry(*, ordered: bool = False, topics: tuple[str, ...] = ("t",), max_attempts: int = 3) -> Outbox:
    ob = Outbox()

    @ob.subscriber(list(topics), consumer="latest", coalesce=True, ordered=ordered, max_attempts=max_attempts)
    def latest(job: Job) -> None: ...

    @ob.subscriber(list(topics), consumer="every", ordered=ordered)
    def every(job: Job) -> None: ...

    return ob


def _declare(engine: sa.Engine, **options: Any) -> Outbox:
    ob = _registry(**options)
    register_subscriptions(engine, ob, OutboxSettings(_env_file=None, default_lease=LEASE))
    return ob


def _publish(engine: sa.Engine, key: str | None, n: int = 1, topic: str = "t") -> list[int]:
    with Session(engine) as s, s.begin():
        return [publish(s, topic, {"i": i}, key=key) for i in range(n)]


def _route(engine: sa.Engine, limit: int = 100) -> RouteResult:
    with engine.begin() as conn:
        return route_batch(conn, limit)


def _jobs(engine: sa.Engine, consumer: str = "latest") -> list[dict[str, Any]]:
    with engine.connect() as c:
        return [dict(r) for r in c.execute(sa.text(
            "SELECT id, event_id, status, coalesce_key, superseded_by, ordering_key, finished_at IS NOT NULL AS finished"
            " FROM outbox_jobs WHERE consumer = :c ORDER BY event_id"), {"c": consumer}).mappings()]


def _by_event(engine: sa.Engine, consumer: str = "latest") -> dict[int, str]:
    return {j["event_id"]: j["status"] for j in _jobs(engine, consumer)}


def _claim(engine: sa.Engine, worker: str = "w", limit: int = 10, consumers: tuple[str, ...] = ("latest",)) -> list[Job]:
    with engine.begin() as conn:
        return claim_jobs(conn, {c: LEASE for c in consumers}, limit, worker)


def _promote(engine: sa.Engine, ob: Outbox, jobs: list[Job]) -> None:
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        promote_finished(conn, jobs, {s.consumer: s for s in ob})


def _blocked(engine: sa.Engine, pid: int, thread: threading.Thread, timeout: float = 10.0) -> bool:
    """Wait until backend ``pid`` waits for a lock (True) or ``thread`` ended (False)."""
    deadline = time.monotonic() + timeout
    with engine.connect() as c:
        while time.monotonic() < deadline:
            if not thread.is_alive():
                return False
            waiting = c.execute(sa.text("SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = :p"),
                                {"p": pid}).scalar()
            if waiting:
                return True
            time.sleep(0.01)
    raise AssertionError(f"backend {pid} neither waited for a lock nor finished in {timeout}s")


def _in_thread(engine: sa.Engine, work: Callable[[sa.Connection], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """Run ``work(conn)`` in a transaction of its own on a thread; returns the thread and a
    dict that gets ``pid``, then ``result`` (or ``error``)."""
    out: dict[str, Any] = {}
    ready = threading.Event()

    def run() -> None:
        try:
            with engine.begin() as conn:
                out["pid"] = conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
                ready.set()
                out["result"] = work(conn)
        except BaseException as exc:  # reported by the test
            out["error"] = exc
            ready.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(10)
    return thread, out


# ------------------------------------------------------------------ routing


def test_of_a_batch_only_the_newest_event_of_a_key_gets_a_waiting_job(engine):
    _declare(engine)
    a = _publish(engine, "k", 3)
    b = _publish(engine, "other")
    none = _publish(engine, None, 2)
    result = _route(engine)
    assert result.jobs == 12 and result.superseded == {"latest": 2}
    jobs = {j["event_id"]: j for j in _jobs(engine)}
    assert [jobs[e]["status"] for e in a] == ["superseded", "superseded", "ready"]
    assert [jobs[e]["superseded_by"] for e in a] == [a[2], a[2], None]
    assert all(jobs[e]["finished"] for e in a[:2]) and not jobs[a[2]]["finished"]
    assert jobs[b[0]]["status"] == "ready"  # another key: never superseded by k
    assert [jobs[e]["status"] for e in none] == ["ready", "ready"]  # no key: never coalesced
    assert [jobs[e]["coalesce_key"] for e in none] == [None, None]
    assert set(_by_event(engine, "every").values()) == {"ready"}  # the consumer that does not coalesce


def test_a_newer_event_supersedes_the_older_waiting_job_and_marks_a_running_one(engine):
    _declare(engine)
    first = _publish(engine, "k")[0]
    _route(engine)
    (running,) = _claim(engine)
    second = _publish(engine, "k")[0]
    _route(engine)
    assert _by_event(engine) == {first: "running", second: "ready"}
    third = _publish(engine, "k")[0]
    assert _route(engine).superseded == {"latest": 1}
    jobs = {j["event_id"]: j for j in _jobs(engine)}
    assert jobs[first]["status"] == "running" and jobs[first]["superseded_by"] == third  # marked, never superseded
    assert jobs[second]["status"] == "superseded" and jobs[second]["superseded_by"] == third
    assert jobs[third]["status"] == "ready"
    with engine.begin() as conn:  # a running job's completion is a completion
        assert complete_jobs(conn, [running]) == {running.id}
    assert _by_event(engine) == {first: "done", second: "superseded", third: "ready"}


@pytest.mark.parametrize("how", ["fail", "reap", "release", "snooze", "dead"])
def test_a_marked_running_job_ends_superseded_instead_of_waiting_again(engine, how):
    _declare(engine, max_attempts=1 if how == "dead" else 3)
    first = _publish(engine, "k")[0]
    _route(engine)
    (job,) = _claim(engine)
    newer = _publish(engine, "k")[0]
    _route(engine)
    with engine.begin() as conn:
        if how in ("fail", "dead"):
            assert fail_jobs(conn, [(job, Failure(0.0, False, "boom"))]) == {
                job.id: "dead" if how == "dead" else "superseded"}
        elif how == "release":
            assert release_jobs(conn, [job]) == {job.id}
        elif how == "snooze":
            assert snooze_jobs(conn, [(job, Snoozed(0.0))]) == {job.id}
        else:
            conn.execute(sa.text("UPDATE outbox_jobs SET lease_until = now() - interval '1 second' WHERE id = :id"),
                         {"id": job.id})
    if how == "reap":
        with engine.begin() as conn:
            assert reap_expired(conn).superseded == 1
    assert _by_event(engine) == {first: "dead" if how == "dead" else "superseded", newer: "ready"}
    assert [j.event_id for j in _claim(engine)] == [newer]  # the superseded one is never claimed again


def test_jobs_show_names_the_event_that_superseded_a_job(engine, db_url, capsys):
    _declare(engine)
    a = _publish(engine, "k", 2)
    _route(engine)
    job_id = next(j["id"] for j in _jobs(engine) if j["event_id"] == a[0])
    url = db_url.render_as_string(hide_password=False)
    assert main(["jobs", "show", str(job_id), "--database-url", url]) == 0
    out = capsys.readouterr().out
    assert "status superseded" in out and f"superseded by event {a[1]}" in out
    assert main(["jobs", "show", str(job_id), "--json", "--database-url", url]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert (shown["status"], shown["superseded_by"]) == ("superseded", a[1])


def test_a_late_older_event_is_superseded_by_a_newer_live_job_and_runs_after_a_finished_one(engine):
    _declare(engine)
    slow = Session(engine)
    slow.begin()
    late = publish(slow, "t", {"n": "late"}, key="k")  # the lower id, committed last
    newer = _publish(engine, "k")[0]
    _route(engine)
    slow.commit()
    slow.close()
    assert _route(engine).superseded == {"latest": 1}
    jobs = {j["event_id"]: j for j in _jobs(engine)}
    assert (jobs[late]["status"], jobs[late]["superseded_by"]) == ("superseded", newer)
    assert jobs[newer]["status"] == "ready"

    (job,) = _claim(engine)  # the newer one done: a late event after it runs (coalescing is not ordering)
    with engine.begin() as conn:
        complete_jobs(conn, [job])
    slow = Session(engine)
    slow.begin()
    later = publish(slow, "t", {"n": "later"}, key="k")
    slow.commit()
    slow.close()
    _route(engine)
    assert _by_event(engine)[later] == "ready"


def test_an_event_overtaken_by_an_unrouted_newer_one_is_superseded_at_once(engine):
    _declare(engine)
    ids = _publish(engine, "k", 3)
    assert _route(engine, limit=1).superseded == {"latest": 1}  # the batch holds the first one only
    assert _by_event(engine) == {ids[0]: "superseded"}
    assert _jobs(engine)[0]["superseded_by"] == ids[1]
    _route(engine)
    assert _by_event(engine) == {ids[0]: "superseded", ids[1]: "superseded", ids[2]: "ready"}


def test_another_topic_of_the_key_supersedes_only_for_the_consumers_subscribed_to_it(engine):
    ob = Outbox()
    ob.subscriber(["t", "u"], consumer="latest", coalesce=True)(lambda job: None)
    ob.subscriber("t", consumer="t_only", coalesce=True)(lambda job: None)
    register_subscriptions(engine, ob, OutboxSettings(_env_file=None))
    on_t = _publish(engine, "k")[0]
    on_u = _publish(engine, "k", topic="u")[0]
    _route(engine, limit=1)  # on_u is unrouted: it overtakes on_t for "latest" only
    assert _by_event(engine) == {on_t: "superseded"}
    assert _by_event(engine, "t_only") == {on_t: "ready"}
    _route(engine)
    assert _by_event(engine) == {on_t: "superseded", on_u: "ready"}


# ------------------------------------------------------------------ ordered consumers


def test_ordered_coalescing_keeps_the_running_head_and_only_the_newest_behind_it(engine):
    ob = _declare(engine, ordered=True)
    first = _publish(engine, "k")[0]
    _route(engine)
    (head,) = _claim(engine)
    waiting = _publish(engine, "k", 3)
    _route(engine)
    jobs = {j["event_id"]: j for j in _jobs(engine)}
    assert [jobs[e]["status"] for e in [first, *waiting]] == ["running", "superseded", "superseded", "pending"]
    assert [jobs[e]["ordering_key"] for e in [first, *waiting]] == ["k", None, None, "k"]
    newest = _publish(engine, "k")[0]
    _route(engine)
    assert _by_event(engine)[waiting[2]] == "superseded" and _by_event(engine)[newest] == "pending"
    with engine.begin() as conn:
        complete_jobs(conn, [head])
    _promote(engine, ob, [head])
    assert _by_event(engine)[newest] == "ready"
    assert [j.event_id for j in _claim(engine)] == [newest]


def test_ordered_coalescing_supersedes_a_ready_or_pending_head_and_the_newest_goes_at_once(engine):
    _declare(engine, ordered=True)
    first = _publish(engine, "k")[0]
    _route(engine)
    assert _by_event(engine) == {first: "ready"}
    second = _publish(engine, "k")[0]
    _route(engine)
    assert _by_event(engine) == {first: "superseded", second: "ready"}  # not pending behind a superseded head


def test_ordered_coalescing_a_failed_marked_head_lets_the_newest_go(engine):
    ob = _declare(engine, ordered=True)
    first = _publish(engine, "k")[0]
    _route(engine)
    (head,) = _claim(engine)
    newer = _publish(engine, "k")[0]
    _route(engine)
    assert _by_event(engine) == {first: "running", newer: "pending"}
    with engine.begin() as conn:
        fail_jobs(conn, [(head, Failure(0.0, False, "boom"))])
    _promote(engine, ob, [head])
    assert _by_event(engine) == {first: "superseded", newer: "ready"}
    assert _jobs(engine)[0]["ordering_key"] is None


def test_ordered_coalescing_a_dead_head_keeps_blocking_its_key(engine):
    _declare(engine, ordered=True, max_attempts=1)
    first = _publish(engine, "k")[0]
    _route(engine)
    (head,) = _claim(engine)
    with engine.begin() as conn:
        fail_jobs(conn, [(head, Failure(0.0, False, "boom"))])
    later = _publish(engine, "k", 2)
    _route(engine)
    assert _by_event(engine) == {first: "dead", later[0]: "superseded", later[1]: "pending"}


# ------------------------------------------------------------------ races


def test_a_claim_that_locked_the_older_job_first_wins_it_is_marked_not_superseded(engine):
    """The race with a concurrent claim (docs/coalescing.md): the claim holds the ready job's
    row lock (its transaction not yet committed) while the router routes a newer event; the
    router waits for the claim's commit, re-reads the row (running) and marks it."""
    _declare(engine)
    first = _publish(engine, "k")[0]
    _route(engine)
    newer = _publish(engine, "k")[0]
    with engine.connect() as claiming:
        tx = claiming.begin()
        (job,) = claim_jobs(claiming, {"latest": LEASE}, 10, "w")
        thread, out = _in_thread(engine, lambda conn: route_batch(conn, 100))
        assert _blocked(engine, out["pid"], thread)  # the router waits for the claim's row lock
        tx.commit()
    thread.join(10)
    assert "error" not in out and out["result"].superseded == {}
    jobs = {j["event_id"]: j for j in _jobs(engine)}
    assert (jobs[first]["status"], jobs[first]["superseded_by"]) == ("running", newer)
    assert jobs[newer]["status"] == "ready"
    assert job.event_id == first


def test_a_claim_after_the_router_locked_the_older_job_skips_it(engine):
    _declare(engine)
    first = _publish(engine, "k")[0]
    _route(engine)
    newer = _publish(engine, "k")[0]
    with engine.connect() as routing:
        tx = routing.begin()
        route_batch(routing, 100)
        assert _claim(engine) == []  # the router holds the older job; the newer one is not committed
        tx.commit()
    assert _by_event(engine) == {first: "superseded", newer: "ready"}


def test_a_failure_racing_the_router_ends_superseded_whichever_commits_first(engine):
    _declare(engine)
    first = _publish(engine, "k")[0]
    _route(engine)
    (job,) = _claim(engine)
    newer = _publish(engine, "k")[0]
    # The router first: it marks the running job, holding its row; the failure waits and reads the mark.
    with engine.connect() as routing:
        tx = routing.begin()
        route_batch(routing, 100)
        thread, out = _in_thread(engine, lambda conn: fail_jobs(conn, [(job, Failure(0.0, False, "boom"))]))
        assert _blocked(engine, out["pid"], thread)
        tx.commit()
    thread.join(10)
    assert out["result"] == {job.id: "superseded"}
    assert _by_event(engine) == {first: "superseded", newer: "ready"}


def test_a_failure_committing_before_the_router_reads_the_row_is_superseded_by_the_router(engine):
    _declare(engine)
    first = _publish(engine, "k")[0]
    _route(engine)
    (job,) = _claim(engine)
    newer = _publish(engine, "k")[0]
    with engine.connect() as failing:
        tx = failing.begin()
        assert fail_jobs(failing, [(job, Failure(0.0, False, "boom"))]) == {job.id: "ready"}  # no mark yet
        thread, out = _in_thread(engine, lambda conn: route_batch(conn, 100))
        assert _blocked(engine, out["pid"], thread)  # the router's snapshot saw it running; it waits
        tx.commit()
    thread.join(10)
    assert out["result"].superseded == {"latest": 1}
    assert _by_event(engine) == {first: "superseded", newer: "ready"}


def test_two_routers_never_leave_two_waiting_jobs_of_a_key(engine):
    """Router A routes the newer event while the older one's publishing transaction has not
    committed; router B, whose snapshot sees both, routes the older one while A has not
    committed: B sees the newer unrouted and makes the older job superseded at once."""
    _declare(engine)
    slow = Session(engine)
    slow.begin()
    older = publish(slow, "t", {"n": "older"}, key="k")
    newer = _publish(engine, "k")[0]
    with engine.connect() as a:
        tx = a.begin()
        route_batch(a, 100)  # routes newer only: older is not committed
        slow.commit()
        slow.close()
        with engine.begin() as b:
            result = route_batch(b, 100)  # older: newer is unrouted in B's snapshot
        tx.commit()
    assert result.superseded == {"latest": 1}
    assert _by_event(engine) == {older: "superseded", newer: "ready"}


def test_a_router_holds_a_newer_event_back_while_another_routes_an_older_one_of_its_key(engine):
    """Router A routes the older event; the newer one commits after A's snapshot, before
    router B's: B sees the older one unrouted (A has not committed) and holds the newer one
    back, as for ordered keys; its next round sees A's job and supersedes it."""
    _declare(engine)
    older = _publish(engine, "k")[0]
    with engine.connect() as a:
        tx = a.begin()
        route_batch(a, 100)
        newer = _publish(engine, "k")[0]
        assert _route(engine).held_back == 1
        tx.commit()
    assert _by_event(engine) == {older: "ready"}
    assert _route(engine).superseded == {"latest": 1}
    assert _by_event(engine) == {older: "superseded", newer: "ready"}


# ------------------------------------------------------------------ operators


def test_superseded_jobs_are_counted_listed_and_pruned_like_done_ones(engine):
    _declare(engine)
    ids = _publish(engine, "k", 3)
    _route(engine)
    with engine.connect() as conn:
        state = status(conn, exact=True)
        latest = next(c for c in state.consumers if c.consumer == "latest")
        assert (latest.ready, latest.superseded) == (1, 2)
        page = jobs_page(conn, "latest", "superseded")
        assert [j.event_id for j in page.jobs] == [ids[1], ids[0]]
    with engine.begin() as conn:
        assert prune(conn, 3600.0, 3600.0) == (0, 0)  # kept for the retention window
        conn.execute(sa.text("UPDATE outbox_jobs SET finished_at = now() - interval '2 hours'"
                             " WHERE status = 'superseded'"))
    with engine.begin() as conn:
        assert prune(conn, 3600.0, 3600.0) == (2, 0)
    assert _by_event(engine) == {ids[2]: "ready"}


# ------------------------------------------------------------------ plan guard


def test_route_reads_the_coalesce_index_with_many_finished_rows(engine):
    """With 200,000 finished jobs of a coalescing consumer (done and superseded, their
    coalesce keys kept) and a backlog of keyed events, routing finds a key's live jobs through
    ``ix_outbox_jobs_coalesce`` and scans neither table."""
    _declare(engine)
    with engine.begin() as c:
        c.execute(sa.text("""
            INSERT INTO outbox_events (topic, key, payload, created_at, routed_at)
            SELECT 't', 'k' || (g % 1000), jsonb_build_object('n', g), now() - interval '1 day', now() - interval '1 day'
            FROM generate_series(1, 200000) g
        """))
        c.execute(sa.text("""
            INSERT INTO outbox_jobs (event_id, consumer, status, attempts, max_attempts, fence, finished_at, coalesce_key)
            SELECT id, 'latest', CASE WHEN id % 3 = 0 THEN 'done' ELSE 'superseded' END, 1, 5, id,
                   now() - interval '1 hour', key FROM outbox_events
        """))
    with Session(engine) as s, s.begin():
        for n in range(5000):
            publish(s, "t", {"n": n}, key=f"k{n % 1000}")
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
        c.execute(sa.text("ANALYZE outbox_events"))
        c.execute(sa.text("ANALYZE outbox_jobs"))
    with engine.connect() as conn:
        plan = "\n".join(conn.execute(sa.text("EXPLAIN " + queries.in_schema("public").event_route_many.text), {
            "limit": 500, "skip": [], "only": None, "channel": "outbox_jobs", "after": 0}).scalars())
    assert "ix_outbox_jobs_coalesce" in plan, plan
    assert "ix_outbox_events_unrouted_key" in plan, plan
    assert "Seq Scan on outbox_jobs" not in plan, plan
    assert "Seq Scan on outbox_events" not in plan, plan
