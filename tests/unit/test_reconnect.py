"""The relay's shared reconnect policy (outbox/relay/reconnect.py): a lost connection is replaced
at once; waits while connecting fails end as soon as any loop gets through; other errors
keep their backoff."""

from __future__ import annotations

import random
import threading
import time

import psycopg

from outbox.relay.reconnect import Reconnector


def _waiter(reconnect: Reconnector, exc: BaseException, stop: threading.Event) -> tuple[threading.Thread, list[float]]:
    took: list[float] = []
    started = threading.Event()

    def run() -> None:
        started.set()
        t0 = time.monotonic()
        reconnect.backoff(5, "test", exc, stop)
        took.append(time.monotonic() - t0)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    started.wait(5)
    return thread, took


def test_a_failed_reconnect_waits_a_short_probe_interval():
    reconnect = Reconnector(10.0, rng=random.Random(1))
    delays = [reconnect.delay(n, psycopg.OperationalError("refused")) for n in range(2, 60)]
    assert all(0.25 <= d <= 0.5 for d in delays)
    assert max(reconnect.delay(n, ValueError("bad")) for n in range(1, 60)) > 5  # capped backoff, up to 10 s


def test_a_lost_connection_is_retried_at_once_and_only_a_failed_retry_marks_the_database_down():
    """One connection ended (pg_terminate_backend, a pooler, a blip) says nothing about the
    server: the loop retries at once on a new connection. Only when that retry fails too is
    the database taken as unreachable, and the loop waits for a probe (issue 26, item 7)."""
    reconnect = Reconnector(10.0, probe_interval=30.0)  # a probe would take 15-30 s
    stop = threading.Event()
    lost = psycopg.errors.AdminShutdown("terminating connection due to administrator command")
    started = time.monotonic()
    assert reconnect.backoff(0, "dispatcher", lost, stop) == 1
    assert time.monotonic() - started < 2.0 and not reconnect.unreachable
    assert reconnect.recovered(1, "dispatcher") == 0 and reconnect.announcements == 0  # nothing to announce
    thread, took = _waiter(reconnect, psycopg.OperationalError("connection refused"), stop)  # its 6th try failed
    deadline = time.monotonic() + 5
    while not reconnect.unreachable and time.monotonic() < deadline:
        time.sleep(0.01)  # polling the condition the waiter sets
    assert reconnect.unreachable
    thread.join(0.5)
    assert thread.is_alive()  # waiting for a probe or an announcement, not retrying at once
    reconnect.recovered(0, "router")
    thread.join(5)
    assert took and took[0] < 5.0 and reconnect.announcements == 1


def test_waiting_loops_retry_at_once_when_one_gets_through():
    reconnect = Reconnector(10.0, probe_interval=30.0)  # a probe would take 15-30 s
    stop = threading.Event()
    waiters = [_waiter(reconnect, psycopg.OperationalError("connection refused"), stop) for _ in range(3)]
    deadline = time.monotonic() + 5
    while not reconnect.unreachable and time.monotonic() < deadline:
        time.sleep(0.01)  # polling the condition the waiters set
    assert reconnect.recovered(0, "router") == 0
    for thread, took in waiters:
        thread.join(5)
        assert took and took[0] < 2.0
    assert reconnect.announcements == 1 and not reconnect.unreachable


def test_other_errors_are_not_cut_short_by_an_announcement_but_by_stop():
    reconnect = Reconnector(10.0, rng=random.Random(3))
    stop = threading.Event()
    thread, took = _waiter(reconnect, ValueError("not a disconnect"), stop)  # 5th failure: 1.6-3.2 s
    reconnect._unreachable = True  # as after another loop's disconnect
    reconnect.recovered(1, "router")
    thread.join(0.5)
    assert thread.is_alive()
    stop.set()
    thread.join(2)
    assert took and took[0] < 1.5
