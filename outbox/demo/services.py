"""``outbox-relay demo --services 2``: two services, each with its own database, joined by
NATS JetStream, exactly once end to end under faults.

* **Service A** (database ``<db-name>_a``) places orders: each in a domain transaction that
  inserts the order and publishes ``order.placed`` (key ``customer:<name>``); a share is
  rolled back on purpose. Its relays forward the events to the run's stream with an ordered
  forwarder (:func:`sender`).
* **Service B** (database ``<db-name>_b``) takes them in with an ordered intake from a durable
  consumer of that stream (:func:`receiver`) and books each order in a transactional,
  ordered handler: a fenced write of ``demo_b_orders``, one more run in ``demo_b_runs`` and
  a line in ``demo_b_log``, all in the job's transaction.
* Both services' NATS connections go through a TCP proxy of the run's own
  (:class:`~outbox.demo.proxy.TcpProxy`), so the broker can be cut without touching it.
* **Faults**, while orders flow: a relay of A and B's intake holder are SIGKILLed
  (replacements started), B's next holder is SIGSTOPped for three leases, the broker is cut
  for ``--cut-for`` seconds, and A's first messages are re-sent with new message ids (a
  sender re-sending after a crash, past the stream's duplicate window).

Then the invariants, each a query: B booked exactly the orders A committed (none of the
rolled-back ones), each booking's transaction committed once (``runs = 1``), every customer's
orders were booked in A's commit order, every job of both services is done, and B took each
message in once (its ``outbox_intake`` rows are A's events). Exit status 0 only when every
invariant holds; 1 otherwise; 2 when NATS cannot be reached (the reason is printed).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import sqlalchemy as sa
from sqlalchemy import BigInteger, Column, Identity, Integer, MetaData, Table, Text
from sqlalchemy.engine import URL, Engine
from sqlalchemy.orm import Session

from outbox import Job, Outbox, fenced_write, publish
from outbox.db.engine import make_engine, redact
from outbox.demo import app
from outbox.demo.proxy import TcpProxy
from outbox.demo.stream import DemoStream, ForwardingSkipped
from outbox.errors import ConfigurationError
from outbox.intake.jetstream import JetStreamSource
from outbox.settings import OutboxSettings
from outbox.sinks.jetstream import JetStream

#: Consumer names and the intake's.
FORWARDER = "to_service_b"
INTAKE = "from_service_a"
BOOKER = "book_order"
#: The durable consumer of the stream service B reads.
DURABLE = "service_b"
#: Messages the demo re-sends as a crashed sender would (the fault at 0.85 of the duration).
RESENT = 20
#: Service A's customers: each one's orders share a key, so B must book them in A's order.
CUSTOMERS = ("alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi")

b_metadata = MetaData()
b_orders = Table("demo_b_orders", b_metadata,
                 Column("order_id", BigInteger, primary_key=True), Column("customer", Text, nullable=False),
                 Column("total_cents", Integer, nullable=False), Column("a_event_id", BigInteger, nullable=False),
                 Column("fence", BigInteger, nullable=False))
b_runs = Table("demo_b_runs", b_metadata, Column("order_id", BigInteger, primary_key=True),
               Column("runs", Integer, nullable=False))
b_log = Table("demo_b_log", b_metadata, Column("n", BigInteger, Identity(always=True), primary_key=True),
              Column("customer", Text, nullable=False), Column("order_id", BigInteger, nullable=False))


# ------------------------------------------------------------------ the services' registries


def sender() -> Outbox:
    """Service A's registry (``--app outbox.demo.services:sender``): the ordered forwarder of
    ``order.placed`` to ``<stream>.order.placed`` of stream ``OUTBOX_DEMO_NATS_STREAM`` at
    ``OUTBOX_DEMO_NATS_URL``. Raises :class:`ConfigurationError` when the stream is not set."""
    settings = app.demo_settings()
    if not settings.nats_stream:
        raise ConfigurationError("sender needs OUTBOX_DEMO_NATS_STREAM (outbox-relay demo --services 2 sets it)")
    ob = Outbox()
    ob.forward(app.TOPIC, to=JetStream(settings.nats_url, subject=f"{settings.nats_stream}.{{topic}}",
                                       stream=settings.nats_stream), consumer=FORWARDER, ordered=True)
    return ob


def receiver() -> Outbox:
    """Service B's registry (``--app outbox.demo.services:receiver``): the ordered intake of
    the stream's durable consumer ``service_b`` and the ordered, transactional booking
    handler. Raises :class:`ConfigurationError` when the stream is not set."""
    settings = app.demo_settings()
    if not settings.nats_stream:
        raise ConfigurationError("receiver needs OUTBOX_DEMO_NATS_STREAM (outbox-relay demo --services 2 sets it)")
    ob = Outbox()
    ob.intake(INTAKE, source=JetStreamSource(settings.nats_url, stream=settings.nats_stream, durable=DURABLE,
                                             ack_wait=2.0), ordered=True)
    ob.subscriber(app.TOPIC, consumer=BOOKER, transactional=True, ordered=True)(book_order)
    return ob


def book_order(job: Job, session: Session) -> None:
    """Book one of A's orders in B, in the job's transaction: the order (a fenced write),
    one more run of its booking, a line of the customer's log."""
    order = job.payload
    fenced_write(session, b_orders, key={"order_id": order["order_id"]},
                 values={"customer": order["customer"], "total_cents": order["total_cents"],
                         "a_event_id": int(job.headers["Outbox-Event-Id"])}, fence=job.fence)
    session.execute(sa.text("INSERT INTO demo_b_runs (order_id, runs) VALUES (:o, 1) "
                            "ON CONFLICT (order_id) DO UPDATE SET runs = demo_b_runs.runs + 1"), {"o": order["order_id"]})
    session.execute(b_log.insert().values(customer=order["customer"], order_id=order["order_id"]))


# ------------------------------------------------------------------------------ the run


@dataclass
class _Relay:
    service: str
    name: str
    proc: subprocess.Popen[bytes]
    log: Any
    stopped: bool = False
    holder: bool = False  # took the intake in last, when the faults looked


@dataclass
class ServicesDemo:
    """One run (module notes). ``prepare``: a function making a fresh migrated database of a
    name on the server and returning its URL (the main demo's ``prepare_database``)."""

    server: URL
    prepare: Callable[[URL, str], URL]
    settings: OutboxSettings
    orders: int
    duration: float
    rollback_share: float
    lease: float
    db_name: str
    log_dir: Path
    nats_url: str
    faults: bool
    cut_for: float
    drain_timeout: float
    seed: int
    relays: list[_Relay] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    stream: Any = None  # the run's DemoStream, once made
    resent: int = 0

    def run(self) -> int:
        started = time.monotonic()
        try:
            stream = DemoStream.create(self.nats_url, duplicate_window=max(120.0, 4 * (self.duration + self.drain_timeout)))
        except ForwardingSkipped as exc:
            print(f"demo --services 2 needs NATS with JetStream: {exc}")
            return 2
        self.stream = stream
        target = urlsplit(self.nats_url)
        proxy = TcpProxy((target.hostname or "127.0.0.1", target.port or 4222))
        proxy.start()
        url_a = self.prepare(self.server, f"{self.db_name}_a")
        url_b = self.prepare(self.server, f"{self.db_name}_b")
        engine_a = make_engine(url_a, pool_size=2, application_name="outbox-demo")
        engine_b = make_engine(url_b, pool_size=2, application_name="outbox-demo")
        b_metadata.create_all(engine_b)
        print(f"service A: {redact(url_a)}; service B: {redact(url_b)}; stream {stream.name} via a proxy on port "
              f"{proxy.port}; relay logs in {self.log_dir.resolve()}")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "OUTBOX_DEMO_NATS_URL": f"nats://127.0.0.1:{proxy.port}",
               "OUTBOX_DEMO_NATS_STREAM": stream.name, "OUTBOX_LOG_LEVEL": "INFO", "PYTHONUNBUFFERED": "1",
               "OUTBOX_SCHEMA": self.settings.schema_name}
        envs = {"A": {**env, "OUTBOX_DATABASE_URL": url_a.render_as_string(hide_password=False)},
                "B": {**env, "OUTBOX_DATABASE_URL": url_b.render_as_string(hide_password=False)}}
        try:
            for service in ("A", "A", "B", "B"):
                self._spawn(service, envs[service])
            self._wait_started()
            producer = _Orders(engine_a, self.orders, self.duration, self.rollback_share, self.seed)
            t0 = time.monotonic()
            producer.start()
            if self.faults:
                self._faults(t0, envs, proxy)
            producer.join()
            if producer.error is not None:
                raise producer.error
            drained = self._drain(engine_a, engine_b, producer, t0)
            for relay in self.relays:
                if relay.proc.poll() is None:
                    if relay.stopped:
                        relay.proc.send_signal(signal.SIGCONT)
                    relay.proc.send_signal(signal.SIGTERM)
            exits = {r.name: r.proc.wait(30) for r in self.relays if not r.name.endswith("killed")}
            checks = self._checks(engine_a, engine_b, producer, drained, exits)
            redelivered = _redelivered(stream)
        finally:
            for relay in self.relays:
                if relay.proc.poll() is None:
                    relay.proc.kill()
                    relay.proc.wait()
                relay.log.close()
            proxy.stop()
            stream.delete()
            engine_a.dispose()
            engine_b.dispose()
        print()
        print(f"B was handed copies: {self.resent} messages re-sent by A's sender, {redelivered} delivered again by "
              "JetStream (kills, the pause, the cut); each taken in once, as the checks below say")
        for name, ok, detail in checks:
            print(f"  {'ok  ' if ok else 'FAIL'} {name}: {detail}")
        failed = [name for name, ok, _ in checks if not ok]
        print()
        if failed:
            print(f"{len(failed)} of {len(checks)} invariants FAILED: {'; '.join(failed)}")
            return 1
        print(f"all {len(checks)} invariants hold ({time.monotonic() - started:.1f}s)")
        return 0

    def _spawn(self, service: str, env: dict[str, str]) -> _Relay:
        name = f"{service.lower()}-relay-{sum(1 for r in self.relays if r.service == service) + 1}"
        log = open(self.log_dir / f"{name}.log", "wb")  # noqa: SIM115 - closed at the end of the run
        command = [sys.executable, "-m", "outbox.ops.cli", "run", "--app",
                   "outbox.demo.services:" + ("sender" if service == "A" else "receiver"),
                   "--default-lease", str(self.lease), "--reap-interval", str(max(0.2, self.lease / 6)),
                   "--poll-interval", "0.5", "--backoff-base", "0.2", "--backoff-cap", "2", "--shutdown-grace", "5"]
        # cwd: the log folder, not the caller's: a folder named outbox there (a checkout) would hide the package
        proc = subprocess.Popen(command, env=env, cwd=self.log_dir.resolve(), stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        relay = _Relay(service, name, proc, log)
        self.relays.append(relay)
        return relay

    def _wait_started(self, timeout: float = 60.0) -> None:
        """Wait until every relay logged "relay started"; raise :class:`ConfigurationError` with
        the log's end of one that exited or did not start in time."""
        deadline = time.monotonic() + timeout
        for relay in self.relays:
            path = self.log_dir / f"{relay.name}.log"
            while "relay started" not in path.read_text(errors="replace"):
                if relay.proc.poll() is not None or time.monotonic() > deadline:
                    tail = "\n".join(path.read_text(errors="replace").splitlines()[-15:])
                    raise ConfigurationError(f"{relay.name} did not start (exit status {relay.proc.poll()}); the end "
                                             f"of {path}:\n{tail}")
                time.sleep(0.1)

    def _fault(self, t0: float, text: str) -> None:
        self.notes.append(text)
        print(f"[{time.monotonic() - t0:6.1f}s] fault: {text}", flush=True)

    def _faults(self, t0: float, envs: dict[str, dict[str, str]], proxy: TcpProxy) -> None:
        """The fault schedule, at shares of ``duration``: kill a relay of A (0.2), cut the
        broker (0.35), kill B's intake holder (0.5), pause the next holder for three leases
        (0.65), re-send A's first :data:`RESENT` messages with new ids (0.85)."""
        def at(share: float) -> None:
            time.sleep(max(0.0, t0 + share * self.duration - time.monotonic()))

        def kill(service: str) -> None:
            victim = self._holder() if service == "B" else None
            victim = victim or next(r for r in self.relays if r.service == service and r.proc.poll() is None)
            victim.proc.send_signal(signal.SIGKILL)
            victim.proc.wait()
            victim.name += "-killed"
            fresh = self._spawn(service, envs[service])
            holder = " (the intake's holder)" if service == "B" and victim.holder else ""
            self._fault(t0, f"SIGKILL {victim.name.removesuffix('-killed')} of service {service}{holder}; "
                            f"started {fresh.name}")

        at(0.2)
        kill("A")
        at(0.35)
        proxy.stop()
        self._fault(t0, f"broker cut for {self.cut_for:g}s (both services' NATS connections)")
        time.sleep(self.cut_for)
        proxy.start()
        self._fault(t0, "broker back")
        at(0.5)
        kill("B")
        at(0.65)
        paused = self._holder() or next(r for r in self.relays if r.service == "B" and r.proc.poll() is None)
        paused.proc.send_signal(signal.SIGSTOP)
        paused.stopped = True
        holder = ", the intake's holder," if paused.holder else ""
        self._fault(t0, f"SIGSTOP {paused.name} of service B{holder} for {3 * self.lease:g}s (lease {self.lease:g}s)")
        time.sleep(3 * self.lease)
        paused.proc.send_signal(signal.SIGCONT)
        paused.stopped = False
        self._fault(t0, f"SIGCONT {paused.name}")
        at(0.85)
        self.resent = self.stream.resend(RESENT)
        self._fault(t0, f"service A's sender re-sends its first {self.resent} messages with new Nats-Msg-Ids (a re-send "
                        "after a crash, past the stream's duplicate window): new messages to the stream, B must drop them")

    def _holder(self) -> _Relay | None:
        """The live relay of B that took the intake in last (it logs "takes it in now"), or None."""
        for relay in self.relays:
            relay.holder = False
        live = [r for r in self.relays if r.service == "B" and r.proc.poll() is None]
        latest: tuple[str, _Relay] | None = None
        for relay in live:
            lines = [line for line in (self.log_dir / f"{relay.name}.log").read_text(errors="replace").splitlines()
                     if "takes it in now" in line]
            if lines and (latest is None or lines[-1][:23] > latest[0]):
                latest = (lines[-1][:23], relay)
        if latest is None:
            return None
        latest[1].holder = True
        return latest[1]

    def _drain(self, engine_a: Engine, engine_b: Engine, producer: _Orders, t0: float) -> bool:
        deadline = time.monotonic() + self.drain_timeout
        committed = set(producer.committed)
        while time.monotonic() < deadline:
            with engine_b.connect() as conn:
                booked = conn.execute(sa.text("SELECT count(*) FROM demo_b_orders")).scalar_one()
                open_b = conn.execute(sa.text("SELECT count(*) FROM outbox_jobs WHERE status <> 'done'")).scalar_one()
            with engine_a.connect() as conn:
                open_a = conn.execute(sa.text("SELECT count(*) FROM outbox_jobs WHERE status <> 'done'")).scalar_one()
            unread = self.stream.unfinished(DURABLE)
            print(f"[{time.monotonic() - t0:6.1f}s] A committed {len(committed)} orders, jobs open {open_a} | "
                  f"stream messages not yet acknowledged by B {unread} | B booked {booked}, jobs open {open_b}",
                  flush=True)
            if booked >= len(committed) and not open_a and not open_b and not unread:
                return True
            time.sleep(1.0)
        return False

    def _checks(self, engine_a: Engine, engine_b: Engine, producer: _Orders, drained: bool,
                exits: dict[str, int]) -> list[tuple[str, bool, str]]:
        committed, rolled = set(producer.committed), set(producer.rolled_back)
        with engine_a.connect() as conn:
            a_events: dict[int, int] = dict(conn.execute(sa.text("SELECT (payload->>'order_id')::bigint, id FROM outbox_events")).all())
            a_jobs: dict[str, int] = dict(conn.execute(sa.text("SELECT status, count(*) FROM outbox_jobs GROUP BY status")).all())
        with engine_b.connect() as conn:
            booked: dict[int, int] = dict(conn.execute(sa.text("SELECT order_id, a_event_id FROM demo_b_orders")).all())
            runs: dict[int, int] = dict(conn.execute(sa.text("SELECT order_id, runs FROM demo_b_runs")).all())
            log = conn.execute(sa.text("SELECT customer, order_id FROM demo_b_log ORDER BY n")).all()
            b_jobs: dict[str, int] = dict(conn.execute(sa.text("SELECT status, count(*) FROM outbox_jobs GROUP BY status")).all())
            taken = conn.execute(sa.text("SELECT count(*), count(DISTINCT event_id) FROM outbox_intake "
                                         "WHERE source = :s AND problem IS NULL"), {"s": INTAKE}).one()
        by_customer: dict[str, list[int]] = {}
        for customer, order_id in log:
            by_customer.setdefault(customer, []).append(a_events.get(order_id, -1))
        out_of_order = [c for c, ids in by_customer.items() if ids != sorted(ids)]
        twice = {o: n for o, n in runs.items() if n != 1}
        return [
            ("drained", drained, "every job of both services done, every committed order booked, every stream "
             "message (the re-sent ones too) acknowledged by B"
             if drained else f"not within {self.drain_timeout:g}s"),
            ("B booked exactly A's committed orders", set(booked) == committed,
             f"{len(booked)} booked, {len(committed)} committed, missing {sorted(committed - set(booked))[:10]}, "
             f"extra {sorted(set(booked) - committed)[:10]}"),
            ("no rolled-back order reached B", not (set(booked) & rolled), f"{len(rolled)} rolled back"),
            ("each booking committed once", not twice and len(runs) == len(booked),
             f"{len(runs)} bookings; committed more than once: {dict(list(twice.items())[:10])}"),
            ("each booking names A's event of its order", all(a_events.get(o) == e for o, e in booked.items()),
             f"{len(booked)} bookings, each with its Outbox-Event-Id"),
            ("every customer's orders booked in A's commit order", not out_of_order,
             f"{len(by_customer)} customers" + (f"; out of order: {out_of_order[:5]}" if out_of_order else "")),
            ("B took each message in once", taken[0] == taken[1] == len(booked),
             f"{taken[0]} intake rows, {taken[1]} distinct events"),
            ("every job done in both services", set(a_jobs) <= {"done"} and set(b_jobs) <= {"done"},
             f"A {a_jobs}, B {b_jobs}"),
            ("relays exited 0 on SIGTERM", all(code == 0 for code in exits.values()), str(exits)),
        ]


def _redelivered(stream: DemoStream) -> int | str:
    """How many messages B's durable consumer delivered more than once (informative)."""
    try:
        return stream.redelivered(DURABLE)
    except Exception as exc:  # noqa: BLE001 - informative only
        return f"(unknown: {exc})"


class _Orders(threading.Thread):
    """Service A's orders: one domain transaction each, paced over ``duration`` seconds."""

    def __init__(self, engine: Engine, orders: int, duration: float, rollback_share: float, seed: int) -> None:
        super().__init__(name="demo-orders", daemon=True)
        self.engine, self.orders, self.duration, self.rollback_share = engine, orders, duration, rollback_share
        self.rng = random.Random(seed)
        self.committed: list[int] = []
        self.rolled_back: list[int] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        start = time.monotonic()
        try:
            for order_id in range(1, self.orders + 1):
                time.sleep(max(0.0, start + self.duration * (order_id - 1) / self.orders - time.monotonic()))
                customer = self.rng.choice(CUSTOMERS)
                total = self.rng.randint(500, 50_000)
                try:
                    with Session(self.engine) as session, session.begin():
                        session.execute(app.orders.insert().values(id=order_id, customer=customer, total_cents=total))
                        publish(session, app.TOPIC, {"order_id": order_id, "customer": customer, "total_cents": total},
                                key=f"customer:{customer}")
                        if self.rng.random() < self.rollback_share:
                            raise _RolledBack()
                except _RolledBack:
                    self.rolled_back.append(order_id)
                else:
                    self.committed.append(order_id)
        except BaseException as exc:  # noqa: BLE001 - reported by the run
            self.error = exc


class _RolledBack(Exception):
    """Rolls an order's transaction back on purpose."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags only this demo reads (``--cut-for``); the rest are the main demo's."""
    parser.add_argument("--services", type=int, choices=(1, 2), default=1,
                        help="2: the two-service demo, service A forwarding orders through NATS JetStream to service "
                             "B, which takes them in exactly once (needs NATS; --orders, --duration, "
                             "--rollback-share, --lease, --db-name, --log-dir, --nats-url, --no-faults apply)")
    parser.add_argument("--cut-for", type=float, default=3.0,
                        help="--services 2: seconds the broker is cut off from both services (default 3)")
