"""Flow control across relays, by the database (architecture notes, "Flow control"):
concurrency caps, rate limits, pause / resume, and what ``outbox-relay status`` shows."""

from __future__ import annotations

import threading
import time
from typing import Any

import sqlalchemy as sa

from outbox import Job, Outbox
from outbox.ops.cli import main
from outbox.testing import wait_for

from .helpers import publish_events, running_relay, running_relays

TIMEOUT = 60.0


def _counts(engine: sa.Engine, consumer: str) -> dict[str, int]:
    with engine.connect() as c:
        return dict(c.execute(sa.text("SELECT status, count(*) FROM outbox_jobs WHERE consumer = :c GROUP BY status"),
                              {"c": consumer}).all())


def _cli(db_url: sa.URL, *argv: str) -> int:
    return main([argv[0], "--database-url", db_url.render_as_string(hide_password=False), *argv[1:]])


class _Sampler:
    """Reads the number of running jobs of ``consumer`` from the database, again and again,
    on a thread of its own, until stopped; keeps the largest seen."""

    def __init__(self, engine: sa.Engine, consumer: str) -> None:
        self.engine, self.consumer, self.most, self.samples = engine, consumer, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with self.engine.connect() as c:
            while not self._stop.is_set():
                n = c.execute(sa.text("SELECT count(*) FROM outbox_jobs WHERE status = 'running' AND consumer = :c"),
                              {"c": self.consumer}).scalar_one()
                c.rollback()
                self.most, self.samples = max(self.most, n), self.samples + 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def test_a_concurrency_cap_holds_across_two_relays(engine, settings):
    lock = threading.Lock()
    state = {"now": 0, "most": 0}
    ob = Outbox()

    @ob.subscriber("t", consumer="capped", concurrency=3)
    def capped(job: Job) -> None:
        with lock:
            state["now"] += 1
            state["most"] = max(state["most"], state["now"])
        time.sleep(0.05)  # the work: holds its slot a while, so both relays contend for the cap
        with lock:
            state["now"] -= 1

    publish_events(engine, "t", [{"n": i} for i in range(40)])
    sampler = _Sampler(engine, "capped")
    try:
        with running_relays(2, ob, settings(concurrency=8, prefetch=8, claim_batch=50, poll_interval=0.2)) as relays:
            wait_for(lambda: _counts(engine, "capped").get("done") == 40, timeout=TIMEOUT, what="all 40 jobs done")
    finally:
        sampler.stop()
    assert sampler.samples > 10
    assert sampler.most <= 3, f"{sampler.most} running at once, cap 3"
    assert 1 <= state["most"] <= 3
    assert sum(r.runner.stats["claimed"] for r in relays) == 40


def test_a_rate_limit_holds_across_two_relays_by_the_database_clock(engine, settings):
    # Every claim's time, by the database clock of the claiming statement.
    with engine.begin() as c:
        c.execute(sa.text("CREATE TABLE claim_log (job_id bigint, at timestamptz)"))
        c.execute(sa.text("""
            CREATE FUNCTION log_claim() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN INSERT INTO claim_log VALUES (NEW.id, statement_timestamp()); RETURN NEW; END $$"""))
        c.execute(sa.text("""
            CREATE TRIGGER log_claim AFTER UPDATE OF status ON outbox_jobs FOR EACH ROW
            WHEN (NEW.status = 'running' AND OLD.status <> 'running') EXECUTE FUNCTION log_claim()"""))
    ob = Outbox()
    ob.subscriber("t", consumer="limited", rate_limit="5/s")(lambda job: None)
    publish_events(engine, "t", [{"n": i} for i in range(25)])
    with running_relays(2, ob, settings(concurrency=8, prefetch=8, poll_interval=0.5)):
        wait_for(lambda: _counts(engine, "limited").get("done") == 25, timeout=TIMEOUT, what="all 25 jobs done")
    with engine.connect() as c:
        times = [t.timestamp() for t in c.execute(sa.text("SELECT at FROM claim_log ORDER BY at")).scalars()]
    assert len(times) == 25
    # Rate 5/s, capacity max(1, 5) = 5: any 1-second window holds at most 5 + 5 claims.
    most = max(sum(1 for u in times if t <= u < t + 1.0) for t in times)
    assert most <= 10, f"{most} claims within one second, rate 5/s"


def _paused_app(seen: list[int]) -> Outbox:
    ob = Outbox()
    ob.subscriber("t", consumer="paused")(lambda job: seen.append(job.id))
    ob.subscriber("t", consumer="paused_capped", concurrency=2)(lambda job: seen.append(job.id))
    ob.subscriber("t", consumer="free")(lambda job: None)
    return ob


def test_a_paused_consumer_is_never_claimed_across_a_restart_and_resume_drains_it(engine, settings, db_url, capsys):
    # Paused before any relay declared them: the rows are created by the pause.
    assert _cli(db_url, "pause", "paused") == 0
    assert _cli(db_url, "pause", "paused_capped") == 0
    assert "no relay has declared it yet" in capsys.readouterr().out
    seen: list[int] = []
    publish_events(engine, "t", [{"n": i} for i in range(10)])
    with running_relay(_paused_app(seen), settings(poll_interval=0.2)):
        # The free consumer's jobs all ran: the relay had every chance to claim the paused ones.
        wait_for(lambda: _counts(engine, "free").get("done") == 10, timeout=TIMEOUT, what="free consumer done")
        assert _counts(engine, "paused") == {"ready": 10}
        assert _counts(engine, "paused_capped") == {"ready": 10}
    # The pause outlives the relay: a new one (whose start writes the registry's options) claims none either.
    publish_events(engine, "t", [{"n": i} for i in range(10, 15)])
    with running_relay(_paused_app(seen), settings(poll_interval=0.2)):
        wait_for(lambda: _counts(engine, "free").get("done") == 15, timeout=TIMEOUT, what="free consumer done again")
        assert _counts(engine, "paused") == {"ready": 15}
        assert _counts(engine, "paused_capped") == {"ready": 15}
        assert seen == []
        with engine.connect() as c:
            assert c.execute(sa.text("SELECT sum(attempts) FROM outbox_jobs WHERE consumer LIKE 'paused%'")).scalar() == 0
        capsys.readouterr()
        assert _cli(db_url, "pause", "paused") == 0
        assert "already paused" in capsys.readouterr().out
        assert _cli(db_url, "resume", "paused") == 0
        assert _cli(db_url, "resume", "paused_capped") == 0
        out = capsys.readouterr().out
        assert out.count("resumed consumer") == 2, out
        wait_for(lambda: _counts(engine, "paused").get("done") == 15 and _counts(engine, "paused_capped").get("done")
                 == 15, timeout=TIMEOUT, what="paused consumers drained after resume")
    assert sorted(seen) == sorted(set(seen)) and len(seen) == 30
    assert _cli(db_url, "resume", "paused") == 0
    assert "was not paused" in capsys.readouterr().out


def test_status_shows_paused_consumers_caps_and_rate_limits(engine, settings, db_url, capsys):
    ob = Outbox()
    ob.subscriber("t", consumer="capped", concurrency=4)(lambda job: None)
    ob.subscriber("t", consumer="limited", rate_limit=2.5)(lambda job: None)
    ob.subscriber("t", consumer="plain")(lambda job: None)
    from outbox.relay.relay import register_subscriptions

    register_subscriptions(engine, ob, settings())
    assert _cli(db_url, "pause", "plain") == 0
    capsys.readouterr()
    assert _cli(db_url, "status") == 0
    lines: dict[str, Any] = {}
    out = capsys.readouterr().out
    flow = out[out.index("flow control"):]  # the flow-control table, after the jobs per consumer
    for line in flow.splitlines():
        lines.setdefault(line.split(" ")[0], line.split())
    assert lines["capped"][1:] == ["-", "4", "-", "0"], out
    assert lines["limited"][1:] == ["-", "-", "2.5/s", "0"], out
    assert lines["plain"][1] != "-" and lines["plain"][2:] == ["-", "-", "0"], out


def test_the_main_claim_leaves_paused_and_limited_consumers_out_and_keeps_reading_the_ready_index(engine, db_url):
    from outbox.db import queries
    from outbox.db.jobs import claim_candidates, claim_jobs, complete_and_claim_after

    ob = Outbox()
    for consumer in ("a", "paused", "capped"):
        ob.subscriber("t", consumer=consumer, concurrency=2 if consumer == "capped" else None)(lambda job: None)
    from outbox.relay.relay import register_subscriptions
    from outbox.settings import OutboxSettings

    register_subscriptions(engine, ob, OutboxSettings(_env_file=None))
    assert _cli(db_url, "pause", "paused") == 0
    # 20,000 ready jobs of two consumers (the paused one a tenth), analysed; then a few capped ones.
    # With two distinct consumers the planner rates ``consumer <> ALL (ARRAY(SELECT ...))`` at
    # 0.5 ** 10 of the rows and sorts a sequential scan: ``NOT IN (SELECT ...)`` keeps the index.
    with engine.begin() as c:
        c.execute(sa.text("INSERT INTO outbox_events (topic, payload, routed_at) "
                          "SELECT 't', '{}', now() FROM generate_series(1, 20000)"))
        c.execute(sa.text("INSERT INTO outbox_jobs (event_id, consumer, max_attempts) "
                          "SELECT id, CASE WHEN id % 10 = 0 THEN 'paused' ELSE 'a' END, 5 FROM outbox_events"))
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
        c.execute(sa.text("ANALYZE outbox_jobs, outbox_consumers"))
    with engine.begin() as c:
        c.execute(sa.text("INSERT INTO outbox_jobs (event_id, consumer, max_attempts, priority) "
                          "SELECT id, 'capped', 5, -1 FROM outbox_events WHERE id <= 20"))
    leases = {"a": 30.0, "paused": 30.0, "capped": 30.0}
    with engine.begin() as c:
        plan = "\n".join(c.execute(sa.text("EXPLAIN " + queries.in_schema().job_claim_many.text), {
            "consumers": list(leases), "leases": list(leases.values()), "limit": 50, "worker": "w"}).scalars())
        assert "Index Scan using ix_outbox_jobs_ready" in plan and "Sort" not in plan, plan
        claimed = claim_jobs(c, leases, 50, "w")
        _, after, _ = complete_and_claim_after(c, [], leases, 50, "w", None)
        candidates = claim_candidates(c, list(leases), 50, [])
        c.rollback()
    assert {j.consumer for j in claimed + after} == {"a"} and len(claimed) == len(after) == 50
    with engine.connect() as c:
        consumers = set(c.execute(sa.text("SELECT consumer FROM outbox_jobs WHERE id = ANY(:ids)"),
                                  {"ids": candidates}).scalars())
    assert consumers == {"a"}


def test_an_empty_bucket_makes_the_dispatcher_wait_for_the_next_token_not_spin(engine, settings):
    ob = Outbox()
    ob.subscriber("t", consumer="slow", rate_limit="4/s")(lambda job: None)
    publish_events(engine, "t", [{"n": i} for i in range(12)])
    with running_relay(ob, settings(concurrency=4, poll_interval=1.0)) as relay:
        wait_for(lambda: _counts(engine, "slow").get("done") == 12, timeout=TIMEOUT, what="all 12 jobs done")
    # 4 at once from the full bucket, then one per token (every 0.25 s): about 9 limited
    # claims, each after the next token is due; a dispatcher retrying an empty bucket at
    # once would run thousands in the ~2 s this takes.
    assert 3 <= relay.runner.producer.flow.claims <= 40, relay.runner.producer.flow.claims


def test_a_full_cap_makes_the_dispatcher_wait_for_a_slot_not_spin(engine, settings):
    gate = threading.Event()
    ob = Outbox()
    ob.subscriber("t", consumer="one", concurrency=1)(lambda job: gate.wait(TIMEOUT))
    publish_events(engine, "t", [{"n": i} for i in range(3)])
    with running_relay(ob, settings(concurrency=4, poll_interval=0.3)) as relay:
        try:
            wait_for(lambda: _counts(engine, "one").get("running") == 1, timeout=TIMEOUT, what="the cap full")
            flow = relay.runner.producer.flow
            seen = [flow.claims]
            # While the cap is full the dispatcher tries again once per poll_interval: sampled every
            # 50 ms, the count of limited claims rises by one at a time (a spinning one jumps by dozens).
            wait_for(lambda: seen.append(flow.claims) or len(set(seen)) >= 3, timeout=TIMEOUT,
                     what="two more limited claims")
            assert max(b - a for a, b in zip(seen, seen[1:], strict=False)) <= 2, seen
            assert _counts(engine, "one") == {"running": 1, "ready": 2}
            gate.set()
            wait_for(lambda: _counts(engine, "one").get("done") == 3, timeout=TIMEOUT, what="all 3 jobs done")
        finally:
            gate.set()
