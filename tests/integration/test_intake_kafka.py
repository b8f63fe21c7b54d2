"""Intake from Kafka topics in a consumer group on a real Kafka-protocol broker (Tansu,
``tests.acceptance.kafka_broker``, started per test) into a real PostgreSQL: one effect per
record the sender committed, through re-sends and two relays in one group, a relay that
dies between its commit and its offset commit (the records are read again from the
committed offsets and dropped), and poison records. Each test makes its own topic and group.

Tansu answers a JoinGroup only after half the session timeout (22.5 s at librdkafka's
default of 45 s), so the sources here run with a session timeout of 6 s."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from outbox import Outbox
from outbox.intake import SourceUnavailableError
from outbox.testing import wait_for
from tests.acceptance.kafka_broker import Tansu, kafka_missing

from .helpers import running_relay, running_relays
from .intake_helpers import counting_subscriber, effects, forwarded, intake_rows

confluent_kafka = pytest.importorskip("confluent_kafka",
                                      reason="confluent-kafka is not installed (pip install 'outbox-relay[kafka]')")

from outbox.intake.kafka import KafkaSource  # noqa: E402 (after the skip)

_why = kafka_missing()
pytestmark = pytest.mark.skipif(_why is not None, reason=_why or "")

TIMEOUT = 90.0
#: A session timeout Tansu makes joins of 3 s with (see the module notes).
FAST_GROUP = {"session.timeout.ms": 6000, "heartbeat.interval.ms": 500}


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Tansu]:
    b = Tansu(log=tmp_path / "tansu.log")
    yield b
    b.stop()


def send(broker: Tansu, topic: str, records: list[tuple[bytes, dict[str, str]]], key: str | None = None) -> None:
    """Produce each (value, headers) to ``topic`` as outbox's Kafka sink does: the event's key
    (its ``Outbox-Key`` header) as the record key, unless ``key`` is given."""
    producer = confluent_kafka.Producer({"bootstrap.servers": broker.bootstrap, "enable.idempotence": True,
                                         "partitioner": "murmur2_random"})
    for value, headers in records:
        record_key = key if key is not None else headers.get("Outbox-Key")
        producer.produce(topic, value=value, key=record_key.encode() if record_key else None,
                         headers=[(k, v.encode()) for k, v in headers.items()])
    assert producer.flush(30) == 0


def source(broker: Tansu, topic: str, group: str, **options: Any) -> KafkaSource:
    return KafkaSource(broker.bootstrap, topics=[topic], group=group, config=FAST_GROUP, **options)


def committed(broker: Tansu, topic: str, group: str) -> int:
    """The offsets ``group`` committed on ``topic``, summed over its partitions (read without
    joining the group): how many records it is past, since the offsets of a partition here
    start at 0 and have no gaps (no producer transactions). Tansu's high watermarks cannot
    be compared: its ListOffsets answer for the latest offset falls short of a partition's
    end (1 for partitions of 68 to 103 records)."""
    reader = confluent_kafka.Consumer({"bootstrap.servers": broker.bootstrap, "group.id": group})
    try:
        partitions = reader.list_topics(topic, timeout=10).topics[topic].partitions
        offsets = reader.committed([confluent_kafka.TopicPartition(topic, p) for p in partitions], timeout=10)
        return sum(max(tp.offset, 0) for tp in offsets)
    finally:
        reader.close()


def test_each_committed_record_has_one_effect_through_resends_and_two_relays(engine: sa.Engine, settings: Any,
                                                                            broker: Tansu) -> None:
    topic, group = broker.create_topic(3), f"g-{uuid.uuid4().hex[:8]}"
    ob = Outbox()
    ob.intake("orders", source=source(broker, topic, group), batch=20)
    counting_subscriber(ob, engine)
    sent = [forwarded(i) for i in range(200)]
    send(broker, topic, sent)
    send(broker, topic, sent[:40])  # the sender re-sends after its own crash: new records, same identities
    with running_relays(2, ob, settings(poll_interval=0.2)) as relays:
        assert wait_for(lambda: len(effects(engine)) == 200 and committed(broker, topic, group) == 240, TIMEOUT)
    assert set(effects(engine).values()) == {1}
    assert len(intake_rows(engine, "orders")) == 200
    stats = [relay.intake.stats for relay in relays if relay.intake is not None]
    assert sum(s["taken"] for s in stats) == 200 and sum(s["duplicates"] for s in stats) >= 40


def test_a_relay_that_dies_between_commit_and_offset_commit_reads_the_records_again_and_drops_them(
        engine: sa.Engine, settings: Any, broker: Tansu, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first two batches commit, then the consumer goes before their offset commits (as
    when the relay is killed there): the next consumer of the group starts from the offsets
    committed before, reads them again, and drops them."""
    topic, group = broker.create_topic(2), f"g-{uuid.uuid4().hex[:8]}"
    ob = Outbox()
    ob.intake("orders", source=source(broker, topic, group), batch=10)
    counting_subscriber(ob, engine)
    real_ack = KafkaSource.ack
    crashes: list[int] = []

    async def ack(self: KafkaSource, received: Any) -> None:
        if len(crashes) < 2:
            crashes.append(len(received))
            await self.close()
            raise SourceUnavailableError("the relay died before its offset commit")
        await real_ack(self, received)

    monkeypatch.setattr(KafkaSource, "ack", ack)
    send(broker, topic, [forwarded(i) for i in range(50)])
    with running_relay(ob, settings(poll_interval=0.2)) as relay:
        assert wait_for(lambda: len(effects(engine)) == 50 and committed(broker, topic, group) == 50, TIMEOUT)
        assert relay.intake is not None and relay.intake.stats["duplicates"] >= sum(crashes) > 0
    assert set(effects(engine).values()) == {1}


def test_poison_records_are_rejected_with_their_bytes_and_the_ones_after_them_taken_in(
        engine: sa.Engine, settings: Any, broker: Tansu) -> None:
    """A value that is not JSON (and has no identity header: its position is its identity)
    is rejected, kept with its bytes, and committed past; the records after it are taken in,
    a plain one (no outbox headers) under its position, with its record key as the event's
    key and its header that is not UTF-8 dropped."""
    topic, group = broker.create_topic(1), f"g-{uuid.uuid4().hex[:8]}"
    ob = Outbox()
    ob.intake("orders", source=source(broker, topic, group), topic={topic: "order.placed"})
    counting_subscriber(ob, engine)
    send(broker, topic, [(b"<xml/>", {}), forwarded(1), forwarded(2)])
    producer = confluent_kafka.Producer({"bootstrap.servers": broker.bootstrap})
    producer.produce(topic, value=b'{"order_id": 3}', key=b"order:3",
                     headers=[("note", "caf\u00e9".encode()), ("bin", b"\xff\xfe")])
    assert producer.flush(30) == 0
    with running_relay(ob, settings(poll_interval=0.2)):
        assert wait_for(lambda: len(effects(engine)) == 3 and committed(broker, topic, group) == 4, TIMEOUT)
    rows = {r["identity"]: r for r in intake_rows(engine, "orders")}
    assert set(rows) == {f"{topic}/0/0", "fwd:1", "fwd:2", f"{topic}/0/3"}
    poison = rows[f"{topic}/0/0"]
    assert "not UTF-8 JSON" in poison["problem"] and poison["body"] == b"<xml/>" and poison["event_id"] is None
    with engine.connect() as conn:
        plain = conn.execute(sa.text("SELECT key, headers FROM outbox_events WHERE id = :e"),
                             {"e": rows[f"{topic}/0/3"]["event_id"]}).one()
        forwarded_key = conn.execute(sa.text("SELECT key FROM outbox_events WHERE id = :e"),
                                     {"e": rows["fwd:1"]["event_id"]}).scalar_one()
    assert plain.key == "order:3" and plain.headers == {"note": "caf\u00e9"}
    assert forwarded_key == "order:1"  # the Outbox-Key header, as the sender's event had it
    assert set(effects(engine).values()) == {1}
