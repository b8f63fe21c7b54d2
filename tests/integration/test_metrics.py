"""Prometheus metrics of a relay, over real HTTP: a known workload, ``/metrics`` scraped over
a socket and parsed with prometheus_client's parser, values checked against the database;
the database gauges, their plans with many done rows, and one gatherer among relays."""

from __future__ import annotations

import http.client
import sys
from typing import Any

import pytest
import sqlalchemy as sa

from outbox import Job, Outbox, PermanentError, fenced_write
from outbox.errors import ConfigurationError
from outbox.relay import pacing
from outbox.relay.relay import Relay
from outbox.telemetry.metrics import read_gauges
from outbox.testing import wait_for

from .helpers import publish_events, running_relay

parser = pytest.importorskip("prometheus_client.parser", reason="the extra 'metrics' (prometheus_client) is not "
                             "installed")

TIMEOUT = 30
N = 12


def scrape(relay: Relay) -> dict[str, list[Any]]:
    """GET /metrics of ``relay`` over TCP; samples by name (prometheus_client's parser)."""
    assert relay.metrics_server is not None
    conn = http.client.HTTPConnection("127.0.0.1", relay.metrics_server.port, timeout=10)
    try:
        conn.request("GET", "/metrics")
        response = conn.getresponse()
        assert response.status == 200
        assert response.getheader("Content-Type", "").startswith("text/plain")
        body = response.read().decode()
    finally:
        conn.close()
    samples: dict[str, list[Any]] = {}
    for family in parser.text_string_to_metric_families(body):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def value(samples: dict[str, list[Any]], name: str, **labels: str) -> float | None:
    for sample in samples.get(name, []):
        if all(sample.labels.get(k) == v for k, v in labels.items()):
            return float(sample.value)
    return None


def db_counts(engine: sa.Engine) -> dict[tuple[str, str], int]:
    with engine.connect() as c:
        return {(r.consumer, r.status): r.n for r in c.execute(sa.text(
            "SELECT consumer, status, count(*) AS n FROM outbox_jobs GROUP BY consumer, status"))}


def workload_app(engine: sa.Engine) -> Outbox:
    """``ok`` succeeds, ``flaky`` fails twice then dead (max_attempts=2), ``perm`` raises
    PermanentError, ``tx`` is transactional and its fenced_write is always stale."""
    with engine.begin() as c:
        c.execute(sa.text("CREATE TABLE ledger (k text PRIMARY KEY, v int, fence bigint NOT NULL)"))
        c.execute(sa.text("INSERT INTO ledger VALUES ('x', 0, 9223372036854775807)"))
    ledger = sa.Table("ledger", sa.MetaData(), sa.Column("k", sa.Text, primary_key=True), sa.Column("v", sa.Integer),
                      sa.Column("fence", sa.BigInteger))
    ob = Outbox()

    @ob.subscriber("t", consumer="ok")
    def ok(job: Job) -> None:
        pass

    @ob.subscriber("t", consumer="flaky", max_attempts=2)
    def flaky(job: Job) -> None:
        raise RuntimeError("flaky fails")

    @ob.subscriber("t", consumer="perm")
    def perm(job: Job) -> None:
        raise PermanentError("never")

    @ob.subscriber("t", consumer="tx", transactional=True)
    def tx(job: Job, session: Any) -> None:
        fenced_write(session, ledger, key={"k": "x"}, values={"v": job.payload["n"]}, fence=job.fence)

    return ob


def test_metrics_after_a_known_workload_agree_with_the_database(engine, settings):
    ob = workload_app(engine)
    with running_relay(ob, settings(metrics_port=0, metrics_interval=1.0, backoff_base=0.01, backoff_cap=0.02)) as relay:
        publish_events(engine, "t", [{"n": i} for i in range(N)])
        publish_events(engine, "nobody.listens", [{"n": i} for i in range(3)])
        final = {("ok", "done"): N, ("flaky", "dead"): N, ("perm", "dead"): N, ("tx", "done"): N}
        wait_for(lambda: db_counts(engine) == final, timeout=TIMEOUT, what="every job finished")

        def settled() -> dict[str, list[Any]] | None:
            s = scrape(relay)
            return s if (value(s, "outbox_jobs_in_status", consumer="flaky", status="dead") == N
                         and value(s, "outbox_jobs_total", consumer="tx", outcome="done") == N) else None

        samples = wait_for(settled, timeout=TIMEOUT, what="metrics to show the final state")

    def jobs(consumer: str, outcome: str) -> float | None:
        return value(samples, "outbox_jobs_total", consumer=consumer, outcome=outcome)

    # Counters of this process: each outcome as written.
    assert (jobs("ok", "claimed"), jobs("ok", "done")) == (N, N)
    assert (jobs("flaky", "claimed"), jobs("flaky", "retried"), jobs("flaky", "dead")) == (2 * N, N, N)
    assert (jobs("perm", "claimed"), jobs("perm", "dead"), jobs("perm", "retried")) == (N, N, None)
    assert (jobs("tx", "claimed"), jobs("tx", "done")) == (N, N)
    assert jobs("ok", "stale") is None and jobs("ok", "lease_lost") is None
    assert value(samples, "outbox_stale_writes_rejected_total") == N  # tx's fenced writes were all refused
    assert value(samples, "outbox_events_routed_total") == N + 3
    assert value(samples, "outbox_events_unsubscribed_total") == 3
    # Histograms: one handler run per attempt; its start latency is measured on the database clock.
    assert value(samples, "outbox_handler_duration_seconds_count", consumer="ok") == N
    assert value(samples, "outbox_handler_duration_seconds_count", consumer="flaky") == 2 * N
    assert value(samples, "outbox_handler_duration_seconds_bucket", consumer="ok", le="+Inf") == N
    assert value(samples, "outbox_job_start_latency_seconds_count", consumer="perm") == N
    latency = value(samples, "outbox_job_start_latency_seconds_sum", consumer="ok")
    assert latency is not None and 0 <= latency / N < TIMEOUT
    assert (value(samples, "outbox_claim_round_trip_seconds_count") or 0) >= 1
    # Gauges read from the database, against the database.
    assert value(samples, "outbox_metrics_gatherer") == 1
    for consumer in ("ok", "flaky", "perm", "tx"):
        for status in ("ready", "running", "dead"):
            assert value(samples, "outbox_jobs_in_status", consumer=consumer, status=status) == \
                db_counts(engine).get((consumer, status), 0), (consumer, status)
        assert value(samples, "outbox_oldest_ready_job_age_seconds", consumer=consumer) == 0
    assert value(samples, "outbox_unrouted_events") == 0


def test_gauges_agree_with_a_seeded_database_and_read_only_partial_indexes(engine):
    with engine.begin() as c:
        c.execute(sa.text("INSERT INTO outbox_events (topic, payload) SELECT 't', '{}' FROM generate_series(1, 60000)"))
        c.execute(sa.text("UPDATE outbox_events SET routed_at = now() WHERE id <= 59990"))  # 10 unrouted
        c.execute(sa.text("UPDATE outbox_events SET created_at = now() - interval '90 seconds' WHERE id = "
                          "(SELECT min(id) FROM outbox_events WHERE routed_at IS NULL)"))
        c.execute(sa.text("""
            INSERT INTO outbox_jobs (event_id, consumer, status, run_at, finished_at, max_attempts, lease_until)
            SELECT id, CASE WHEN id % 2 = 0 THEN 'a' ELSE 'b' END,
                   CASE WHEN id <= 59900 THEN 'done' WHEN id <= 59930 THEN 'ready' WHEN id <= 59950 THEN 'running'
                        ELSE 'dead' END,
                   CASE WHEN id = 59901 THEN now() - interval '120 seconds'
                        WHEN id BETWEEN 59925 AND 59930 THEN now() + interval '1 hour' ELSE now() END,
                   CASE WHEN id <= 59900 THEN now() END, 5,
                   CASE WHEN id BETWEEN 59931 AND 59950 THEN now() + interval '1 minute' END
            FROM outbox_events WHERE id <= 59990"""))
        c.execute(sa.text("INSERT INTO outbox_subscriptions (topic, consumer, max_attempts, lease_seconds) VALUES ('t', 'idle', 5, 30)"))
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
        c.execute(sa.text("VACUUM ANALYZE outbox_jobs"))
        c.execute(sa.text("VACUUM ANALYZE outbox_events"))
    with engine.connect() as c:
        reading = read_gauges(c)
        expected = {(r.consumer, r.status): r.n for r in c.execute(sa.text(
            "SELECT consumer, status, count(*) AS n FROM outbox_jobs WHERE status IN ('ready', 'running', 'dead') "
            "GROUP BY consumer, status"))}
    for consumer in ("a", "b", "idle"):
        for status in ("ready", "running", "dead"):
            assert reading.jobs[(consumer, status)] == expected.get((consumer, status), 0), (consumer, status)
    assert reading.jobs[("idle", "ready")] == 0  # a subscribed consumer with no jobs reads 0, not nothing
    assert 119 <= reading.oldest_ready["b"] < 120 + TIMEOUT  # job 59901 (b), due for 120 s
    assert 0 <= reading.oldest_ready["a"] < TIMEOUT and reading.oldest_ready["idle"] == 0
    assert reading.unrouted == 10 and 89 <= reading.oldest_unrouted < 90 + TIMEOUT

    from outbox.db import queries

    statements = queries.in_schema()
    indexes = {"job_ready_gauges": "ix_outbox_jobs_ready", "job_running_counts": "ix_outbox_jobs_lease",
               "job_dead_counts": "ix_outbox_jobs_dead", "event_unrouted_gauges": "ix_outbox_events_unrouted"}
    with engine.connect() as c:
        for name, index in indexes.items():
            plan = "\n".join(c.execute(sa.text("EXPLAIN " + getattr(statements, name).text)).scalars())
            assert index in plan, f"{name} does not read {index}:\n{plan}"
            assert "Seq Scan" not in plan, f"{name} scans a whole table:\n{plan}"


def _relay(ob: Outbox, settings: Any, name: str) -> Relay:
    return Relay(ob, settings(metrics_port=0, metrics_interval=1.0), worker_id=f"test:{name}")


def test_one_relay_of_two_reads_the_database_gauges_and_another_takes_over_when_it_stops(engine, settings):
    ob = Outbox()
    ob.subscriber("t", consumer="a")(lambda job: None)
    first, second = _relay(ob, settings, "first"), _relay(ob, settings, "second")
    first.start()
    second.start()
    stopped: list[Relay] = []
    try:
        def one_gatherer() -> tuple[Relay, Relay] | None:
            a, b = scrape(first), scrape(second)
            flags = (value(a, "outbox_metrics_gatherer"), value(b, "outbox_metrics_gatherer"))
            if flags == (1, 0) and value(a, "outbox_jobs_in_status", consumer="a", status="ready") is not None:
                return first, second
            if flags == (0, 1) and value(b, "outbox_jobs_in_status", consumer="a", status="ready") is not None:
                return second, first
            return None

        gatherer, other = wait_for(one_gatherer, timeout=TIMEOUT, what="one gatherer")
        for _ in range(3):  # several rounds later, still one
            other_samples = scrape(other)
            assert value(other_samples, "outbox_metrics_gatherer") == 0
            assert "outbox_jobs_in_status" not in other_samples and "outbox_unrouted_events" not in other_samples
            assert value(other_samples, "outbox_claim_round_trip_seconds_count") is not None  # its own counters
            assert other.gauges is not None and other.gauges.readings == 0
        gatherer.stop()
        stopped.append(gatherer)
        wait_for(lambda: value(scrape(other), "outbox_metrics_gatherer") == 1, timeout=TIMEOUT,
                 what="the other relay to take over")
        assert value(scrape(other), "outbox_unrouted_events") == 0
    finally:
        for relay in (first, second):
            if relay not in stopped:
                relay.stop()


def test_pacing_gauges_show_the_pool_the_claims_and_the_standby(engine, settings):
    """At the defaults the gauges follow the pacing: the pool's threads (8, or more while a
    growth stands: idle threads beyond 8 end after 30 s), claims paced within
    50..250, jobs handed ahead while quick jobs flow, a standby dispatcher parked (0) once
    idle. With every size set they are the settings, nothing ahead, and no standby gauge."""
    ob = Outbox()
    ob.subscriber("t", consumer="a")(lambda job: None)
    with running_relay(ob, settings(metrics_port=0)) as relay:
        assert relay.runner is not None
        publish_events(engine, "t", [{"n": i} for i in range(3_000)])
        ahead: list[float] = []

        def drained() -> bool:
            ahead.append(value(scrape(relay), "outbox_relay_ahead_slots") or 0)
            return db_counts(engine) == {("a", "done"): 3_000}

        wait_for(drained, timeout=TIMEOUT, interval=0.05, what="3,000 quick jobs done")
        samples = scrape(relay)
        threads = relay.runner.claims.concurrency  # 8, or more while a growth of the elastic pool stands
        assert value(samples, "outbox_relay_worker_threads") == threads and 8 <= threads <= pacing.THREADS_MAX
        assert 50 <= (value(samples, "outbox_relay_claim_batch") or 0) <= 250
        assert max(ahead) > 0, ahead  # quick jobs were handed ahead while they flowed
        wait_for(lambda: value(scrape(relay), "outbox_relay_standby_dispatcher_running") == 0, timeout=TIMEOUT,
                 what="the standby dispatcher parked")
    fixed = settings(metrics_port=0, concurrency=4, claim_batch=30, prefetch=10, dispatchers=1)
    with running_relay(ob, fixed) as relay:
        samples = scrape(relay)
        assert [value(samples, f"outbox_relay_{name}") for name in ("worker_threads", "ahead_slots", "claim_batch")] \
            == [4, 0, 30]
        assert "outbox_relay_standby_dispatcher_running" not in samples


def test_metrics_port_without_prometheus_client_is_refused(settings, monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # as if the extra were not installed
    with pytest.raises(ConfigurationError, match=r"outbox-relay\[metrics\]"):
        Relay(Outbox(), settings(metrics_port=0))
