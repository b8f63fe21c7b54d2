"""Forwarders under a crash (issue 11): a relay process dies after the broker acknowledged a
batch and before any of that batch's completions was written, the window a forwarder's
crash safety is about (architecture notes, "Forwarding").

The relay runs :mod:`tests.acceptance.forward_app`, whose sink is the real one (JetStream,
RabbitMQ) with ``send_many`` extended: after its third acknowledged batch it records the
batch's message ids and SIGKILLs its own process. No hook in the product: the kill lands
between ``send_many`` returning and the forwarder posting the outcomes. The lease is short
(2 s), so a second relay of the same application (no kill) has the reaper hand the killed
relay's jobs out again and sends them again, with the same message ids, until every job is
done. Then:

* JetStream deduplicates by ``Nats-Msg-Id``: the stream holds exactly one message per event,
  and the second relay's stats count the re-sent ones the stream answered as duplicates;
* RabbitMQ does not: the queue holds every event, the re-sent ones twice, each copy with
  its event's ``message_id``, so a consumer can drop them.

Each test makes its own stream or exchange and queue and deletes them; skipped with the
reason when the broker or its client library is missing.
"""

from __future__ import annotations

import re
import signal
import subprocess
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL
from sqlalchemy.orm import Session

from outbox import publish_many
from outbox.testing import wait_for

from . import brokers, forward_app, kafka_broker
from .proxy import TcpProxy
from .relays import Fleet

EVENTS = 200
#: A forwarder's batch is at most the forwarding window: 200 events make ten batches or more.
WINDOW = 20
KILL_AT = 3
FLAGS = ("--default-lease", "2", "--reap-interval", "0.3", "--concurrency", "2", "--poll-interval", "1",
         "--backoff-base", "0.05", "--backoff-cap", "0.3", "--shutdown-grace", "3")
TIMEOUT = 60.0


@dataclass
class Crash:
    """What a crash-and-recover run left: the events, the message ids the killed relay's last
    batch had acknowledged, the recovering relay's ``forward_duplicates`` stat, and every
    forwarder job's attempts by event id."""

    event_ids: list[int]
    killed_batch: list[str]
    duplicates: int
    attempts: dict[int, int]

    def sent_again(self) -> set[str]:
        """Message ids of the jobs the reaper handed out again (attempts 2 or more)."""
        return {f"{forward_app.CONSUMER}:{e}" for e, a in self.attempts.items() if a >= 2}


@pytest.fixture
def fleet(tmp_path: Path, db_url: URL) -> Iterator[Fleet]:
    fleet = Fleet(tmp_path, db_url.render_as_string(hide_password=False), app="tests.acceptance.forward_app:app",
                  base_flags=FLAGS, env={"OUTBOX_FORWARD_WINDOW": str(WINDOW), "FA_NATS_URL": brokers.NATS_URL,
                                         "FA_AMQP_URL": brokers.AMQP_URL})
    try:
        yield fleet
    finally:
        fleet.cleanup()


def _jobs(engine: sa.Engine) -> dict[int, tuple[str, int]]:
    with engine.connect() as c:
        return {r.event_id: (r.status, r.attempts) for r in c.execute(sa.text(
            "SELECT event_id, status, attempts FROM outbox_jobs WHERE consumer = :c"), {"c": forward_app.CONSUMER})}


def _crash_then_recover(engine: sa.Engine, fleet: Fleet, env: dict[str, str]) -> Crash:
    ids: list[int] = []
    for start in range(0, EVENTS, 50):
        with Session(engine) as s, s.begin():
            ids += publish_many(s, [{"topic": forward_app.TOPIC, "payload": {"n": n, "name": "caf\u00e9"},
                                     "key": f"order:{n}"} for n in range(start, start + 50)])
    record = fleet.directory / "killed_batch.txt"
    crashing = fleet.start(env={**env, "FA_KILL_AT": str(KILL_AT), "FA_KILL_RECORD": str(record)}, wait=False)
    crashing.killed = True  # on purpose, by itself
    try:
        code = crashing.proc.wait(TIMEOUT)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the relay did not kill itself at batch {KILL_AT}:\n{crashing.log[-3000:]}") from None
    assert code == -signal.SIGKILL, f"the crashing relay exited {code}:\n{crashing.log[-3000:]}"
    killed_batch = record.read_text().split()
    assert killed_batch, "the crashing relay recorded no acknowledged message"
    jobs = _jobs(engine)
    in_window = [jobs[int(k.split(":")[1])] for k in killed_batch]
    # The broker had acknowledged them; no completion was written: the crash window.
    assert all(status == "running" for status, _ in in_window), in_window
    assert sum(status == "done" for status, _ in jobs.values()) < EVENTS

    recovering = fleet.start(env=env)
    wait_for(lambda: all(s == "done" for s, _ in _jobs(engine).values()) and len(_jobs(engine)) == EVENTS,
             timeout=TIMEOUT, what=f"all {EVENTS} forwarder jobs done")
    assert fleet.terminate(recovering, 20) == 0, recovering.log[-3000:]
    stopped = re.search(r"relay stopped: .*", recovering.log)
    assert stopped, recovering.log[-3000:]
    duplicates = re.search(r"forward_duplicates=(\d+)", stopped.group(0))
    for bad in ("Traceback", "forwarder fwd: sending a batch"):
        assert bad not in recovering.log, recovering.log[-3000:]
    return Crash(ids, killed_batch, int(duplicates.group(1)) if duplicates else 0,
                 {e: a for e, (_, a) in _jobs(engine).items()})


def test_jetstream_keeps_one_copy_per_event_when_a_relay_dies_between_pubacks_and_completions(engine, fleet):
    missing = brokers.nats_missing()
    if missing:
        pytest.skip(missing)
    stream = brokers.Stream("fa")
    try:
        crash = _crash_then_recover(engine, fleet, {"FA_SINK": "jetstream", "FA_STREAM": stream.name})
        messages = stream.messages()
    finally:
        stream.delete()
    print(f"killed batch {len(crash.killed_batch)}, handed out again {len(crash.sent_again())}, "
          f"duplicates {crash.duplicates}, stored {len(messages)}")
    assert len(messages) == EVENTS
    assert len({m.message_id for m in messages}) == EVENTS
    assert sorted(int(m.headers["Outbox-Event-Id"]) for m in messages) == sorted(crash.event_ids)
    assert all(m.message_id == f"fwd:{m.headers['Outbox-Event-Id']}" for m in messages)
    # The killed batch was handed out again (attempt 2) and sent again; the stream said
    # "duplicate" to each of those re-sends, and stored nothing twice.
    assert set(crash.killed_batch) <= crash.sent_again()
    assert len(crash.killed_batch) <= crash.duplicates <= len(crash.sent_again()), (crash.duplicates, crash)


def test_rabbitmq_holds_every_event_and_resends_carry_the_same_message_id_when_a_relay_dies(engine, fleet):
    missing = brokers.rabbitmq_missing()
    if missing:
        pytest.skip(missing)
    queue = brokers.BoundQueue()
    try:
        crash = _crash_then_recover(engine, fleet, {"FA_SINK": "rabbitmq", "FA_EXCHANGE": queue.exchange})
        wait_for(lambda: queue.count() >= EVENTS, timeout=TIMEOUT, what="the queue to hold every event")
        messages = queue.messages()
    finally:
        queue.delete()
    copies = Counter(m.message_id for m in messages)
    print(f"killed batch {len(crash.killed_batch)}, handed out again {len(crash.sent_again())}, "
          f"stored {len(messages)} for {EVENTS} events")
    assert set(copies) == {f"fwd:{e}" for e in crash.event_ids}  # every event, by its job's idempotency key
    assert all(m.message_id == f"fwd:{m.headers['Outbox-Event-Id']}" for m in messages)
    # RabbitMQ keeps the re-sends: the killed batch's messages are there twice, and only
    # messages of jobs handed out again are.
    twice = {k for k, n in copies.items() if n > 1}
    assert set(crash.killed_batch) <= twice <= crash.sent_again(), (twice, crash.killed_batch)
    assert all(n <= 2 for n in copies.values()), copies.most_common(3)
    assert len(messages) > EVENTS
    assert crash.duplicates == 0  # no broker-side deduplication to report


def test_kafka_holds_every_event_and_resends_carry_the_same_event_id_when_a_relay_dies(engine, fleet, tmp_path):
    """Kafka's idempotent producer drops a duplicate only within one producer session: the
    recovering relay's producer is another, so the killed batch's records are stored twice,
    each copy with its event's ``Outbox-Event-Id`` (the sink's notes). Read back keeping the
    first copy of each event id, each key's records are in commit order."""
    missing = kafka_broker.kafka_missing()
    if missing:
        pytest.skip(missing)
    broker = kafka_broker.Tansu(log=tmp_path / "tansu.log")
    try:
        topic = broker.create_topic(3)
        crash = _crash_then_recover(engine, fleet, {"FA_SINK": "kafka", "FA_KAFKA_BOOTSTRAP": broker.bootstrap,
                                                    "FA_KAFKA_TOPIC": topic})
        records = broker.read(topic, EVENTS + len(crash.killed_batch))
    finally:
        broker.stop()
    copies = Counter(r.headers["Outbox-Idempotency-Key"] for r in records)
    print(f"killed batch {len(crash.killed_batch)}, handed out again {len(crash.sent_again())}, "
          f"stored {len(records)} for {EVENTS} events")
    assert set(copies) == {f"fwd:{e}" for e in crash.event_ids}  # every event
    assert all(r.headers["Outbox-Idempotency-Key"] == f"fwd:{r.headers['Outbox-Event-Id']}" for r in records)
    twice = {k for k, n in copies.items() if n > 1}
    assert set(crash.killed_batch) <= twice <= crash.sent_again(), (twice, crash.killed_batch)
    assert all(n <= 2 for n in copies.values()), copies.most_common(3)
    first: dict[bytes | None, list[int]] = {}
    kept: set[str] = set()
    for r in records:  # partition by partition, in offset order
        if r.headers["Outbox-Idempotency-Key"] not in kept:
            kept.add(r.headers["Outbox-Idempotency-Key"])
            first.setdefault(r.key, []).append(int(r.headers["Outbox-Event-Id"]))
    assert all(order == sorted(order) for order in first.values())


# --------------------------------------------------------------------------- paused past the lease
#
# Issue 26, items 2 and 9 (b): a relay that is paused past its lease while the broker is slow to
# acknowledge. Relay A forwards through a proxy that passes A's messages to the broker at once
# but holds the broker's answers (the broker stores each message; A waits for its
# acknowledgement). With A's claims in hand (some sent, the rest waiting: behind the first
# messages, for room in the forwarding window, or for room in JetStream's ``max_pending``), A is
# SIGSTOPped; relay B reaps A's claims once their leases have run out and delivers every event.
# Then the broker's answers go through and A is SIGCONTed. A must send nothing more: every claim
# it still held has run out by the deadline it knows (DESIGN 4: a lost lease drops a result;
# here the result is a message). And while B delivers, each job's attempts equal the sends made
# for it: a claim A never handed to the broker cost no attempt (README: "attempts count starts,
# not claims").

PAUSED_EVENTS = 20
PAUSED_LEASE = 3.0
PAUSED_FLAGS = ("--default-lease", str(PAUSED_LEASE), "--reap-interval", "0.3", "--concurrency", "8",
                "--poll-interval", "0.5", "--shutdown-grace", "3", "--metrics-port", "0")
#: The outcomes that end a claim in ``outbox_jobs_total`` (each claim ends in one of them).
FINAL_OUTCOMES = ("done", "retried", "dead", "cancelled", "stale", "released", "snoozed")
_METRIC = re.compile(r'^outbox_jobs_total\{consumer="(?P<consumer>[^"]*)",outcome="(?P<outcome>[^"]*)"\} (?P<n>\S+)$',
                     re.MULTILINE)


def _outcomes(relay: Any) -> dict[str, float]:
    """``relay``'s ``outbox_jobs_total`` of the forwarder, by outcome (its own /metrics)."""
    port = re.search(r"serving Prometheus metrics on http://127\.0\.0\.1:(\d+)/metrics", relay.log)
    assert port, relay.log[-3000:]
    with urllib.request.urlopen(f"http://127.0.0.1:{port.group(1)}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {m["outcome"]: float(m["n"]) for m in _METRIC.finditer(text) if m["consumer"] == forward_app.CONSUMER}


def _steady(count: Callable[[], int], seconds: float = 1.0) -> Callable[[], int | None]:
    """A condition for ``wait_for``: the value of ``count()`` once it is above zero and has not
    changed for ``seconds``."""
    seen = {"value": -1, "since": time.monotonic()}

    def check() -> int | None:
        value = count()
        if value != seen["value"]:
            seen.update(value=value, since=time.monotonic())
            return None
        return value if value > 0 and time.monotonic() - seen["since"] >= seconds else None

    return check


@pytest.mark.parametrize("broker, window, max_pending", [
    ("rabbitmq", 500, None),  # the case: every claim fits the forwarding window
    ("rabbitmq", 12, None),  # part of the claim waits for room in the window
    ("jetstream", 500, 4),  # part of the claim waits for room in JetStream's max_pending
], ids=["rabbitmq-window-500", "rabbitmq-window-12", "jetstream-max-pending-4"])
def test_a_relay_paused_past_its_lease_sends_nothing_for_the_claims_it_lost(engine, tmp_path, db_url, broker,
                                                                           window, max_pending):
    missing = brokers.rabbitmq_missing() if broker == "rabbitmq" else brokers.nats_missing()
    if missing:
        pytest.skip(missing)
    url = brokers.AMQP_URL if broker == "rabbitmq" else brokers.NATS_URL
    target = urlsplit(url)
    proxy = TcpProxy((target.hostname or "127.0.0.1", target.port or (5672 if broker == "rabbitmq" else 4222)))
    proxy.start()
    through_proxy = urlunsplit((target.scheme, f"{target.netloc.rpartition('@')[0]}@127.0.0.1:{proxy.port}"
                                if "@" in target.netloc else f"127.0.0.1:{proxy.port}", target.path, "", ""))
    queue = stream = tap = None
    if broker == "rabbitmq":
        queue = brokers.BoundQueue()
        env = {"FA_SINK": "rabbitmq", "FA_EXCHANGE": queue.exchange, "FA_AMQP_URL": brokers.AMQP_URL}
        proxied = {"FA_AMQP_URL": through_proxy}
    else:
        stream = brokers.Stream("fp")
        tap = brokers.Tap(stream.name + ".>")
        env = {"FA_SINK": "jetstream", "FA_STREAM": stream.name, "FA_NATS_URL": brokers.NATS_URL,
               "FA_MAX_PENDING": str(max_pending)}
        proxied = {"FA_NATS_URL": through_proxy}
    drained: Counter[str] = Counter()

    def sent() -> int:
        """Messages the broker was sent so far (RabbitMQ: its queue, which keeps every copy, plus
        those taken off it; JetStream: what the tap saw)."""
        return (queue.count() + sum(drained.values())) if queue is not None else len(tap.ids())

    fleet = Fleet(tmp_path, db_url.render_as_string(hide_password=False), app="tests.acceptance.forward_app:app",
                  base_flags=PAUSED_FLAGS, env={**env, "FA_TIMEOUT": "60"})
    try:
        paused = fleet.start(env={**proxied, "OUTBOX_FORWARD_WINDOW": str(window)})
        wait_for(lambda: "forwarder fwd: connected" in paused.log, timeout=TIMEOUT, what="relay A's sink connected")
        proxy.freeze(to_server=False)  # the broker stores what A sends; its answers wait
        with Session(engine) as s, s.begin():
            ids = publish_many(s, [{"topic": forward_app.TOPIC, "payload": {"n": n}} for n in range(PAUSED_EVENTS)])
        wait_for(lambda: _jobs(engine) and all(st == "running" for st, _ in _jobs(engine).values()),
                 timeout=TIMEOUT, what="relay A to claim every job")
        before_pause = wait_for(_steady(sent), timeout=TIMEOUT, what="relay A to send what it can")
        paused.signal(signal.SIGSTOP)

        fleet.start()  # relay B, straight to the broker: reaps A's claims once their leases run out
        wait_for(lambda: len(_jobs(engine)) == PAUSED_EVENTS and all(st == "done" for st, _ in _jobs(engine).values()),
                 timeout=TIMEOUT, what="relay B to deliver every event")
        attempts = {f"{forward_app.CONSUMER}:{e}": a for e, (_, a) in _jobs(engine).items()}
        if queue is not None:
            drained.update(m.message_id for m in queue.messages())
            copies = Counter(drained)
        else:
            copies = Counter(wait_for(lambda: (got := tap.ids()) and len(set(got)) == PAUSED_EVENTS and got,
                                      timeout=TIMEOUT, what="the tap to see every event"))
        sent_while_paused = sum(copies.values())

        proxy.thaw()
        paused.signal(signal.SIGCONT)
        wait_for(lambda: (o := _outcomes(paused)) and sum(o.get(k, 0) for k in FINAL_OUTCOMES) >= o.get("claimed", 1),
                 timeout=TIMEOUT, what="relay A to account for every claim it held")
        late = sent() - sent_while_paused
        if tap is not None:
            late = len(tap.ids()) - sent_while_paused
        fleet.terminate_all()
    finally:
        fleet.cleanup()
        proxy.stop()
        if queue is not None:
            queue.delete()
        if tap is not None:
            tap.close()
        if stream is not None:
            stream.delete()
    print(f"{broker}, window {window}: A sent {before_pause} before the pause; {sent_while_paused} sends for "
          f"{PAUSED_EVENTS} events once B delivered (copies per event: {sorted(Counter(copies.values()).items())}); "
          f"attempts per event {sorted(Counter(attempts.values()).items())}; A sent {late} after SIGCONT")
    assert set(copies) == {f"{forward_app.CONSUMER}:{e}" for e in ids}
    # A sent what it sent before the pause, B one copy of each event: nothing else.
    assert sent_while_paused == PAUSED_EVENTS + before_pause
    assert late == 0, f"relay A sent {late} messages for claims it had lost"
    if broker == "rabbitmq":
        # Each attempt charged is a message sent (by A before the pause, then by B): a claim A
        # never handed to the broker cost no attempt.
        assert {k: attempts[k] for k in copies} == dict(copies)
