"""Logs under faults (issue 26, item 10): one line per state change, per-job repeats
summarised per round, broker client noise below WARNING.

Each test runs real relay processes (``python -m outbox.ops.cli run``, the CLI's own logging at
INFO, text format) and counts the lines of the relay's output written during the fault:

* a RabbitMQ exchange deleted for 5 s under a steady stream of events: one "broker
  unreachable" warning, one line when it is back, and no other WARNING or ERROR line (no
  aiormq traceback, no second pair as the forwarder's pause runs out);
* a relay SIGSTOPped past its lease while it holds 100 jobs or more, its jobs reaped and run
  by a second relay, then SIGCONTed: a few summary lines (a count and a few ids each), not a
  WARNING per job, and the counts in them add up to the jobs it lost.

Skipped with the reason when RabbitMQ or aio-pika is missing (the first test only).
"""

from __future__ import annotations

import asyncio
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL
from sqlalchemy.orm import Session

from outbox import publish_many
from outbox.testing import wait_for

from . import brokers, forward_app, slow_app
from .relays import Fleet

#: A line of the text format: ``time LEVEL logger [pid] message`` (outbox.telemetry.logs.TEXT_FORMAT).
LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (?P<level>[A-Z]+) (?P<logger>\S+) \[\d+\] (?P<message>.*)$")
LOUD = {"WARNING", "ERROR", "CRITICAL"}
#: WARNING lines no fault causes: the server's configuration, said once by a relay at its
#: first pruning round (the test server runs with autovacuum off).
UNRELATED = ("autovacuum is off",)
TIMEOUT = 60.0


def _lines(text: str) -> list[re.Match[str]]:
    """The log records of ``text`` (a traceback's lines belong to the record above them)."""
    return [m for m in map(LINE.match, text.splitlines()) if m]


def _loud(text: str) -> list[str]:
    """The WARNING, ERROR and CRITICAL lines of ``text`` but the :data:`UNRELATED` ones."""
    return [m.group(0) for m in _lines(text)
            if m.group("level") in LOUD and not any(u in m.group("message") for u in UNRELATED)]


@pytest.fixture
def fleet(tmp_path: Path, db_url: URL) -> Iterator[Fleet]:
    fleet = Fleet(tmp_path, db_url.render_as_string(hide_password=False), app="tests.acceptance.forward_app:app",
                  env={"FA_AMQP_URL": brokers.AMQP_URL, "FA_NATS_URL": brokers.NATS_URL})
    try:
        yield fleet
    finally:
        fleet.cleanup()


def _statuses(engine: sa.Engine, consumer: str) -> dict[str, int]:
    with engine.connect() as c:
        return dict(c.execute(sa.text("SELECT status, count(*) FROM outbox_jobs WHERE consumer = :c GROUP BY status"),
                              {"c": consumer}).all())


class Publisher(threading.Thread):
    """Publishes ``per_batch`` events of ``topic`` every ``interval`` seconds until stopped."""

    def __init__(self, engine: sa.Engine, topic: str, per_batch: int, interval: float) -> None:
        super().__init__(daemon=True)
        self.engine, self.topic, self.per_batch, self.interval = engine, topic, per_batch, interval
        self.published = 0
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.wait(self.interval):
            with Session(self.engine) as s, s.begin():
                publish_many(s, [{"topic": self.topic, "payload": {"n": self.published + i}}
                                 for i in range(self.per_batch)])
            self.published += self.per_batch

    def stop(self) -> int:
        self.halt.set()
        if self.is_alive():
            self.join(10)
        return self.published


def _exchange(queue: brokers.BoundQueue, action: str) -> None:
    """Delete the queue's exchange, or declare it again and bind the queue (``#``) as before."""
    async def act(channel: Any) -> None:
        if action == "delete":
            await channel.exchange_delete(queue.exchange)
            return
        exchange = await channel.declare_exchange(queue.exchange, "topic", durable=False, auto_delete=False)
        bound = await channel.declare_queue(queue.name, passive=True)
        await bound.bind(exchange, "#")

    asyncio.run(queue._call(act))


def test_an_exchange_deleted_for_five_seconds_logs_one_warning_and_one_line_back(engine, fleet):
    missing = brokers.rabbitmq_missing()
    if missing:
        pytest.skip(missing)
    queue = brokers.BoundQueue()
    publisher = Publisher(engine, forward_app.TOPIC, per_batch=20, interval=0.05)
    try:
        relay = fleet.start("--poll-interval", "0.2", env={"FA_SINK": "rabbitmq", "FA_EXCHANGE": queue.exchange})
        publisher.start()
        wait_for(lambda: _statuses(engine, forward_app.CONSUMER).get("done", 0) >= 200, timeout=TIMEOUT,
                 what="the forwarder to deliver")
        mark = len(relay.log)
        _exchange(queue, "delete")
        wait_for(lambda: "broker unreachable" in relay.log[mark:], timeout=TIMEOUT,
                 what="the relay to notice the exchange is gone")
        time.sleep(5.0)  # the outage lasts 5 s: its length, not a check (those wait on conditions)
        _exchange(queue, "declare")
        published = publisher.stop()
        wait_for(lambda: _statuses(engine, forward_app.CONSUMER) == {"done": published}, timeout=TIMEOUT,
                 what=f"all {published} forwarder jobs done")
        assert fleet.terminate(relay, 20) == 0, relay.log[-3000:]
        during = relay.log[mark:]
    finally:
        publisher.stop()
        queue.delete()
    records = _lines(during)
    unreachable = [m.group(0) for m in records if "broker unreachable" in m.group("message")]
    back = [m.group(0) for m in records if m.group("message").startswith(f"forwarder {forward_app.CONSUMER}: connected")]
    loud = _loud(during)
    print(f"{len(unreachable)} unreachable, {len(back)} back, {len(loud)} WARNING or ERROR lines in all:\n"
          + "\n".join(loud))
    assert len(unreachable) == 1, unreachable
    assert len(back) == 1, back
    assert loud == unreachable, loud
    assert "Traceback" not in during, during[-3000:]


def _stat(text: str, name: str) -> int:
    """The relay's counter ``name`` in its "relay stopped: ..." line in ``text`` (-1: none yet)."""
    stopped = re.search(r"relay stopped: .*", text)
    found = re.search(rf"\b{name}=(\d+)", stopped.group(0)) if stopped else None
    return int(found.group(1)) if found else -1


#: A summary line's count and its first consumer and id: "120 jobs (slow 120; ids 17, ...".
SUMMARY = re.compile(r"\b(\d+) jobs? \(\S+ \d+[,;].*\bids? \d+")


def _summarised(lines: list[str]) -> int:
    """The jobs the summary lines among ``lines`` count, together."""
    return sum(int(m.group(1)) for m in map(SUMMARY.search, lines) if m)


def _held(engine: sa.Engine) -> dict[int, int]:
    with engine.connect() as c:
        return dict(c.execute(sa.text("SELECT id, fence FROM outbox_jobs WHERE status = 'running'")).all())


def test_a_relay_paused_past_its_lease_summarises_its_lost_jobs_instead_of_a_warning_each(engine, fleet):
    fleet.app = "tests.acceptance.slow_app:app"
    flags = ("--default-lease", "2", "--reap-interval", "0.3", "--poll-interval", "0.5", "--concurrency", "20",
             "--prefetch", "100", "--shutdown-grace", "2")
    with Session(engine) as s, s.begin():
        publish_many(s, [{"topic": slow_app.TOPIC, "payload": {"n": n}} for n in range(400)])
    paused = fleet.start(*flags, env={"SA_WORK_MS": "1000"})
    held = wait_for(lambda: (h := _held(engine)) and len(h) >= 100 and h, timeout=TIMEOUT,
                    what="the relay to hold 100 jobs")
    paused.signal(signal.SIGSTOP)
    # All the paused relay's (it runs alone), once no statement it sent is still committing.
    held = wait_for(lambda: (a := _held(engine)) == (time.sleep(0.3) or _held(engine)) and a, timeout=TIMEOUT,
                    what="the paused relay's claims to settle")
    other = fleet.start(*flags, env={"SA_WORK_MS": "1"})
    wait_for(lambda: _statuses(engine, slow_app.CONSUMER) == {"done": 400}, timeout=TIMEOUT,
             what="the other relay to reap and finish every job")
    mark = len(paused.log)
    paused.signal(signal.SIGCONT)
    # Its handlers (1 s each) return, its heartbeat and starter run: it notices that every
    # claim it held is gone, and says so for each in a summary (on 7464870: a WARNING per job).
    try:
        wait_for(lambda: _summarised(_loud(paused.log[mark:])) >= len(held), timeout=30,
                 what=f"the resumed relay to report the {len(held)} claims it lost")
    finally:
        paused_exit = fleet.terminate(paused, 20)
        assert fleet.terminate(other, 20) == 0, other.log[-3000:]
        after = paused.log[mark:]
        loud = _loud(after)
        print(f"held {len(held)} jobs at SIGSTOP; {len(loud)} WARNING or ERROR lines after SIGCONT, "
              f"{_summarised(loud)} jobs in summaries:\n" + "\n".join(loud[:12]))
    assert paused_exit == 0, after[-3000:]
    stale = _stat(after, "stale")  # every lost claim's report, dropped
    assert len(held) >= 100 and stale >= len(held), (len(held), stale)
    # Per round, not per job: a handful of lines for 100 jobs and more; each names how many
    # and a few ids, and every lost claim is counted in exactly one of them.
    assert len(loud) <= 6, f"{len(loud)} lines:\n" + "\n".join(loud[:20])
    assert all(SUMMARY.search(line) for line in loud), loud
    assert _summarised(loud) == stale, loud
