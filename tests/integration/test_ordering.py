"""Ordered delivery per key on a real PostgreSQL (architecture notes, "Ordering"): one job
of an (ordered consumer, key) at a time, in the commit order of the publishing
transactions, through retries, reaping, both poison policies, concurrent routers and the
publish lock; the blocked / skip CLI; the plans of the promotion and the route filter."""

from __future__ import annotations

import json
import os
import threading
from collections import Counter, defaultdict
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from outbox import Job, Outbox, PermanentError, publish, publish_many
from outbox.admin import blocked_keys, redrive, skip_dead_job
from outbox.db import queries
from outbox.db.jobs import bury_job, claim_jobs, complete_jobs
from outbox.db.promotion import promote
from outbox.errors import NotBlockingError
from outbox.ops.cli import main
from outbox.relay.maintenance import reap_expired
from outbox.relay.ordering import HeadSweeper
from outbox.relay.router import route_all, route_batch
from outbox.settings import OutboxSettings
from outbox.testing import drain, wait_for

from .helpers import expire_lease, running_relays


def _settings(**overrides: Any) -> OutboxSettings:
    return OutboxSettings(_env_file=None, **{"backoff_base": 60.0, "backoff_cap": 600.0, **overrides})


def _registry(seen: list[tuple[str | None, int]], *, fail: dict[int, int] | None = None, on_dead: str = "block",
              permanent: set[int] = frozenset(), consumer: str = "c", ordered: bool = True) -> Outbox:
    """An ordered consumer on topic ``t`` recording (key, payload n) of every attempt;
    ``fail[n]`` attempts of event n fail, events in ``permanent`` die at once."""
    ob = Outbox()
    failures = dict(fail or {})

    @ob.subscriber("t", consumer=consumer, ordered=ordered, on_dead=on_dead if ordered else "block",
                   max_attempts=5)
    def handle(job: Job) -> None:
        n = job.payload["n"]
        seen.append((job.key, n))
        if n in permanent:
            raise PermanentError(f"poison {n}")
        if failures.get(n, 0) > 0:
            failures[n] -= 1
            raise RuntimeError(f"flaky {n}")

    return ob


def _publish(engine: sa.Engine, events: list[tuple[str | None, int]]) -> list[int]:
    with Session(engine) as s, s.begin():
        return publish_many(s, [("t", {"n": n}, key) for key, n in events])


def _per_key(seen: list[tuple[str | None, int]]) -> dict[str | None, list[int]]:
    out: dict[str | None, list[int]] = defaultdict(list)
    for key, n in seen:
        out[key].append(n)
    return dict(out)


def _jobs(engine: sa.Engine) -> list[sa.Row]:
    with engine.connect() as c:
        return c.execute(sa.text(
            "SELECT j.id, j.event_id, j.status, j.ordering_key, (e.payload ->> 'n')::int AS n FROM outbox_jobs j"
            " JOIN outbox_events e ON e.id = j.event_id ORDER BY j.event_id")).all()


def _status(engine: sa.Engine) -> dict[int, str]:
    return {r.n: r.status for r in _jobs(engine)}


def _lock_waiters(engine: sa.Engine) -> int:
    with engine.connect() as c:
        return c.execute(sa.text("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                                 " AND wait_event_type = 'Lock'")).scalar_one()


def _route_behind(engine: sa.Engine, holder: sa.Connection, what: str) -> list[Any]:
    """Route in a thread while ``holder``'s open transaction holds job rows the router's lock
    waits for; once it waits (``what``), commit and close ``holder``. Returns the router's
    results (one :class:`RouteResult`, or none if it did not finish within 10 s)."""
    routed: list[Any] = []
    thread = threading.Thread(target=lambda: routed.append(route_all(engine)))
    thread.start()
    wait_for(lambda: _lock_waiters(engine) == 1, what=what)
    holder.commit()
    holder.close()
    thread.join(10)
    return routed


# ------------------------------------------------------------------- delivery order


def test_a_key_runs_in_order_through_retries_and_other_keys_go_on(engine):
    seen: list[tuple[str | None, int]] = []
    ob = _registry(seen, fail={1: 2, 12: 1})
    _publish(engine, [("a", 1), ("b", 11), ("a", 2), ("b", 12), ("a", 3), (None, 21), ("b", 13), (None, 22)])
    first = drain(engine, ob, settings=_settings())  # retries left waiting out their (long) backoff
    assert {(r.outcome) for r in first} <= {"done", "retried"}
    assert _per_key(seen) == {"a": [1], "b": [11, 12], None: [21, 22]}
    assert _status(engine) == {1: "ready", 2: "pending", 3: "pending", 11: "done", 12: "ready", 13: "pending",
                               21: "done", 22: "done"}
    drain(engine, ob, run_retries=True, settings=_settings())
    assert _per_key(seen) == {"a": [1, 1, 1, 2, 3], "b": [11, 12, 12, 13], None: [21, 22]}
    assert set(_status(engine).values()) == {"done"}


def test_a_reaped_job_keeps_its_place(engine):
    seen: list[tuple[str | None, int]] = []
    ob = _registry(seen)
    _publish(engine, [("k", 1), ("k", 2)])
    drain(engine, ob, consumers=[], settings=_settings())  # routes only
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
        claimed = claim_jobs(c, {"c": 30.0}, 10, "w1")
    assert [j.payload["n"] for j in claimed] == [1]  # the follower is pending, not claimable
    with engine.begin() as c:
        expire_lease(c, claimed[0].id)
    with engine.begin() as c:
        reap_expired(c)
    assert _status(engine) == {1: "ready", 2: "pending"}
    drain(engine, ob, settings=_settings())
    assert seen == [("k", 1), ("k", 2)]


def test_block_policy_holds_only_its_key_until_skipped_or_redriven(engine):
    seen: list[tuple[str | None, int]] = []
    ob = _registry(seen, permanent={1})
    _publish(engine, [("k", 1), ("k", 2), ("other", 10), ("k", 3), ("other", 11)])
    drain(engine, ob, settings=_settings())
    assert _per_key(seen) == {"k": [1], "other": [10, 11]}
    assert _status(engine) == {1: "dead", 2: "pending", 3: "pending", 10: "done", 11: "done"}
    with engine.connect() as c:
        [blocked] = blocked_keys(c)
    dead_id = next(r.id for r in _jobs(engine) if r.n == 1)
    assert (blocked.consumer, blocked.key, blocked.job_id, blocked.pending) == ("c", "k", dead_id, 2)
    assert blocked.since is not None
    # Redrive: the dead job is the head, so it runs first (and dies again: still poison).
    with engine.begin() as c:
        assert redrive(c, [dead_id]) == [dead_id]
    assert _status(engine)[1] == "ready" and _status(engine)[2] == "pending"
    drain(engine, ob, settings=_settings())
    assert _per_key(seen)["k"] == [1, 1]
    assert skip_dead_job(engine, dead_id) != []
    drain(engine, ob, settings=_settings())
    assert _per_key(seen)["k"] == [1, 1, 2, 3]
    assert _status(engine) == {1: "dead", 2: "done", 3: "done", 10: "done", 11: "done"}


def test_skip_policy_dead_letters_and_goes_on_with_the_key(engine):
    seen: list[tuple[str | None, int]] = []
    ob = _registry(seen, permanent={1}, fail={2: 10}, on_dead="skip")  # 2 dies after max_attempts
    _publish(engine, [("k", 1), ("k", 2), ("k", 3)])
    drain(engine, ob, run_retries=True, settings=_settings())
    assert _per_key(seen) == {"k": [1, 2, 2, 2, 2, 2, 3]}
    rows = {r.n: r for r in _jobs(engine)}
    assert [(rows[n].status, rows[n].ordering_key) for n in (1, 2, 3)] == [("dead", None), ("dead", None),
                                                                          ("done", "k")]
    with engine.connect() as c:
        assert blocked_keys(c) == []


def test_skip_refuses_a_job_that_blocks_nothing_and_writes_nothing(engine):
    seen: list[tuple[str | None, int]] = []
    ob = _registry(seen)
    _publish(engine, [("k", 1), ("k", 2)])
    drain(engine, ob, consumers=[], settings=_settings())
    before = _jobs(engine)
    with pytest.raises(NotBlockingError, match=r"is ready, not dead"):
        skip_dead_job(engine, before[0].id)
    with pytest.raises(NotBlockingError, match="no such job"):
        skip_dead_job(engine, 999_999)
    assert _jobs(engine) == before


def test_blocked_and_skip_commands(engine, db_url, capsys, monkeypatch):
    seen: list[tuple[str | None, int]] = []
    ob = _registry(seen, permanent={1})
    _publish(engine, [("order:7", 1), ("order:7", 2)])
    drain(engine, ob, settings=_settings())
    dead_id = next(r.id for r in _jobs(engine) if r.n == 1)
    for name in [n for n in os.environ if n.startswith("OUTBOX_")]:
        monkeypatch.delenv(name)
    url = ["--database-url", db_url.render_as_string(hide_password=False)]
    capsys.readouterr()
    assert main(["blocked", *url]) == 0
    out = capsys.readouterr().out
    assert "order:7" in out and str(dead_id) in out and "c " in out, out
    assert main(["blocked", "--consumer", "nobody", *url]) == 0
    assert "no blocked keys for consumer nobody" in capsys.readouterr().out
    assert main(["status", "--json", *url]) == 0
    [c] = [c for c in json.loads(capsys.readouterr().out)["consumers"] if c["consumer"] == "c"]
    assert (c["pending"], c["dead"], c["blocked_keys"]) == (1, 1, 1)
    assert main(["skip", "999999", *url]) == 2
    assert "no such job" in capsys.readouterr().err
    with pytest.raises(SystemExit) as refused:  # not a job id at all: the range error of every id argument
        main(["skip", "0", *url])
    assert refused.value.code == 2 and "must be between 1 and 9223372036854775807" in capsys.readouterr().err
    assert main(["skip", str(dead_id), *url]) == 0
    assert "is ready" in capsys.readouterr().out
    assert _status(engine) == {1: "dead", 2: "ready"}
    assert main(["skip", str(dead_id), *url]) == 2  # already skipped: refused, one line
    err = capsys.readouterr().err
    assert err.startswith("outbox-relay: error: ") and "holds no ordering key" in err, err
    assert main(["status", "--json", *url]) == 0
    [c] = [c for c in json.loads(capsys.readouterr().out)["consumers"] if c["consumer"] == "c"]
    assert (c["pending"], c["ready"], c["blocked_keys"]) == (0, 1, 0)  # promoted; the dead job no longer blocks
    assert main(["redrive", str(dead_id), *url]) == 0  # dead but no longer ordered: runs unordered
    capsys.readouterr()


def test_a_transactional_handler_completion_promotes_the_next_job(engine):
    seen: list[int] = []
    ob = Outbox()

    @ob.subscriber("t", consumer="tx", ordered=True, transactional=True)
    def handle(job: Job, session: Session) -> None:
        seen.append(job.payload["n"])

    _publish(engine, [("k", 1), ("k", 2), ("k", 3)])
    drain(engine, ob, settings=_settings())
    assert seen == [1, 2, 3]


def test_unordered_consumers_of_the_same_events_are_not_held_back(engine):
    seen_ordered: list[tuple[str | None, int]] = []
    seen_free: list[tuple[str | None, int]] = []
    ob = _registry(seen_ordered, fail={1: 1})
    free = _registry(seen_free, fail={1: 1}, consumer="free", ordered=False)
    for sub in free:
        ob.subscriber("t", consumer="free")(sub.handler)
    _publish(engine, [("k", 1), ("k", 2)])
    drain(engine, ob, settings=_settings())
    assert seen_ordered == [("k", 1)]
    assert seen_free == [("k", 1), ("k", 2)]


# ------------------------------------------------------------------- promotion sweep


def test_the_sweep_promotes_a_head_left_pending(engine):
    seen: list[tuple[str | None, int]] = []
    ob = _registry(seen)
    _publish(engine, [("a", 1), ("a", 2), ("b", 3), ("b", 4)])
    drain(engine, ob, consumers=[], settings=_settings())
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
        claimed = claim_jobs(c, {"c": 30.0}, 10, "w1")
        assert len(complete_jobs(c, claimed)) == 2  # completed, never promoted (a relay killed right then)
    assert _status(engine) == {1: "done", 2: "pending", 3: "done", 4: "pending"}
    sweeper = HeadSweeper(keys=1)
    with engine.begin() as c:
        assert len(sweeper.sweep(c)) == 1  # one key per pass
    with engine.begin() as c:
        assert len(sweeper.sweep(c)) == 1
    assert _status(engine) == {1: "done", 2: "ready", 3: "done", 4: "ready"}
    with engine.begin() as c:
        assert sweeper.sweep(c) == [] and sweeper.sweep(c) == []


# ------------------------------------------------------------------- commit order


def test_publish_lock_makes_a_key_s_ids_follow_commit_order(engine):
    seen: list[tuple[str | None, int]] = []
    ob = _registry(seen)
    drain(engine, ob, consumers=[], settings=_settings())  # the ordered subscription, as a relay writes it
    first = Session(engine)
    first.begin()
    publish(first, "t", {"n": 1}, key="k")  # holds the key's lock until it commits
    second_id: list[int] = []

    def second() -> None:
        with Session(engine) as s, s.begin():
            second_id.append(publish(s, "t", {"n": 2}, key="k"))

    thread = threading.Thread(target=second)
    thread.start()
    wait_for(lambda: _lock_waiters(engine) == 1, what="the second publisher waiting for the key's lock")
    with Session(engine) as s, s.begin():  # an id drawn while the second waits
        between = publish(s, "t", {"n": 99}, key="other")
    first.commit()
    first.close()
    thread.join(10)
    assert second_id and second_id[0] > between  # its id was drawn after the wait, not before
    drain(engine, ob, settings=_settings())
    assert _per_key(seen)["k"] == [1, 2]


def test_publish_many_locks_every_key_before_drawing_ids(engine):
    drain(engine, _registry([]), consumers=[], settings=_settings())
    first = Session(engine)
    first.begin()
    publish(first, "t", {"n": 1}, key="b")
    ids: list[list[int]] = []

    def second() -> None:
        with Session(engine) as s, s.begin():
            ids.append(publish_many(s, [("t", {"n": 2}, "a"), ("t", {"n": 3}, "b"), ("t", {"n": 4})]))

    thread = threading.Thread(target=second)
    thread.start()
    wait_for(lambda: _lock_waiters(engine) == 1, what="publish_many waiting for key b")
    with Session(engine) as s, s.begin():
        between = publish(s, "t", {"n": 99})
    first.commit()
    first.close()
    thread.join(10)
    assert ids and min(ids[0]) > between


def test_events_of_topics_without_an_ordered_consumer_take_no_publish_lock(engine):
    drain(engine, _registry([], ordered=False), consumers=[], settings=_settings())
    with Session(engine) as s, s.begin():
        publish(s, "t", {"n": 1}, key="k")
        publish_many(s, [("t", {"n": 2}, "k2")])
        held = s.execute(sa.text("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"
                                 " AND pid = pg_backend_pid()")).scalar_one()
    assert held == 0


def test_router_does_not_route_a_key_ahead_of_an_event_another_router_holds(engine):
    seen: list[tuple[str | None, int]] = []
    ob = _registry(seen)
    drain(engine, ob, consumers=[], settings=_settings())  # subscriptions written
    e10, e11, e12 = _publish(engine, [("k", 10), ("k", 11), ("other", 12)])
    holder = engine.connect()
    holder.begin()
    holder.execute(sa.text("SELECT id FROM outbox_events WHERE id = :id FOR UPDATE"), {"id": e10})  # as router A
    with engine.begin() as c:
        result = route_batch(c, 100)
    assert (result.events, result.held_back) == (1, 1)  # e12 routed; e11 waits for e10
    assert [r.n for r in _jobs(engine)] == [12]
    holder.rollback()
    holder.close()
    route_all(engine)
    assert _status(engine) == {10: "ready", 11: "pending", 12: "ready"}


def test_concurrent_routers_on_one_key_keep_its_order(engine):
    seen: list[tuple[str | None, int]] = []
    ob = _registry(seen)
    drain(engine, ob, consumers=[], settings=_settings())
    _publish(engine, [("hot" if n % 3 else f"k{n % 5}", n) for n in range(300)])
    errors: list[BaseException] = []

    def router() -> None:
        try:
            while True:
                with engine.begin() as c:
                    r = route_batch(c, 7)
                if r.events == 0 and r.held_back == 0:
                    with engine.connect() as c:
                        if not c.execute(queries.in_schema().event_unrouted_count).scalar_one():
                            return
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=router) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    rows = _jobs(engine)
    assert len(rows) == 300
    by_key: dict[str, list[sa.Row]] = defaultdict(list)
    for r in rows:
        by_key[r.ordering_key].append(r)
    for key, jobs in by_key.items():
        assert [j.status for j in jobs] == ["ready"] + ["pending"] * (len(jobs) - 1), key
    drain(engine, ob, settings=_settings())
    for key, ns in _per_key(seen).items():
        assert ns == sorted(ns), key


def test_router_sees_a_completion_committing_while_it_routes(engine):
    """The head's lock: a completion of the key's head that commits while the router routes
    the next event is either seen (the job is ready) or waits for the router (and the
    promotion after it then sees the pending job)."""
    seen: list[tuple[str | None, int]] = []
    ob = _registry(seen)
    _publish(engine, [("k", 1)])
    drain(engine, ob, consumers=[], settings=_settings())
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
        [head] = claim_jobs(c, {"c": 30.0}, 10, "w1")
    _publish(engine, [("k", 2)])
    completer = engine.connect()
    completer.begin()
    assert len(complete_jobs(completer, [head])) == 1  # done, not committed yet: the row is locked
    routed = _route_behind(engine, completer, "the router waiting on the head's row")
    assert routed and routed[0].jobs == 1
    assert _status(engine) == {1: "done", 2: "ready"}


def test_router_sees_heads_a_heartbeat_renews_while_it_routes_with_statistics_kept(engine):
    """The heads' lock re-reads rows a heartbeat renewed meanwhile (PostgreSQL's recheck of
    a locked row's newest version): every next job of a running head is ``pending``. With
    statistics on a table of 3,000 jobs, the planner made the lock's ``IN (SELECT ... FROM
    the heads)`` a hash semi-join, whose recheck dropped rows: 49 of 50 next jobs were made
    ready while their heads ran (found by the acceptance test that terminates the relays'
    backends, where a relay's heartbeat renewed heads it held ahead). The heads are now
    locked through an array computed once (``j.id = ANY (ARRAY(...))``)."""
    keys = [f"k{i}" for i in range(50)]
    ob = Outbox()
    ob.subscriber("t", consumer="c", ordered=True)(lambda job: None)
    ob.subscriber("bulk", consumer="other")(lambda job: None)
    _publish(engine, [(key, 1) for key in keys])
    with Session(engine) as s, s.begin():
        publish_many(s, [("bulk", {"n": n}) for n in range(3_000)])
    drain(engine, ob, consumers=[], settings=_settings())
    with engine.begin() as c:
        heads = claim_jobs(c, {"c": 30.0}, 100, "w1")
        c.execute(sa.text("ANALYZE outbox_jobs"))
        c.execute(sa.text("ANALYZE outbox_events"))
    assert len(heads) == len(keys)
    _publish(engine, [(key, 2) for key in keys])
    heartbeat = engine.connect()
    heartbeat.begin()  # as job_heartbeat_many: every head locked FOR UPDATE, its lease renewed
    heartbeat.execute(sa.text("SELECT id FROM outbox_jobs WHERE id = ANY(:ids) ORDER BY id FOR UPDATE"),
                      {"ids": [h.id for h in heads]})
    heartbeat.execute(sa.text("UPDATE outbox_jobs SET lease_until = now() + interval '30 seconds'"
                              " WHERE id = ANY(:ids)"), {"ids": [h.id for h in heads]})
    routed = _route_behind(engine, heartbeat, "the router waiting on the heads' rows")
    assert routed and routed[0].jobs == len(keys)
    second = [r.status for r in _jobs(engine) if r.ordering_key is not None and r.n == 2]
    assert second == ["pending"] * 50, Counter(second)


# ------------------------------------------------------------------- plan guard


def _plan(conn: sa.Connection, statement: sa.TextClause, params: dict) -> str:
    return "\n".join(conn.execute(sa.text("EXPLAIN " + statement.text), params).scalars())


def test_promotion_and_route_filter_use_their_partial_indexes_with_many_done_rows(engine):
    seen: list[tuple[str | None, int]] = []
    ob = _registry(seen)
    drain(engine, ob, consumers=[], settings=_settings())
    with engine.begin() as c:
        c.execute(sa.text("""
            INSERT INTO outbox_events (topic, key, payload, created_at, routed_at)
            SELECT 't', 'k' || (g % 1000), jsonb_build_object('n', g), now() - interval '1 day', now() - interval '1 day'
            FROM generate_series(1, 200000) g
        """))
        c.execute(sa.text("""
            INSERT INTO outbox_jobs (event_id, consumer, status, attempts, max_attempts, fence, finished_at, ordering_key)
            SELECT id, 'c', 'done', 1, 5, id, now() - interval '1 hour', key FROM outbox_events
        """))
    _publish(engine, [(f"k{n % 1000}", n) for n in range(20000)])  # a backlog of unrouted keyed events
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
        c.execute(sa.text("ANALYZE outbox_events"))
        c.execute(sa.text("ANALYZE outbox_jobs"))
    statements = queries.in_schema("public")
    with engine.connect() as conn:
        route_plan = _plan(conn, statements.event_route_many, {"limit": 500, "skip": [], "only": None, "channel": "outbox_jobs", "after": 0})
        conn.rollback()
        promote_plan = _plan(conn, statements.job_promote_many, {"consumers": ["c", "c"], "keys": ["k1", "k2"]})
        conn.rollback()
        sweep_plan = _plan(conn, statements.job_ordering_heads_list,
                           {"after_consumer": "", "after_key": "", "limit": 500})
    assert "ix_outbox_events_unrouted_key" in route_plan, route_plan
    assert "ix_outbox_jobs_ordering" in route_plan, route_plan
    assert "ix_outbox_jobs_ordering" in promote_plan, promote_plan
    assert "ix_outbox_jobs_ordering" in sweep_plan, sweep_plan
    for plan in (route_plan, promote_plan, sweep_plan):
        assert "Seq Scan on outbox_jobs" not in plan, plan
        assert "Seq Scan on outbox_events" not in plan, plan


# ------------------------------------------------------------------- relays


def test_two_relays_run_each_key_one_job_at_a_time_in_order(engine, settings):
    """Two relays with eight workers each: per key, the handler never runs twice at once and
    sees its events in publish order, through failed attempts; the dispatcher's promotion
    (after each round of outcomes) moves every key on."""
    lock = threading.Lock()
    running: dict[str, int] = defaultdict(int)
    overlaps: list[str] = []
    seen: list[tuple[str | None, int]] = []
    failed: set[int] = set()
    ob = Outbox()

    @ob.subscriber("t", consumer="c", ordered=True, max_attempts=10)
    def handle(job: Job) -> None:
        key, n = job.key or "", job.payload["n"]
        with lock:
            running[key] += 1
            if running[key] > 1:
                overlaps.append(key)
            seen.append((job.key, n))
        try:
            if n % 7 == 0 and n not in failed:
                failed.add(n)
                raise RuntimeError("first attempt fails")
        finally:
            with lock:
                running[key] -= 1

    events = [(f"k{n % 10}", n) for n in range(200)]
    with running_relays(2, ob, settings(concurrency=8, prefetch=8, backoff_base=0.01, backoff_cap=0.02,
                                        reap_interval=60.0)):  # no sweep: only the dispatcher promotes
        for start in range(0, len(events), 20):
            _publish(engine, events[start:start + 20])
        wait_for(lambda: set(_status(engine).values()) == {"done"} and len(_status(engine)) == 200, timeout=60,
                 what="every job done")
    assert overlaps == []
    for key, ns in _per_key(seen).items():
        assert ns == sorted(ns), key


def test_a_completion_waits_for_a_router_holding_the_head_and_its_promotion_sees_the_new_job(engine):
    """Case 3 of the race notes: the router locked the head first; the completion waits for
    the router's commit, so the promotion after the completion sees the pending job."""
    seen: list[tuple[str | None, int]] = []
    ob = _registry(seen)
    _publish(engine, [("k", 1)])
    drain(engine, ob, consumers=[], settings=_settings())
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
        [head] = claim_jobs(c, {"c": 30.0}, 10, "w1")
    _publish(engine, [("k", 2)])
    router = engine.connect()
    router.begin()
    assert route_batch(router, 100).jobs == 1  # job 2 pending; the head locked FOR SHARE until commit
    completed: list[set[int]] = []

    def complete() -> None:
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
            completed.append(complete_jobs(c, [head]))

    thread = threading.Thread(target=complete)
    thread.start()
    wait_for(lambda: _lock_waiters(engine) == 1, what="the completion waiting for the router")
    router.commit()
    router.close()
    thread.join(10)
    assert completed == [{head.id}]
    assert _status(engine) == {1: "done", 2: "pending"}
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
        assert len(promote(c, [("c", "k")])) == 1
    assert _status(engine) == {1: "done", 2: "ready"}


def test_skip_policy_on_the_reaper_and_poison_paths(engine):
    seen: list[tuple[str | None, int]] = []
    ob = _registry(seen, on_dead="skip")
    _publish(engine, [("a", 1), ("a", 2), ("b", 3), ("b", 4)])
    drain(engine, ob, consumers=[], settings=_settings())
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
        a1, b3 = claim_jobs(c, {"c": 30.0}, 10, "w1")
        assert bury_job(c, b3, "poison row")  # the poison handling's dead-letter
    with engine.begin() as c:
        c.execute(sa.text("UPDATE outbox_jobs SET attempts = max_attempts WHERE id = :id"), {"id": a1.id})
        expire_lease(c, a1.id)
    with engine.begin() as c:
        assert reap_expired(c).dead == 1  # out of attempts: dead
    rows = {r.n: r for r in _jobs(engine)}
    assert [(rows[n].status, rows[n].ordering_key) for n in (1, 2, 3, 4)] == [
        ("dead", None), ("pending", "a"), ("dead", None), ("pending", "b")]
    with engine.begin() as c:
        assert len(HeadSweeper().sweep(c)) == 2  # the relay's reaper loop runs this after reaping
    drain(engine, ob, settings=_settings())
    assert seen == [("a", 2), ("b", 4)]


def test_router_and_claims_on_one_key_do_not_wait_for_each_other(engine):
    """The lock modes that keep the router and the claims of an ordered key's head from
    deadlocking: a claim's lock on a ready head (``FOR NO KEY UPDATE``) does not make the
    router wait, and the router's lock on the head (``FOR KEY SHARE``) does not make a claim
    skip it. With the router on ``FOR SHARE`` and claims on ``FOR UPDATE`` each waited for
    the other's lock, and a claim whose completion part waited for a running head the router
    held deadlocked with it."""
    from outbox.relay.router import register_subscriptions

    register_subscriptions(engine, _registry([]), _settings())
    _publish(engine, [("K", 1)])
    with engine.begin() as c:
        route_batch(c, 10)
    head = _jobs(engine)[0]
    assert head.status == "ready"
    _publish(engine, [("K", 2)])
    with engine.connect() as claimer:
        claimer.execute(sa.text("SELECT id FROM outbox_jobs WHERE id = :id FOR NO KEY UPDATE"), {"id": head.id})
        with engine.begin() as router:  # the claim's lock is held: the router must not wait for it
            router.execute(sa.text("SET LOCAL lock_timeout = '2s'"))
            assert route_batch(router, 10).jobs == 1
        claimer.rollback()
    assert [(r.n, r.status) for r in _jobs(engine)] == [(1, "ready"), (2, "pending")]
    _publish(engine, [("K", 3)])
    with engine.connect() as router:
        router.execute(sa.text("SELECT id FROM outbox_jobs WHERE id = :id FOR KEY SHARE"), {"id": head.id})
        with engine.begin() as c:  # the router's lock is held: the claim takes the head all the same
            c.execute(sa.text("SET LOCAL lock_timeout = '2s'"))
            assert [j.id for j in claim_jobs(c, {"c": 30.0}, 10, "w")] == [head.id]
        router.rollback()


def test_declaring_a_consumer_unordered_again_releases_its_waiting_jobs(engine):
    """A consumer redeployed with ``ordered=False``: the jobs still waiting behind their key
    run (unordered) instead of staying pending, and a dead job no longer blocks (found by
    the adversarial test: drain left them pending for good, a relay's sweep let one a pass)."""
    seen: list[tuple[str | None, int]] = []
    drain(engine, _registry(seen, permanent={1}), settings=_settings())  # declares the consumer ordered
    _publish(engine, [("K", 1), ("K", 2), ("K", 3), ("J", 4), ("J", 5)])
    drain(engine, _registry(seen, permanent={1}), settings=_settings())
    assert [(r.n, r.status) for r in _jobs(engine)] == [(1, "dead"), (2, "pending"), (3, "pending"),
                                                       (4, "done"), (5, "done")]
    drain(engine, _registry(seen, ordered=False), settings=_settings())
    assert [(r.n, r.status, r.ordering_key) for r in _jobs(engine)] == [
        (1, "dead", None), (2, "done", None), (3, "done", None), (4, "done", "J"), (5, "done", "J")]
