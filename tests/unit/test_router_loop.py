"""The router's loop (:class:`outbox.relay.router.Router`) alone, on a real database and
without a relay: one round's accounting, the loop's wake-ups (a full batch, a NOTIFY's
wake-up, the poll), a lost connection, the statistics keeper's thread, and a stop."""

from __future__ import annotations

import threading

import sqlalchemy as sa
from sqlalchemy.orm import Session

from outbox import Outbox, publish_many
from outbox.relay.notify import Wakeup
from outbox.relay.reconnect import Reconnector
from outbox.relay.router import Router, register_subscriptions
from outbox.relay.statistics import StatisticsKeeper
from outbox.testing import wait_for

TIMEOUT = 20.0


def _subscribe(engine: sa.Engine, settings, topic: str, consumers: list[str]) -> None:
    ob = Outbox()
    for consumer in consumers:
        ob.subscriber(topic, consumer=consumer)(lambda job: None)
    register_subscriptions(engine, ob, settings())


def _publish(engine: sa.Engine, topic: str, n: int) -> None:
    with Session(engine) as s, s.begin():
        publish_many(s, [(topic, {"n": i}) for i in range(n)])


def _unrouted(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return conn.execute(sa.text("SELECT count(*) FROM outbox_events WHERE routed_at IS NULL")).scalar_one()


def _router(engine: sa.Engine, settings, **overrides) -> Router:
    return Router(engine, settings(**overrides), stop=threading.Event(), wake=threading.Event(),
                  wake_workers=Wakeup(), reconnect=Reconnector(0.2))


def test_a_round_routes_counts_and_wakes_the_workers(engine, settings):
    _subscribe(engine, settings, "order.placed", ["receipt", "invoice"])
    _publish(engine, "order.placed", 3)
    _publish(engine, "nobody.listens", 1)
    router = _router(engine, settings)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        result = router.run_round(conn)
        assert (result.events, result.jobs, result.unsubscribed) == (4, 6, 1)
        assert router.wake_workers.wait(0) == (True, False)
        assert router.run_round(conn).events == 0  # nothing left
    assert router.wake_workers.wait(0) == (False, False)  # a round without jobs wakes no worker
    assert dict(router.stats) == {"events_routed": 4, "jobs_created": 6, "events_unsubscribed": 1,
                                  "jobs_superseded": 0}
    assert router.statistics.pending == 6  # counted for the keeper, no ANALYZE yet (floor 1,000)
    assert router.statistics.analyzed == 0
    assert _unrouted(engine) == 0


def test_the_loop_follows_a_full_batch_at_once_and_waits_for_a_wake_up_otherwise(engine, settings):
    _subscribe(engine, settings, "t", ["a"])
    _publish(engine, "t", 5)
    router = _router(engine, settings, route_batch=2, poll_interval=3600)  # the poll never comes
    router.start()
    try:
        # The counts follow the round's commit: wait for both.
        wait_for(lambda: _unrouted(engine) == 0 and router.stats["events_routed"] == 5, timeout=TIMEOUT,
                 what="the backlog routed in full batches")
        _publish(engine, "t", 1)
        router.wake.set()  # what the listener does on NOTIFY outbox_events
        wait_for(lambda: _unrouted(engine) == 0 and router.stats["jobs_created"] == 6, timeout=TIMEOUT,
                 what="the event routed on the wake-up")
    finally:
        router.stop()
        assert router.join(timeout=5)
    assert router.stop_event.is_set()


def test_the_loop_polls_without_a_wake_up(engine, settings):
    _subscribe(engine, settings, "t", ["a"])
    router = _router(engine, settings, poll_interval=0.1)
    router.start()
    try:
        _publish(engine, "t", 2)  # no wake-up: only a poll finds them
        wait_for(lambda: _unrouted(engine) == 0, timeout=TIMEOUT, what="the events routed by a poll")
    finally:
        router.stop()
        assert router.join(timeout=5)


def test_a_lost_connection_is_replaced_and_routing_goes_on(engine, settings):
    _subscribe(engine, settings, "t", ["a"])
    _publish(engine, "t", 1)
    router = _router(engine, settings, poll_interval=0.1)
    router.start()
    try:
        wait_for(lambda: _unrouted(engine) == 0, timeout=TIMEOUT, what="the first event routed")
        with engine.connect() as conn:  # the router's kept connection, and every other, ended
            conn.execute(sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                                 " WHERE datname = current_database() AND pid <> pg_backend_pid()"))
        _publish(engine, "t", 1)
        wait_for(lambda: _unrouted(engine) == 0, timeout=TIMEOUT, what="the event after the lost connection routed")
    finally:
        router.stop()
        assert router.join(timeout=5)
    assert router.stats["events_routed"] == 2


def test_the_statistics_keeper_runs_beside_the_loop(engine, settings):
    _subscribe(engine, settings, "t", ["a", "b"])
    router = _router(engine, settings, poll_interval=0.1)
    router.statistics = StatisticsKeeper(engine, floor=10)  # replaced before start: the thread runs this one
    router.start()
    try:
        _publish(engine, "t", 10)  # 20 jobs: past the floor
        wait_for(lambda: router.statistics.analyzed == 1 and router.statistics.pending == 0, timeout=TIMEOUT,
                 what="the keeper's ANALYZE")
    finally:
        router.stop()
        assert router.join(timeout=5)
