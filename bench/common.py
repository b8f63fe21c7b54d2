"""What every scenario shares: the sizes, throw-away databases, the relay subprocess,
process CPU and memory readings, and small statistics.

Databases: one migrated template per invocation (``outbox_bench_tpl_<hex>``); every
benchmark gets its own copy (``outbox_bench_<hex>``), dropped when it ends, so no
benchmark sees another's rows, dead tuples or statistics, and nothing else on the server
is touched.
"""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import sqlalchemy as sa
from sqlalchemy.engine import URL, Engine

from outbox.db.engine import make_engine, parse_url
from outbox.testing import create_database, drop_database, migrated_template

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
TOPIC = "bench.event"
CLK_TCK = os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------------ sizes


@dataclass(frozen=True)
class Size:
    """How big each scenario runs. ``runs``: repetitions behind every median."""

    name: str
    runs: int = 3
    peers: bool = True                   # False (--no-peers): no peer runs anywhere, no peers' venv
    # 1 raw: the own-statement limit
    pgbench_seconds: float = 2.0          # 0: a fixed 20 script runs per client (smoke size)
    pgbench_pool: int = 150_000          # ready jobs present before a batched run
    loop_seconds: float = 4.0
    # 2 end-to-end fan-out, 3 peers
    events: int = 50_000                 # events published at the best settings; jobs = 3x
    default_events: int = 50_000         # events published at the relay's defaults, with no-op and 5 ms handlers
    sweep_events: int = 6_000            # events per configuration of the short sweep
    # (concurrency, claim_batch, prefetch, dispatchers) of the relay; the first is its defaults.
    # (8, 200, 200) and (16, 100, 100) never led; many workers without a prefetch buffer (no
    # starter round trip per hand-over) and a second dispatcher did (issue 14, levers 13-14).
    sweep: tuple[tuple[int, int, int, int], ...] = ((8, 50, 50, 1), (32, 250, 250, 1), (512, 500, 0, 1),
                                                    (512, 250, 0, 2))
    e2e_cap: float = 40.0                # seconds an end-to-end run may take (half in the sweep)
    procrastinate_cap: float = 10.0      # seconds procrastinate drains before it is stopped
    # (workers, claim_batch) of awa's sweep on 3 x sweep_events jobs, each on a fresh database
    awa_sweep: tuple[tuple[int, int], ...] = ((256, 512), (1024, 512))  # 1024/64 and 2048/512 were slower
    awa_cap: float = 300.0               # seconds an awa drain may take before it is stopped
    # 4 publish cost
    publish_txns: int = 1_000
    publish_many_txns: int = 10
    # 5 latency
    latency_seconds: float = 15.0
    latency_rate: float = 1_000.0         # events/s (issue 14's target: p99 <= 50 ms at 1,000 events/s)
    # 6 scale
    scale_rows: int = 1_000_000
    scale_events: int = 3_000            # unrouted events routed per measurement
    # 7 soak
    soak_seconds: float = 40.0
    soak_rate: float = 200.0
    snapshot_seconds: float = 10.0
    after_seconds: float = 10.0
    retention: float = 10.0              # retention_done during the soak, seconds
    # 12 sustained: a steady rate on a server of its own, a snapshot held for the middle third
    sustained_seconds: float = 180.0
    sustained_rate: float = 300.0        # events/s, 3 consumers: about half the relay's default capacity
    sustained_window: float = 15.0       # seconds per reported window
    # drift (on request): the same rate, no snapshot, a short retention so the pruner runs
    drift_seconds: float = 1800.0        # issue 28: 30 minutes
    drift_retention: float = 300.0       # retention_done and retention_events of the relay, seconds
    drift_span: float = 300.0            # p99 of the first vs the last span, seconds
    # 8 ordered delivery
    ordered_events: int = 10_000         # events of one consumer, ordered and not
    ordered_keys: int = 1_000
    ordered_settings: dict[str, Any] = field(default_factory=lambda: {"concurrency": 16, "claim_batch": 100,
                                                                      "prefetch": 100})
    claim_ready: int = 30_000            # ready jobs the claim-cost loop may claim
    blocked_jobs: int = 100_000          # pending jobs behind the blocked key
    # 9 forwarding
    forward_events: int = 10_000         # events forwarded per throughput run (and re-sent raw)
    forward_sweep_events: int = 5_000    # events per configuration of the forwarding sweep
    forward_latency_seconds: float = 6.0
    forward_rate: float = 200.0
    claim_seconds: float = 1.5
    # 11 ceiling: the leanest-SQL pipeline
    lean_seconds: float = 6.0            # each of its pgbench runs
    lean_pool: int = 400_000             # ready jobs preloaded before the first lean claim + complete run
    # 10 metrics cost
    metrics_events: int = 10_000         # events per run of each pair (jobs = 3x)
    # 13 intake
    intake_events: int = 10_000          # messages taken in per run (and consumed raw)
    intake_rate: float = 200.0           # events/s of the latency run (sender -> JetStream -> receiver)
    intake_latency_seconds: float = 10.0
    notes: tuple[str, ...] = field(default=())


SIZES = {
    "quick": Size(
        name="quick", pgbench_seconds=0, pgbench_pool=10_000, loop_seconds=0.5, events=1_000,
        default_events=500, sweep_events=500, sweep=((8, 50, 50, 1), (64, 100, 0, 2)), procrastinate_cap=2.0,
        awa_sweep=((64, 64), (256, 512)),
        publish_txns=100, publish_many_txns=2, latency_seconds=4.0, latency_rate=200.0, scale_rows=10_000, scale_events=300,
        soak_seconds=12.0, soak_rate=100.0, snapshot_seconds=4.0, after_seconds=4.0, retention=3.0,
        ordered_events=1_000, ordered_keys=100, claim_ready=2_000, blocked_jobs=5_000, claim_seconds=0.3,
        forward_events=1_000, forward_sweep_events=500, forward_latency_seconds=5.0, lean_seconds=2.0,
        lean_pool=60_000, metrics_events=1_000, sustained_seconds=30.0, sustained_rate=100.0, sustained_window=5.0,
        drift_seconds=60.0, drift_retention=15.0, drift_span=15.0, intake_events=1_000, intake_latency_seconds=3.0),
    "default": Size(name="default"),
    "full": Size(
        name="full", pgbench_seconds=10.0, pgbench_pool=300_000, loop_seconds=8.0,
        default_events=50_000, sweep_events=20_000, e2e_cap=600.0, sweep=((4, 50, 50, 1), (8, 50, 50, 1), (8, 200, 200, 1), (16, 100, 100, 1), (32, 250, 250, 1), (64, 500, 500, 1),
               (256, 250, 0, 1), (512, 500, 0, 1), (256, 250, 0, 2), (512, 250, 0, 2), (512, 250, 0, 3)),
        procrastinate_cap=60.0, publish_txns=5_000, publish_many_txns=20,
        soak_seconds=600.0, snapshot_seconds=120.0, after_seconds=60.0, retention=30.0, lean_seconds=20.0,
        scale_rows=10_000_000, latency_seconds=30.0, metrics_events=50_000, forward_latency_seconds=20.0,
        lean_pool=800_000, ordered_events=20_000, forward_events=20_000, sustained_seconds=900.0,
        sustained_window=60.0),
}


# ------------------------------------------------------------------- statistics


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100) of ``values``."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -------------------------------------------------------------------- databases


LOCAL = "postgresql://postgres@127.0.0.1:5432/postgres"


def server_url() -> URL:
    """The server: ``BENCH_DATABASE_URL``, else ``OUTBOX_DATABASE_URL``, else a local one on
    127.0.0.1:5432 (user postgres) if it answers, else the embedded server the tests use."""
    url = os.environ.get("BENCH_DATABASE_URL") or os.environ.get("OUTBOX_DATABASE_URL")
    if url:
        return parse_url(url)
    try:
        psycopg.connect(LOCAL, connect_timeout=2).close()
        return parse_url(LOCAL)
    except psycopg.Error:
        from outbox.testing import server_url as test_server

        log("no server on 127.0.0.1:5432 and none configured: using the embedded one")
        return test_server()[0]


def find_binary(name: str) -> str | None:
    """A PostgreSQL client program: on PATH, in the server packages, or in pgserver's wheel."""
    import glob
    import shutil

    found = shutil.which(name) or next(iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)), None)
    if found:
        return found
    with contextlib.suppress(ImportError), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its platformdirs warns when XDG_RUNTIME_DIR is unset
        import pgserver

        candidate = Path(pgserver.__file__).parent / "pginstall" / "bin" / name
        if candidate.exists():
            return str(candidate)
    return None


def conninfo(url: URL) -> str:
    """libpq form of a SQLAlchemy URL (for psycopg, pgbench and the peers)."""
    return url.set(drivername="postgresql").render_as_string(hide_password=False)


def pgbench_command(url: URL, scripts: Sequence[Path], clients: int, seconds: float | None = None,
                    transactions: int | None = None, defines: dict[str, Any] | None = None) -> list[str]:
    """The pgbench command line: ``scripts`` (one ``-f`` each) with ``clients`` clients
    (``-j`` up to 2 threads), prepared statements, no vacuum, for ``-T seconds`` or ``-t
    transactions`` per client; ``defines`` become ``-D name=value``. Raises RuntimeError
    when pgbench cannot be found."""
    pgbench = find_binary("pgbench")
    if pgbench is None:
        raise RuntimeError("pgbench not found (install the PostgreSQL client tools)")
    length = ["-T", str(round(seconds))] if seconds is not None else ["-t", str(transactions or 20)]
    args = [pgbench, "-n", "-M", "prepared", "-c", str(clients), "-j", str(min(clients, 2)), *length]
    for script in scripts:
        args += ["-f", str(script)]
    for name, value in (defines or {}).items():
        args += ["-D", f"{name}={value}"]
    return [*args, conninfo(url)]


def pgbench_result(returncode: int, stdout: str, stderr: str) -> dict[str, float]:
    """tps (connection set-up excluded), transactions, average latency (ms) and failed
    transactions from pgbench's summary; RuntimeError if it failed or printed none."""
    import re

    if returncode != 0 or "tps =" not in stdout:
        raise RuntimeError(f"pgbench failed ({returncode}): {stderr[-1500:]}{stdout[-500:]}")
    tps = re.search(r"tps = ([\d.]+)", stdout)
    txns = re.search(r"number of transactions actually processed: (\d+)", stdout)
    lat = re.search(r"latency average = ([\d.]+) ms", stdout)
    failed = re.search(r"number of failed transactions: (\d+)", stdout)
    return {"tps": float(tps.group(1)) if tps else float("nan"), "transactions": int(txns.group(1)) if txns else 0,
            "latency_ms": float(lat.group(1)) if lat else float("nan"),
            "failed": int(failed.group(1)) if failed else 0}


def run_pgbench(command: list[str]) -> dict[str, float]:
    """Run a :func:`pgbench_command` to its end and read its summary (:func:`pgbench_result`)."""
    out = subprocess.run(command, capture_output=True, text=True, check=False)
    return pgbench_result(out.returncode, out.stdout, out.stderr)


class Databases:
    """Creates the template once and hands out fresh copies of it."""

    def __init__(self, server: URL) -> None:
        self.server = server
        self.template: URL | None = None

    def __enter__(self) -> Databases:
        self.template = migrated_template(self.server)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.template is not None:
            drop_quietly(self.template)

    @contextlib.contextmanager
    def fresh(self, migrated: bool = True) -> Iterator[URL]:
        """A new database (outbox's schema when ``migrated``), dropped afterwards."""
        template = self.template.database if migrated and self.template is not None else None
        url = create_database(self.server, "outbox_bench", template=template)
        try:
            yield url
        finally:
            drop_quietly(url)


def wait_for_server(url: URL, timeout: float = 90.0) -> bool:
    """Wait until the server accepts connections again (another user may restart it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with psycopg.connect(conninfo(url.set(database="postgres")), autocommit=True, connect_timeout=3) as c:
                c.execute("SELECT 1")
                return True
        except psycopg.Error:
            time.sleep(1.0)
    return False


def drop_quietly(url: URL) -> None:
    """Drop ``url``'s database, waiting out a server restart; log instead of raising."""
    for _attempt in range(3):
        try:
            drop_database(url)
            return
        except Exception as exc:  # noqa: BLE001 - a leftover database must not lose the results
            log(f"could not drop {url.database} ({type(exc).__name__}); retrying")
            wait_for_server(url)
    log(f"left database {url.database} behind; drop it by hand")


def is_server_restart(exc: BaseException) -> bool:
    """True for the errors a server restart or shutdown causes mid-run."""
    text = f"{exc} {getattr(exc, 'orig', '')}".lower()
    return any(s in text for s in ("terminating connection", "shutting down", "server closed the connection",
                                   "connection failed", "starting up", "connection refused", "consuming input failed"))


def engine(url: URL, pool_size: int = 5) -> Engine:
    return make_engine(url, pool_size=pool_size, application_name="outbox-bench")


def server_facts(url: URL) -> dict[str, Any]:
    """PostgreSQL version and the settings that matter, the CPU, the load."""
    with psycopg.connect(conninfo(url), autocommit=True) as conn:
        facts: dict[str, Any] = {"postgres": conn.execute("SELECT version()").fetchone()[0]}
        for name in ("server_version", "synchronous_commit", "shared_buffers", "fsync", "wal_level",
                     "max_connections", "work_mem", "autovacuum", "jit"):
            facts[name] = conn.execute(f"SHOW {name}").fetchone()[0]
    cpu = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    facts.update(cpu=cpu, cpus=os.cpu_count(), python=sys.version.split()[0],
                 load_before=os.getloadavg(), mem_gb=_mem_gb())
    return facts


def _mem_gb() -> float | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                return round(int(line.split()[1]) / 1024 / 1024, 1)
    return None


# ---------------------------------------------------------------- process stats


def proc_cpu(pid: int) -> float | None:
    """CPU seconds (user + system) used so far by process ``pid``, or None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def proc_rss_mb(pid: int) -> float | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return None


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of all CPUs so far, from /proc/stat."""
    parts = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = parts[3] + parts[4]
    return sum(parts) - idle, sum(parts)


def backend_pids(conn: psycopg.Connection, dbname: str) -> list[int]:
    return [r[0] for r in conn.execute(
        "SELECT pid FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()", (dbname,))]


def backends_cpu(conn: psycopg.Connection, dbname: str) -> float:
    """CPU seconds used so far by the server processes serving ``dbname`` (this one excluded)."""
    return sum(c for c in (proc_cpu(p) for p in backend_pids(conn, dbname)) if c is not None)


# ------------------------------------------------------------------------ relay


class RelayProcess:
    """``python -m outbox.ops.cli run --app bench.apps:fanout`` (or ``app``) as a subprocess on ``url``.

    ``settings`` are CLI flags (``concurrency=16`` -> ``--concurrency 16``), ``env`` extra
    environment (``BENCH_CONSUMERS``, ``BENCH_RECORD``); its log goes to ``log_path``.
    """

    def __init__(self, url: URL, log_path: Path, settings: dict[str, Any] | None = None,
                 env: dict[str, str] | None = None, listen: bool = True, app: str = "bench.apps:fanout") -> None:
        args = [sys.executable, "-m", "outbox.ops.cli", "run", "--app", app,
                "--database-url", conninfo(url), "--log-level", "WARNING"]
        for key, value in (settings or {}).items():
            args += ["--" + key.replace("_", "-"), str(value)]
        if not listen:
            args.append("--no-listen")
        self.url = url
        self.listen = listen
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(args, cwd=ROOT, env={**os.environ, **(env or {})},
                                     stdout=self._log, stderr=subprocess.STDOUT)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, consumers: int, timeout: float = 30.0) -> None:
        """Wait until the relay wrote its subscriptions and (unless ``--no-listen``) its
        listener is connected; its threads start right after."""
        deadline = time.monotonic() + timeout
        with psycopg.connect(conninfo(self.url), autocommit=True) as conn:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"relay exited with {self.proc.returncode}: {self.log_path.read_text()[-2000:]}")
                n = conn.execute("SELECT count(*) FROM outbox_subscriptions").fetchone()[0]
                listening = conn.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                    " AND application_name = 'outbox-listener'").fetchone()[0]
                if n >= consumers and (listening or not self.listen):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError("relay did not start in time")
                time.sleep(0.05)
        time.sleep(0.3)

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


# ------------------------------------------------------------------- workload


class SteadyPublisher(threading.Thread):
    """Commits one event of ``TOPIC`` per transaction on ``eng``, ``rate`` per second, from
    :meth:`start` until :meth:`stop`; ``published`` counts them."""

    def __init__(self, eng: Engine, rate: float) -> None:
        super().__init__(daemon=True)
        self.eng, self.rate = eng, rate
        self.published = 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        from outbox import publish

        began = time.perf_counter()
        while not self._stop_event.is_set():
            delay = began + self.published / self.rate - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            with self.eng.begin() as conn:
                publish(conn, TOPIC, {"n": self.published})
            self.published += 1

    def stop(self) -> None:
        """Stop publishing and wait for the transaction in flight."""
        self._stop_event.set()
        self.join()


def publish_events(eng: Engine, n: int, per_txn: int = 500, consumers_topic: str = TOPIC) -> float:
    """Publish ``n`` small events with ``publish_many``, ``per_txn`` per transaction;
    returns the seconds it took."""
    from outbox import publish_many

    start = time.perf_counter()
    done = 0
    while done < n:
        k = min(per_txn, n - done)
        with eng.begin() as conn:
            publish_many(conn, [(consumers_topic, {"n": done + i}) for i in range(k)])
        done += k
    return time.perf_counter() - start


def wait_drained(conn: psycopg.Connection, expected_jobs: int | None = None, timeout: float = 1800.0,
                 interval: float = 0.1, raise_on_timeout: bool = True) -> bool:
    """Wait until no event is unrouted and no job is ready, running or pending (and, when
    given, ``expected_jobs`` jobs exist); True when drained, False on timeout unless
    ``raise_on_timeout``. While work is left it asks only whether any is (``EXISTS``, which
    stops at the first live index entry; pending jobs are keyed, which lets the
    ordering index answer): counting the partial indexes ten times a second
    cost 46 us of database CPU per job of a 90,000-job run (37 ms a poll), on the two cores
    the relay and the database share, where PgQueuer's drain mode polls nothing. The rate is
    read from the database clock, so how soon this notices the end does not change it."""
    deadline = time.monotonic() + timeout
    while True:
        busy = conn.execute(
            "SELECT EXISTS (SELECT 1 FROM outbox_events WHERE routed_at IS NULL)"
            " OR EXISTS (SELECT 1 FROM outbox_jobs WHERE status = 'ready')"
            " OR EXISTS (SELECT 1 FROM outbox_jobs WHERE status = 'running')"
            " OR EXISTS (SELECT 1 FROM outbox_jobs WHERE ordering_key IS NOT NULL AND status = 'pending')"
        ).fetchone()[0]
        if not busy:
            if expected_jobs is None:
                return True
            if conn.execute("SELECT count(*) FROM outbox_jobs").fetchone()[0] >= expected_jobs:
                return True
        if time.monotonic() > deadline:
            if not raise_on_timeout:
                return False
            unrouted, pending = conn.execute(
                "SELECT (SELECT count(*) FROM outbox_events WHERE routed_at IS NULL),"
                " (SELECT count(*) FROM outbox_jobs WHERE status IN ('ready', 'running', 'pending'))").fetchone()
            raise RuntimeError(f"not drained after {timeout}s: {unrouted} unrouted events, {pending} jobs left")
        time.sleep(interval)


def subscribe(conn: psycopg.Connection, consumers: int, topic: str = TOPIC) -> None:
    """Write ``consumers`` subscriptions (c1..cK) on ``topic`` as a relay would."""
    conn.execute(
        "INSERT INTO outbox_subscriptions (topic, consumer, max_attempts, lease_seconds)"
        " SELECT %s, 'c' || i, 5, 30 FROM generate_series(1, %s) i ON CONFLICT DO NOTHING",
        (topic, consumers))


def sql_for_psycopg(statement: sa.TextClause) -> str:
    """An outbox named statement with ``:name`` binds turned into ``%(name)s``."""
    import re

    return re.sub(r"(?<![:\w]):(\w+)", r"%(\1)s", statement.text)
