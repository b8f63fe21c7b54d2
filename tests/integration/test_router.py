"""Router: events -> one job per subscribed consumer, exactly once, whatever the commit
order and however many routers run at once."""

from __future__ import annotations

import dataclasses
import threading

import sqlalchemy as sa
from sqlalchemy.orm import Session

from outbox import Outbox, OutboxSettings, publish
from outbox.db.poison import Quarantine
from outbox.relay.router import Router, RouteResult, route_all, route_batch

from .helpers import publish_events, running_relay, subscribe


def _route(engine: sa.Engine, limit: int = 500) -> RouteResult:
    with engine.begin() as conn:
        return route_batch(conn, limit)


def _jobs(engine: sa.Engine) -> list[tuple[int, str]]:
    with engine.connect() as c:
        return [tuple(r) for r in c.execute(sa.text("SELECT event_id, consumer FROM outbox_jobs ORDER BY 1, 2"))]


def _unrouted(engine: sa.Engine) -> list[int]:
    with engine.connect() as c:
        return list(c.execute(sa.text("SELECT id FROM outbox_events WHERE routed_at IS NULL ORDER BY id")).scalars())


def test_out_of_order_commits_are_each_routed_exactly_once(engine):
    subscribe(engine, "order.placed", ["a", "b"])
    slow = Session(engine)
    slow.begin()
    low = publish(slow, "order.placed", {"n": "low"})  # takes the lower id, stays open
    with Session(engine) as fast, fast.begin():
        high = publish(fast, "order.placed", {"n": "high"})
    assert low < high

    first = _route(engine)  # only the higher id is visible yet
    assert (first.events, first.jobs, first.unsubscribed) == (1, 2, 0)
    assert _jobs(engine) == [(high, "a"), (high, "b")]

    slow.commit()
    slow.close()
    second = _route(engine)  # a router that remembered "last id seen" would skip this one
    assert (second.events, second.jobs) == (1, 2)
    third = _route(engine)
    assert (third.events, third.jobs) == (0, 0)

    assert _jobs(engine) == [(low, "a"), (low, "b"), (high, "a"), (high, "b")]
    assert _unrouted(engine) == []


def test_event_without_subscriber_is_marked_routed_and_counted(engine):
    subscribe(engine, "order.placed", ["a"])
    ids = publish_events(engine, "nobody.listens", [{"n": 1}, {"n": 2}])
    publish_events(engine, "order.placed", [{"n": 3}])

    result = _route(engine)

    assert result.first_ready is not None and result.first_ready[0] == 0  # the one job's key, priority 0
    assert dataclasses.replace(result, first_ready=None) == RouteResult(
        events=3, jobs=1, unsubscribed=2, unsubscribed_topics={"nobody.listens": 2})
    assert _unrouted(engine) == []
    with engine.connect() as c:
        assert c.execute(sa.text("SELECT count(*) FROM outbox_jobs WHERE event_id = ANY(:ids)"),
                         {"ids": ids}).scalar_one() == 0
    assert _route(engine) == RouteResult(0, 0, 0)


def test_concurrent_routers_create_each_job_exactly_once(engine):
    consumers = ["a", "b", "c"]
    subscribe(engine, "t", consumers)
    n_events = 3000
    publish_events(engine, "t", [{"n": i} for i in range(n_events)])
    totals: list[RouteResult] = []
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def router() -> None:
        events = jobs = 0
        try:
            start.wait()
            while True:
                with engine.begin() as conn:  # each router its own connection and transactions
                    r = route_batch(conn, 50)
                events += r.events
                jobs += r.jobs
                if r.events == 0:
                    break
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
        totals.append(RouteResult(events, jobs, 0))

    threads = [threading.Thread(target=router) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    # No event counted by two routers, no job reported twice (the unique constraint alone
    # would hide a second insert behind ON CONFLICT, so the counts are the real check).
    assert sum(t.events for t in totals) == n_events
    assert sum(t.jobs for t in totals) == n_events * len(consumers)
    assert sum(1 for t in totals if t.events) >= 2, "the routers did not actually run concurrently"
    with engine.connect() as c:
        row = c.execute(sa.text(
            "SELECT count(*), count(DISTINCT (event_id, consumer)) FROM outbox_jobs")).one()
    assert tuple(row) == (n_events * len(consumers),) * 2
    assert _unrouted(engine) == []


def test_rolled_back_event_is_never_routed(engine):
    subscribe(engine, "t", ["a"])
    s = Session(engine)
    s.begin()
    publish(s, "t", {"n": 1})
    assert _route(engine) == RouteResult(0, 0, 0)  # not visible while open
    s.rollback()
    s.close()
    assert route_all(engine) == RouteResult(0, 0, 0)
    with engine.connect() as c:
        assert c.execute(sa.text("SELECT count(*) FROM outbox_events")).scalar_one() == 0
    assert _jobs(engine) == []


def test_redeclaring_a_subscription_differently_is_logged(engine, caplog):
    """Two registries sharing a database and a consumer name with different options: the
    later relay's options win, and it says so instead of taking over silently."""
    import logging

    from outbox.relay.relay import register_subscriptions

    first, second = Outbox(), Outbox()
    first.subscriber("t", consumer="shared", max_attempts=4)(lambda job: None)
    second.subscriber("t", consumer="shared", max_attempts=1)(lambda job: None)
    settings = OutboxSettings(_env_file=None)
    with caplog.at_level(logging.WARNING, logger="outbox.relay.router"):
        register_subscriptions(engine, first, settings)
        register_subscriptions(engine, first, settings)  # same options again: silent
        assert not caplog.records
        register_subscriptions(engine, second, settings)
    assert any("subscription shared on t now has this registry's options (max_attempts=1" in r.getMessage()
               for r in caplog.records)


def test_hostile_topic_and_consumer_names_are_routed_and_run(engine, settings):
    """Names full of quotes, semicolons and SQL are data, never SQL: routed and run end to end."""
    from outbox.testing import wait_for

    topic = "order'; DROP TABLE outbox_jobs; --"
    consumer = 'c"; SELECT pg_sleep(10); -- \\ $1 %s {0}'
    seen: list[str] = []
    ob = Outbox()
    ob.subscriber(topic, consumer=consumer)(lambda job: seen.append(job.consumer))
    publish_events(engine, topic, [{"n": 1}, {"n": 2}])
    with running_relay(ob, settings()):
        wait_for(lambda: len(seen) == 2, timeout=15, what="both jobs run")
    with engine.connect() as c:
        rows = c.execute(sa.text("SELECT consumer, status FROM outbox_jobs")).all()
    assert seen == [consumer, consumer] and sorted(rows) == [(consumer, "done")] * 2


# ------------------------------------------------------------- where a round starts (issue 28)


def _router(engine: sa.Engine) -> Router:
    from outbox.relay.notify import Wakeup
    from outbox.relay.reconnect import Reconnector

    return Router(engine, OutboxSettings(_env_file=None), stop=threading.Event(), wake=threading.Event(),
                  wake_workers=Wakeup(), reconnect=Reconnector(1.0))


def test_a_round_starts_after_the_last_id_routed_and_goes_back_for_an_announced_late_commit(engine):
    """The router scans after the highest id its last round locked, so it does not read again
    through the index entries of the events routed before (a long snapshot elsewhere keeps
    them). An event whose transaction commits after a higher id was routed sorts before that
    hint: its notification names its id (the events' trigger) and takes the next round back
    to it."""
    import psycopg

    from outbox.relay.notify import EVENTS_PAYLOAD

    subscribe(engine, "order.placed", ["a"])
    router = _router(engine)
    listener = psycopg.connect(engine.url.set(drivername="postgresql").render_as_string(hide_password=False),
                               autocommit=True)
    listener.execute('LISTEN "outbox_events"')
    slow = Session(engine)
    slow.begin()
    low = publish(slow, "order.placed", {"n": "low"})  # takes the lower id, stays open
    with Session(engine) as fast, fast.begin():
        high = publish(fast, "order.placed", {"n": "high"})
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        assert router.run_round(conn).events == 1  # from the first id: only the higher one is visible
        slow.commit()
        slow.close()
        assert router.run_round(conn).events == 0  # after the hint (high): the late commit is not seen
        assert _unrouted(engine) == [low]
        payloads = [n.payload for n in listener.notifies(timeout=2, stop_after=2)]
        assert sorted(payloads) == sorted([f"{EVENTS_PAYLOAD}{low}", f"{EVENTS_PAYLOAD}{high}"])
        router.hint.lower(low)  # what the relay's listener does with the late commit's notification
        assert router.run_round(conn).events == 1
    listener.close()
    assert _unrouted(engine) == [] and _jobs(engine) == [(low, "a"), (high, "a")]


def test_the_look_out_finds_a_late_commit_no_notification_announced(engine):
    """What no notification announced (a relay without LISTEN, a NOTIFY missed while the
    listener reconnected) sorts before the hint until the router's look-out finds it, on a
    connection of its own, and lowers the hint to it; quarantined ids are left out."""
    subscribe(engine, "order.placed", ["a"])
    router = _router(engine)
    slow = Session(engine)
    slow.begin()
    low = publish(slow, "order.placed", {"n": "low"})
    with Session(engine) as fast, fast.begin():
        high = publish(fast, "order.placed", {"n": "high"})
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        assert router.look_behind(conn) is None  # no round yet: rounds start from the first id
        assert router.run_round(conn).events == 1
        assert router.look_behind(conn) is None  # the open transaction's event is not visible
        slow.commit()
        slow.close()
        router.quarantine.add(low, RuntimeError("poison"), "routing")
        assert router.look_behind(conn) is None  # quarantined: left out
        router.quarantine = Quarantine("event")  # its time is up
        assert router.look_behind(conn) == low and router.wake.is_set()
        assert router.run_round(conn).events == 1
        assert router.look_behind(conn) is None
    assert _unrouted(engine) == [] and _jobs(engine) == [(low, "a"), (high, "a")]


def test_the_route_hint_keeps_an_announcement_that_came_during_a_failed_or_running_round():
    from outbox.relay.router import RouteHint

    hint = RouteHint()
    assert hint.start() == 0 and hint.after() is None
    hint.routed(100)
    assert hint.start() == 100
    hint.routed(150)
    hint.lower(120)  # arrives before the next round starts
    assert hint.start() == 119
    hint.lower(140)  # arrives while that round runs: it may not have seen 140
    hint.routed(160)
    assert hint.start() == 139
    hint.failed()  # the round failed: what it was started with still waits
    assert hint.start() == 139
    hint.routed(None)  # it locked nothing: the hint stays
    assert hint.start() == 160 and hint.after() == 160
