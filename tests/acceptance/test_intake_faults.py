"""The intake under real process kills (issue 31): relay processes taking orders in from a
real broker (JetStream, RabbitMQ) are SIGKILLed in the windows the intake's exactly-once
claim is about (:mod:`outbox.intake`, module notes), and every order the sender committed
to the broker must have exactly one effect on the receiving side.

The relays run :mod:`tests.acceptance.intake_app`: intake ``orders`` and a transactional
subscriber counting its runs per order. A relay asked to (``INTAKE_FAULT``) kills itself

1. after a batch's transaction committed, before its acknowledgement (the source's ``ack``
   wrapped): the broker delivers the batch again and the next relay drops every copy;
2. after a batch's statements ran, before its commit (``outbox.relay.intake.take_in``
   wrapped): the transaction dies with the connection, nothing is acknowledged, the next
   relay takes the batch in;

and, with no wrapper at all,

3. relays are SIGKILLed from outside at random moments while the sender publishes;
4. the sender re-sends (a sender that crashed after its broker's acknowledgement sends again:
   new broker message ids, the same ``Outbox-Idempotency-Key``), in (3) as it goes and after
   a crash of kind (1).

After the kills a fresh relay (no fault) runs until every order has its effect and the
broker holds nothing unacknowledged; then, SIGTERMed, it must exit 0, and: every order ran
once, ``outbox_intake`` has one row per order naming its event, there is one event and one
done job per order, every killed relay's exit status is -9, and the fresh relay's stop line
(``relay stopped: ... intake_taken=N, intake_duplicates=N ...``) counts what it took in and
dropped. JetStream's ``ack_wait`` is 1 s, so redeliveries come quickly. Each test makes its
own stream (and durable consumer) or exchange and queue, and deletes them; a broker that is
missing skips its tests, saying why.
"""

from __future__ import annotations

import asyncio
import random
import re
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL

from outbox.testing import wait_for
from tests.integration.intake_helpers import EFFECTS_DDL, effects, forwarded

from . import brokers, intake_app
from .relays import Fleet, RelayProcess

ORDERS = 100
BATCH = 10
#: The batch (1, 2, ...) a faulted relay dies on: earlier ones are committed and acknowledged.
KILL_AT = 3
ACK_WAIT = 1
TIMEOUT = 60.0
FLAGS = ("--default-lease", "2", "--reap-interval", "0.3", "--concurrency", "4", "--poll-interval", "0.2",
         "--backoff-base", "0.05", "--backoff-cap", "0.3", "--reconnect-max", "1", "--shutdown-grace", "3")

Messages = list[tuple[bytes, dict[str, str]]]


class JetStreamSide:
    """A stream of the test's own (subjects ``<name>.>``) and the durable consumer the relays share."""

    kind = "jetstream"

    def __init__(self) -> None:
        self.stream = brokers.Stream("ik")
        self.durable = "d" + uuid.uuid4().hex[:8]

    def env(self) -> dict[str, str]:
        return {"IA_SOURCE": self.kind, "IA_NATS_URL": brokers.NATS_URL, "IA_STREAM": self.stream.name,
                "IA_DURABLE": self.durable, "IA_ACK_WAIT": str(ACK_WAIT), "IA_BATCH": str(BATCH)}

    def send(self, chunks: list[Messages], pause: float = 0.0) -> None:
        """Publish each chunk's (body, headers), each with a Nats-Msg-Id of its own, waiting
        for each PubAck, ``pause`` seconds between chunks."""
        async def send(js: Any) -> None:
            for chunk in chunks:
                for body, headers in chunk:
                    await js.publish(f"{self.stream.name}.orders", body,
                                     headers={**headers, "Nats-Msg-Id": uuid.uuid4().hex})
                await asyncio.sleep(pause)

        asyncio.run(brokers.Stream._call(send))

    def outstanding(self) -> int:
        """Messages the durable consumer has not had acknowledged: not yet delivered, or
        delivered and not acknowledged."""
        async def info(js: Any) -> int:
            ci = await js.consumer_info(self.stream.name, self.durable)
            return int(ci.num_pending) + int(ci.num_ack_pending)

        return int(asyncio.run(brokers.Stream._call(info)))

    def delete(self) -> None:
        self.stream.delete()


class RabbitMQSide:
    """A topic exchange and a queue bound to it, of the test's own."""

    kind = "rabbitmq"

    def __init__(self) -> None:
        self.queue = brokers.BoundQueue()

    def env(self) -> dict[str, str]:
        return {"IA_SOURCE": self.kind, "IA_AMQP_URL": brokers.AMQP_URL, "IA_QUEUE": self.queue.name,
                "IA_PREFETCH": str(3 * BATCH), "IA_BATCH": str(BATCH)}

    def send(self, chunks: list[Messages], pause: float = 0.0) -> None:
        """Publish each chunk's (body, headers) with a message_id of its own, waiting for
        each publisher confirm, ``pause`` seconds between chunks."""
        import aio_pika

        async def send(channel: Any) -> None:
            exchange = await channel.get_exchange(self.queue.exchange)
            for chunk in chunks:
                for body, headers in chunk:
                    await exchange.publish(aio_pika.Message(body, headers=headers, message_id=uuid.uuid4().hex),
                                           routing_key="orders")
                await asyncio.sleep(pause)

        asyncio.run(brokers.BoundQueue._call(send))

    def outstanding(self) -> int:
        """Messages ready in the queue (with no consumer connected: every one not acknowledged)."""
        return self.queue.count()

    def delete(self) -> None:
        self.queue.delete()


_NATS, _RABBITMQ = brokers.nats_missing(), brokers.rabbitmq_missing()
SIDES = [pytest.param(JetStreamSide, id="jetstream", marks=pytest.mark.skipif(_NATS is not None, reason=_NATS or "")),
         pytest.param(RabbitMQSide, id="rabbitmq",
                      marks=pytest.mark.skipif(_RABBITMQ is not None, reason=_RABBITMQ or ""))]


class Receiver:
    """The receiving side: its database, its relays, and the checks every test ends with."""

    def __init__(self, engine: sa.Engine, fleet: Fleet, side: JetStreamSide | RabbitMQSide) -> None:
        self.engine = engine
        self.fleet = fleet
        self.side = side

    def rows(self) -> set[str]:
        """Identities recorded by intake ``orders`` (committed)."""
        with self.engine.connect() as c:
            return set(c.execute(sa.text("SELECT identity FROM outbox_intake WHERE source = :s"),
                                 {"s": intake_app.INTAKE}).scalars())

    def events(self) -> int:
        with self.engine.connect() as c:
            return int(c.execute(sa.text("SELECT count(*) FROM outbox_events WHERE topic = 'order.placed'"))
                       .scalar_one())

    def crash(self, fault: str) -> tuple[RelayProcess, list[str]]:
        """Run a relay that SIGKILLs itself at ``fault`` on batch :data:`KILL_AT`; return it
        (dead, exit status -9) and the identities of the batch it died on."""
        record = self.fleet.directory / f"killed{len(self.fleet.relays)}.txt"
        relay = self.fleet.start(env={"INTAKE_FAULT": fault, "INTAKE_FAULT_AT": str(KILL_AT),
                                      "INTAKE_FAULT_RECORD": str(record)}, wait=False)
        relay.killed = True  # on purpose, by itself
        try:
            code = relay.proc.wait(TIMEOUT)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the relay did not kill itself at {fault} of batch {KILL_AT}:\n"
                                 f"{relay.log[-3000:]}") from None
        assert code == -signal.SIGKILL, f"the faulted relay exited {code}:\n{relay.log[-3000:]}"
        assert relay.started() and "relay stopped" not in relay.log, relay.log[-3000:]
        batch = record.read_text().split()
        assert batch, "the faulted relay recorded no batch"
        return relay, batch

    def kill(self, relay: RelayProcess) -> None:
        self.fleet.kill(relay)
        assert relay.proc.returncode == -signal.SIGKILL, relay.proc.returncode

    def unacknowledged_at_least(self, count: int) -> None:
        """With no relay running, the broker holds at least ``count`` messages not
        acknowledged (RabbitMQ requeues a dead connection's deliveries a moment after it goes)."""
        seen: list[int] = []
        try:
            wait_for(lambda: seen.append(self.side.outstanding()) or seen[-1] >= count, timeout=10, interval=0.1,
                     what=f"the broker to hold {count} unacknowledged messages")
        except AssertionError as exc:
            raise AssertionError(f"{exc}: it holds {seen[-1]}; a message was acknowledged before its commit") from None

    def finish(self, relay: RelayProcess) -> dict[str, int]:
        """Wait until every order has its effect and the broker holds nothing unacknowledged,
        SIGTERM ``relay`` (exit 0), check every invariant; return its stop line's intake stats."""
        orders = set(range(ORDERS))

        def done() -> bool:
            return set(effects(self.engine)) == orders and len(self.rows()) == ORDERS and self.side.outstanding() == 0

        try:
            wait_for(done, timeout=TIMEOUT, interval=0.2, what="every order's effect and an empty broker")
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {len(effects(self.engine))} effects, {len(self.rows())} intake rows, "
                                 f"{self.side.outstanding()} unacknowledged\n{self.fleet.logs()[-6000:]}") from None
        self.fleet.check_count()
        assert self.fleet.terminate(relay, 30) == 0, relay.log[-3000:]
        for bad in ("Traceback", "stopped by an unexpected error"):
            assert bad not in self.fleet.logs(), self.fleet.logs()[-6000:]
        stopped = re.search(r"relay stopped: (.*)", relay.log)
        assert stopped, relay.log[-3000:]
        stats = {k: int(v) for k, v in re.findall(r"(intake_\w+)=(\d+)", stopped.group(1))}
        assert {"intake_taken", "intake_duplicates", "intake_rejected"} <= set(stats), stopped.group(0)

        assert self.side.outstanding() == 0  # the stopped relay acknowledged all it took
        runs = effects(self.engine)
        assert set(runs) == orders and {o for o, n in runs.items() if n != 1} == set(), \
            {o: n for o, n in runs.items() if n != 1}
        with self.engine.connect() as c:
            rows = c.execute(sa.text("SELECT identity, event_id, problem FROM outbox_intake WHERE source = :s"),
                             {"s": intake_app.INTAKE}).all()
            jobs = dict(c.execute(sa.text("SELECT status, count(*) FROM outbox_jobs WHERE consumer = 'book' "
                                          "GROUP BY status")).all())
        assert sorted(r.identity for r in rows) == sorted(f"fwd:{o}" for o in orders)
        assert all(r.event_id is not None and r.problem is None for r in rows)
        assert len({r.event_id for r in rows}) == ORDERS and self.events() == ORDERS
        assert jobs == {"done": ORDERS}, jobs
        assert stats["intake_rejected"] == 0
        assert all(r.proc.returncode == -signal.SIGKILL for r in self.fleet.relays if r is not relay)
        return stats


@pytest.fixture(params=SIDES)
def receiver(request: pytest.FixtureRequest, tmp_path: Path, db_url: URL, engine: sa.Engine) -> Iterator[Receiver]:
    side = request.param()
    with engine.begin() as c:
        c.exec_driver_sql(EFFECTS_DDL)
    fleet = Fleet(tmp_path, db_url.render_as_string(hide_password=False), app="tests.acceptance.intake_app:app",
                  base_flags=FLAGS, env=side.env())
    try:
        yield Receiver(engine, fleet, side)
    finally:
        fleet.cleanup()
        side.delete()


def orders(numbers: range | list[int]) -> Messages:
    return [forwarded(n) for n in numbers]


def test_sigkill_after_the_commit_before_the_ack(receiver: Receiver) -> None:
    """The batch committed, the broker never got its acknowledgement: it delivers the batch
    again to the next relay, which drops every copy."""
    receiver.side.send([orders(range(ORDERS))])
    _, batch = receiver.crash("after_commit")
    committed = receiver.rows()
    assert set(batch) <= committed, "the relay died on a batch that had not committed"
    assert receiver.events() == len(committed)
    # Acknowledged: at most the batches before the one it died on.
    receiver.unacknowledged_at_least(ORDERS - (len(committed) - len(batch)))
    stats = receiver.finish(receiver.fleet.start())
    print(f"{receiver.side.kind}: killed batch {len(batch)}, committed before {len(committed)}, then {stats}")
    assert stats["intake_taken"] == ORDERS - len(committed)
    assert stats["intake_duplicates"] >= len(batch) > 0


def test_sigkill_after_the_statements_before_the_commit(receiver: Receiver) -> None:
    """The batch's statements ran in its open transaction; the process dies: nothing of the
    batch is committed or acknowledged, and the next relay takes it in."""
    receiver.side.send([orders(range(ORDERS))])
    _, batch = receiver.crash("before_commit")
    committed = receiver.rows()
    assert len(batch) > 0 and not set(batch) & committed, "a batch whose relay died before its commit is recorded"
    assert receiver.events() == len(committed)
    receiver.unacknowledged_at_least(ORDERS - len(committed))
    stats = receiver.finish(receiver.fleet.start())
    print(f"{receiver.side.kind}: killed batch {len(batch)}, committed before {len(committed)}, then {stats}")
    assert stats["intake_taken"] == ORDERS - len(committed)


def test_sigkill_from_outside_at_random_moments_while_the_sender_sends_and_resends(receiver: Receiver) -> None:
    """The sender publishes the orders in chunks and re-sends a few of each previous chunk
    (new broker ids); meanwhile relays are SIGKILLed at random moments, each once it has taken
    something in, and replaced."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    print(f"{receiver.side.kind}: seed {seed}")  # shown with a failure
    chunk = 5
    chunks: list[Messages] = []
    resent = 0
    for start in range(0, ORDERS, chunk):
        again = rng.sample(range(max(0, start - chunk), start), k=min(start, 2))
        resent += len(again)
        chunks.append(orders(again) + orders(range(start, start + chunk)))  # the last message is a new order
    relay = receiver.fleet.start()
    sender = threading.Thread(target=receiver.side.send, args=(chunks, 0.3), daemon=True)
    sender.start()
    kills = 0
    while sender.is_alive() and kills < 3:
        before = len(receiver.rows())
        wait_for(lambda: len(receiver.rows()) > before or not sender.is_alive(), timeout=TIMEOUT, interval=0.02,
                 what="the relay to take something in")
        time.sleep(rng.uniform(0.0, 0.6))
        receiver.kill(relay)
        kills += 1
        relay = receiver.fleet.start()
    sender.join(TIMEOUT)
    assert kills >= 2, f"only {kills} kills landed while the sender sent"
    stats = receiver.finish(relay)
    print(f"{receiver.side.kind}: {kills} kills, {resent} re-sent, then {stats}")


def test_the_sender_resends_after_a_relay_died_between_commit_and_ack(receiver: Receiver) -> None:
    """A relay dies after a commit, before the ack; then the sender, after its own crash,
    re-sends the first 60 orders (some taken in, some in the unacknowledged batch, some not
    taken yet) with new broker ids, and goes on. Each re-send and each redelivered copy is
    dropped by the next relay."""
    receiver.side.send([orders(range(ORDERS - 1))])
    _, batch = receiver.crash("after_commit")
    committed = receiver.rows()
    assert set(batch) <= committed
    again = list(range(60))
    assert len(committed) < len(again)
    receiver.side.send([orders(again) + orders([ORDERS - 1])])
    stats = receiver.finish(receiver.fleet.start())
    print(f"{receiver.side.kind}: killed batch {len(batch)}, committed before {len(committed)}, "
          f"re-sent {len(again)}, then {stats}")
    assert stats["intake_taken"] == ORDERS - len(committed)
    assert stats["intake_duplicates"] >= len(batch) + len(again)
