"""The statistics keeper (:class:`outbox.relay.statistics.StatisticsKeeper`) in its own
thread, on a real database and without a relay: the router's counts wake it only once an
ANALYZE is due, it analyses then, and it ends when stopped. (Its rule, its lock timeout and
its errors, called inline, are in the integration tests of the statistics.)"""

from __future__ import annotations

import threading

import sqlalchemy as sa

from outbox.relay.statistics import StatisticsKeeper
from outbox.testing import wait_for

TIMEOUT = 20.0


def _reltuples(engine: sa.Engine) -> float:
    with engine.connect() as conn:
        return conn.execute(sa.text("SELECT reltuples FROM pg_class WHERE oid = 'outbox_jobs'::regclass")).scalar_one()


def test_counts_below_the_trigger_send_no_analyze_and_past_it_wake_the_thread(engine):
    with engine.begin() as conn:
        conn.execute(sa.text("ALTER TABLE outbox_jobs SET (autovacuum_enabled = false)"))
    keeper = StatisticsKeeper(engine, floor=100)
    stop = threading.Event()
    thread = threading.Thread(target=keeper.run, args=(stop,), kwargs={"poll": 3600}, daemon=True)
    thread.start()
    try:
        keeper.count(60)
        keeper.count(40)  # 100: not past the floor
        assert keeper.analyzed == 0 and keeper.pending == 100
        keeper.count(1)
        # pending drops just after analyzed counts the ANALYZE: wait for both.
        wait_for(lambda: keeper.analyzed == 1 and keeper.pending == 0, timeout=TIMEOUT,
                 what="the ANALYZE once past the floor")
        assert _reltuples(engine) == 0  # analysed: an empty table, no longer "never analysed" (-1)
        keeper.count(100)  # the trigger is the floor again (0 rows): 100 is not past it
        assert keeper.analyzed == 1 and keeper.pending == 100
    finally:
        stop.set()
        keeper.wake()
        thread.join(timeout=5)
    assert not thread.is_alive()


def test_wake_ends_the_thread_at_once_once_stop_is_set(engine):
    keeper = StatisticsKeeper(engine)
    stop = threading.Event()
    thread = threading.Thread(target=keeper.run, args=(stop,), kwargs={"poll": 3600}, daemon=True)
    thread.start()
    stop.set()
    keeper.wake()
    thread.join(timeout=5)
    assert not thread.is_alive() and keeper.analyzed == 0
