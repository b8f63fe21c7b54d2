"""Scenario 13, intake (issue 31): taking messages in from a broker as events, exactly once,
against the broker client consuming the same messages with no database.

For each broker (JetStream and RabbitMQ; skipped, with the reason, when its client library
or broker is missing), on a stream / queue of the bench's own, deleted afterwards:

* **Intake rate.** ``intake_events`` messages shaped as an outbox forwarder sends them
  (``Outbox-Idempotency-Key``, ``Outbox-Topic``, ``Outbox-Key`` headers, a small JSON body)
  are put in the broker first. Then one relay (``outbox-relay run --app bench.apps:intake``, a
  subprocess, no subscriber: the events are routed to nothing) takes them in. Each batch's
  transaction stamps its rows with its start (``taken_at``, database clock), so messages/s
  is the messages of every batch but the last over (the last batch's ``taken_at`` - the
  first's): the batches taken in between those two starts. The intake's batch is its
  default, 500.
* **Raw consume.** The same messages consumed by the same client with no PostgreSQL and
  acknowledged as the source does (JetStream: a pull consumer fetching batches of 500, an
  ``+ACK`` per message, flushed per batch; RabbitMQ: a consumer with prefetch 500, an ack per
  message). Messages/s = N / (last ack - first fetch), harness clock. Intake / raw is
  reported as a ratio.
* **Latency through JetStream** (commit -> handler start): a sending database whose relay
  forwards ``bench.event`` to a stream (``bench.apps:forwarding``), a receiving database
  whose relay takes the stream in and runs a no-op handler that notes ``time.time()`` at its
  start (``bench.apps:intake`` with ``BENCH_RECORD``); the harness commits single events at
  ``intake_rate`` per second and notes ``time.time()`` as each commit returns. One machine,
  one clock. p50 / p95 / p99.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
import sqlalchemy as sa

from outbox import publish

from .common import TOPIC, Databases, RelayProcess, Size, conninfo, log, percentile
from .forward import AMQP_URL, NATS_URL, JetStreamBroker, RabbitMQBroker, warm_up

#: Messages per JetStream fetch of the raw consumer (the intake's default batch).
RAW_BATCH = 500


def _message(i: int) -> tuple[bytes, dict[str, str]]:
    return (json.dumps({"n": i, "order_id": i, "customer": "alice", "total_cents": 2500}).encode(),
            {"Outbox-Idempotency-Key": f"bench:{i}", "Outbox-Topic": TOPIC, "Outbox-Key": f"k{i % 100}",
             "Outbox-Event-Id": str(i)})


class JetStreamInput(JetStreamBroker):
    """A stream of the bench's own (made and deleted as the forwarding scenario's), filled
    with messages as a sender would, taken in by a relay or consumed raw."""

    def __init__(self) -> None:
        super().__init__()
        self.durable = "d" + uuid.uuid4().hex[:8]

    async def fill(self, n: int) -> None:
        nc, js = await self._js()
        try:
            futures = [await js.publish_async(f"{self.name}.{TOPIC}", body, headers=headers)
                       for body, headers in (_message(i) for i in range(n))]
            await js.publish_async_completed()
            for f in futures:
                f.result()
        finally:
            await nc.close()

    async def consume(self, n: int) -> float:
        """Fetch and ack ``n`` messages as the source does; seconds."""
        nc, js = await self._js()
        try:
            sub = await js.pull_subscribe(f"{self.name}.>", durable="raw" + self.durable, stream=self.name)
            got = 0
            start = time.perf_counter()
            while got < n:
                for msg in await sub.fetch(RAW_BATCH, timeout=5):
                    await msg.ack()
                    got += 1
                await nc.flush()
            return time.perf_counter() - start
        finally:
            await nc.close()

    def relay_env(self) -> dict[str, str]:
        return {"BENCH_INTAKE": "jetstream", "BENCH_INTAKE_URL": NATS_URL, "BENCH_INTAKE_STREAM": self.name,
                "BENCH_INTAKE_DURABLE": self.durable}


class RabbitMQInput(RabbitMQBroker):
    """A durable queue of the bench's own (no exchange: filled through the default one)."""

    async def create(self) -> None:
        conn, ch = await self._channel()
        try:
            await ch.declare_queue(self.name, durable=True)
        finally:
            await conn.close()

    async def fill(self, n: int) -> None:
        import aio_pika

        conn, ch = await self._channel(confirms=True)
        try:
            window = asyncio.Semaphore(500)

            async def one(i: int) -> None:
                body, headers = _message(i)
                async with window:
                    await ch.default_exchange.publish(aio_pika.Message(body, headers=headers,
                                                                       message_id=headers["Outbox-Idempotency-Key"]),
                                                      routing_key=self.name)

            await asyncio.gather(*(one(i) for i in range(n)))
        finally:
            await conn.close()

    async def consume(self, n: int) -> float:
        conn, ch = await self._channel()
        try:
            await ch.set_qos(prefetch_count=500)
            queue = await ch.get_queue(self.name)
            done = asyncio.Event()
            got = 0
            start = time.perf_counter()

            async def on_message(message: Any) -> None:
                nonlocal got
                await message.ack()
                got += 1
                if got >= n:
                    done.set()

            await queue.consume(on_message)
            await asyncio.wait_for(done.wait(), 300)
            return time.perf_counter() - start
        finally:
            await conn.close()

    def relay_env(self) -> dict[str, str]:
        return {"BENCH_INTAKE": "rabbitmq", "BENCH_INTAKE_URL": AMQP_URL, "BENCH_INTAKE_QUEUE": self.name}

    async def delete(self) -> None:
        conn, ch = await self._channel()
        try:
            await ch.queue_delete(self.name)
        except Exception as exc:  # noqa: BLE001
            log(f"could not delete queue {self.name}: {exc}")
        finally:
            await conn.close()


def _taken(mon: psycopg.Connection[Any]) -> tuple[int, int, float]:
    """(rows, rows before the last batch, seconds from the first batch's start to the last's)."""
    row = mon.execute("SELECT count(*), count(*) FILTER (WHERE taken_at < (SELECT max(taken_at) FROM outbox_intake)), "
                      "coalesce(extract(epoch FROM max(taken_at) - min(taken_at)), 0) FROM outbox_intake").fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), float(row[2])


def intake_rate(dbs: Databases, kind: type[JetStreamInput] | type[RabbitMQInput], n: int, results: Path) -> float:
    source = kind()
    asyncio.run(source.create())
    try:
        asyncio.run(source.fill(n))
        with dbs.fresh() as url:
            relay = RelayProcess(url, results / "logs" / f"relay-intake-{source.kind}.log", env=source.relay_env(),
                                 app="bench.apps:intake")
            try:
                with psycopg.connect(conninfo(url), autocommit=True) as mon:
                    deadline = time.monotonic() + 600
                    while _taken(mon)[0] < n:
                        if relay.proc.poll() is not None or time.monotonic() > deadline:
                            raise RuntimeError(f"intake {source.kind}: {_taken(mon)[0]} of {n} taken in")
                        time.sleep(0.1)
                    count, before_last, seconds = _taken(mon)
            finally:
                relay.stop()
    finally:
        asyncio.run(source.delete())
    if count != n:
        raise RuntimeError(f"intake {source.kind}: {count} rows for {n} messages")
    return before_last / seconds


def raw_rate(kind: type[JetStreamInput] | type[RabbitMQInput], n: int) -> float:
    source = kind()
    asyncio.run(source.create())
    try:
        asyncio.run(source.fill(n))
        return n / asyncio.run(source.consume(n))
    finally:
        asyncio.run(source.delete())


def latency(dbs: Databases, size: Size, results: Path) -> dict[str, Any]:
    """Sender commit -> receiver handler start through JetStream (module notes)."""
    stream = JetStreamBroker()
    asyncio.run(stream.create())
    record = results / "logs" / "intake-latency-starts.json"
    record.unlink(missing_ok=True)
    commits: dict[int, float] = {}
    try:
        with dbs.fresh() as sender_url, dbs.fresh() as receiver_url:
            receiver = RelayProcess(receiver_url, results / "logs" / "relay-intake-latency-b.log",
                                    env={"BENCH_INTAKE": "jetstream", "BENCH_INTAKE_URL": NATS_URL,
                                         "BENCH_INTAKE_STREAM": stream.name, "BENCH_INTAKE_DURABLE": "lat",
                                         "BENCH_RECORD": str(record)}, app="bench.apps:intake")
            sender = RelayProcess(sender_url, results / "logs" / "relay-intake-latency-a.log",
                                  env=stream.relay_env(), app="bench.apps:forwarding")
            try:
                sender.wait_ready(1)
                receiver.wait_ready(1)
                eng = sa.create_engine(sender_url, pool_size=1)
                with psycopg.connect(conninfo(sender_url), autocommit=True) as mon, \
                        psycopg.connect(conninfo(receiver_url), autocommit=True) as bmon:
                    warm_up(eng, mon)
                    while bmon.execute("SELECT count(*) FROM outbox_jobs WHERE status = 'done'").fetchone()[0] < 1:
                        time.sleep(0.05)
                    n = int(size.intake_rate * size.intake_latency_seconds)
                    start = time.perf_counter()
                    for i in range(n):
                        delay = start + i / size.intake_rate - time.perf_counter()
                        if delay > 0:
                            time.sleep(delay)
                        with eng.begin() as conn:
                            event_id = publish(conn, TOPIC, {"n": i})
                        commits[event_id] = time.time()
                    achieved = n / (time.perf_counter() - start)
                    eng.dispose()
                    deadline = time.monotonic() + 60
                    while bmon.execute("SELECT count(*) FROM outbox_jobs WHERE status = 'done'").fetchone()[0] < n + 1:
                        if time.monotonic() > deadline:
                            raise RuntimeError("intake latency: the receiver did not handle every event")
                        time.sleep(0.1)
            finally:
                receiver.stop()
                sender.stop()
    finally:
        asyncio.run(stream.delete())
    starts = {int(sender_event): at for sender_event, at in json.loads(record.read_text())}
    ms = [(starts[e] - c) * 1000 for e, c in commits.items() if e in starts]
    out = {"events": n, "observed": len(ms), "rate": achieved, "p50_ms": percentile(ms, 50),
           "p95_ms": percentile(ms, 95), "p99_ms": percentile(ms, 99), "max_ms": max(ms)}
    log(f"intake latency (JetStream, commit -> handler start): p50 {out['p50_ms']:.1f} ms, p99 {out['p99_ms']:.1f} ms "
        f"at {achieved:.0f} events/s, {len(ms)} of {n} observed")
    return out


def run(dbs: Databases, size: Size, results: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"brokers": {}, "skipped": {}}
    for kind in (JetStreamInput, RabbitMQInput):
        why = kind.missing()
        if why is not None:
            out["skipped"][kind.kind] = why
            log(f"intake {kind.kind}: skipped ({why})")
            continue
        rates, raws = [], []
        for _ in range(size.runs):
            rates.append(intake_rate(dbs, kind, size.intake_events, results))
            raws.append(raw_rate(kind, size.intake_events))
        rates.sort()
        raws.sort()
        taken, raw = rates[len(rates) // 2], raws[len(raws) // 2]
        out["brokers"][kind.kind] = {"events": size.intake_events, "intake_per_s": taken, "raw_per_s": raw,
                                     "ratio": taken / raw, "runs": {"intake": rates, "raw": raws}}
        log(f"intake {kind.kind}: {taken:,.0f} messages/s taken in, raw consume {raw:,.0f}/s ({taken / raw:.0%})")
    if "jetstream" in out["brokers"]:
        out["latency"] = latency(dbs, size, results)
    return out
