"""Planner statistics of ``outbox_jobs``: the statistics keeper (:class:`StatisticsKeeper`) analyses
the table after bursts, so the claim keeps reading ``ix_outbox_jobs_ready`` in claim order
instead of sorting the whole ready backlog (docs/performance.md, finding 1); an ANALYZE
that cannot get its lock is skipped and never holds routing up.

Each test turns autovacuum off for its own ``outbox_jobs``: only the relay's ANALYZE may
refresh the statistics, so what the tests see does not depend on when autovacuum wakes.
"""

from __future__ import annotations

import sqlalchemy as sa

from outbox import Outbox
from outbox.db import queries
from outbox.relay.relay import Relay
from outbox.relay.router import route_all, route_batch
from outbox.relay.statistics import AnalyzeOutcome, StatisticsKeeper
from outbox.testing import wait_for

from .helpers import publish_events, running_relay, subscribe

CONSUMERS = ["a", "b", "c"]


def _no_autovacuum(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text("ALTER TABLE outbox_jobs SET (autovacuum_enabled = false)"))


def _publish(engine: sa.Engine, events: int) -> None:
    for start in range(0, events, 1000):
        publish_events(engine, "t", [{"n": n} for n in range(start, min(events, start + 1000))])


def _reltuples(engine: sa.Engine) -> float:
    """``pg_class.reltuples`` as stored: -1 while never analysed or vacuumed."""
    with engine.connect() as conn:
        return conn.execute(sa.text(
            "SELECT reltuples FROM pg_class WHERE oid = 'outbox_jobs'::regclass")).scalar_one()


def _unrouted(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return conn.execute(queries.event_unrouted_count).scalar_one()


def _claim_plan(engine: sa.Engine, limit: int) -> str:
    """EXPLAIN of the claim as a relay with consumers a, b, c would run it (not executed)."""
    with engine.connect() as conn:
        rows = conn.execute(sa.text("EXPLAIN " + queries.in_schema("public").job_claim_many.text), {
            "consumers": CONSUMERS, "leases": [30.0] * len(CONSUMERS), "limit": limit, "worker": "plan-guard",
        }).scalars().all()
        conn.rollback()
    return "\n".join(rows)


def _route_with_relay(ob: Outbox, settings, **overrides) -> Relay:
    """Start a relay that only routes (no workers, no maintenance), as the CLI would run it."""
    relay = Relay(ob, settings(**overrides), work=False, maintain=False)
    relay.start()
    return relay


# ------------------------------------------------------------------ plan guard


def test_claim_reads_the_ready_index_after_a_burst_into_a_never_analysed_table(engine, settings):
    ob = subscribe(engine, "t", CONSUMERS)
    _no_autovacuum(engine)
    assert _reltuples(engine) == -1  # freshly migrated: never analysed

    # Precondition, the failure this guards against: 21,000 ready jobs routed without the
    # keeper (plain route_all) leave the planner believing the table is nearly empty, so
    # the claim sorts every ready job (Bitmap Heap Scan + Sort) to take a few of them.
    _publish(engine, 7000)
    assert route_all(engine).jobs == 21_000
    for limit in (8, 50, 128):
        plan = _claim_plan(engine, limit)
        assert "Bitmap Heap Scan on outbox_jobs" in plan and "Sort Key: outbox_jobs.priority" in plan, plan
    assert _reltuples(engine) == -1

    # The relay's router path: its keeper analyses the table as the burst comes in.
    _publish(engine, 7000)
    relay = _route_with_relay(ob, settings)
    try:
        wait_for(lambda: _unrouted(engine) == 0, timeout=60, what="every event routed")
    finally:
        relay.stop()
    assert relay.stats["jobs_created"] == 21_000
    assert relay.router.statistics.analyzed >= 1
    assert _reltuples(engine) > 20_000

    # 42,000 ready jobs: the claim takes the first `limit` in (priority, run_at, id) order
    # straight from the partial index, at a cost that does not grow with the backlog.
    for limit in (8, 50, 128):
        plan = _claim_plan(engine, limit)
        assert "Index Scan using ix_outbox_jobs_ready on outbox_jobs" in plan, plan
        assert "Bitmap Heap Scan on outbox_jobs" not in plan, plan
        assert "Sort" not in plan, plan
        assert "Seq Scan on outbox_jobs" not in plan, plan


def _route_plan(engine: sa.Engine) -> str:
    """EXPLAIN of one routing round of 500 (not executed)."""
    with engine.connect() as conn:
        rows = conn.execute(sa.text("EXPLAIN " + queries.in_schema("public").event_route_many.text), {
            "limit": 500, "skip": [], "only": None, "channel": "outbox_jobs", "after": 0}).scalars().all()
        conn.rollback()
    return "\n".join(rows)


def _events_reltuples(engine: sa.Engine) -> float:
    with engine.connect() as conn:
        return conn.execute(sa.text(
            "SELECT reltuples FROM pg_class WHERE oid = 'outbox_events'::regclass")).scalar_one()


def test_route_walks_the_unrouted_index_once_the_keeper_gave_events_statistics(engine):
    subscribe(engine, "t", CONSUMERS)
    _no_autovacuum(engine)
    with engine.begin() as conn:
        conn.execute(sa.text("ALTER TABLE outbox_events SET (autovacuum_enabled = false)"))
    assert _events_reltuples(engine) == -1

    # Precondition, the failure this guards against: with a backlog of 6,000 unrouted events
    # and no statistics, the route's pick reads and sorts every unrouted event.
    _publish(engine, 6000)
    plan = _route_plan(engine)
    assert "Bitmap Heap Scan on outbox_events" in plan and "Sort Key: outbox_events.id" in plan, plan

    # The keeper's first ANALYZE (past its floor of 1,000 jobs) also analyses outbox_events.
    keeper = StatisticsKeeper(engine, floor=1000)
    with engine.begin() as conn:
        assert route_batch(conn, 500).jobs == 1500
    assert keeper.routed(1500) is AnalyzeOutcome.ANALYZED
    assert (keeper.analyzed, keeper.events_analyzed) == (1, 1)
    assert _events_reltuples(engine) == 6000

    # A larger backlog since: the pick walks the partial index in id order and stops at 500.
    _publish(engine, 6000)
    plan = _route_plan(engine)
    assert "Index Scan using ix_outbox_events_unrouted on outbox_events" in plan, plan
    assert "Bitmap Heap Scan on outbox_events" not in plan, plan
    assert "Sort Key: outbox_events.id" not in plan, plan

    # Later ANALYZEs of outbox_jobs leave outbox_events to autovacuum.
    with engine.begin() as conn:
        assert route_batch(conn, 1000).jobs == 3000
    assert keeper.routed(3000) is AnalyzeOutcome.ANALYZED
    assert (keeper.analyzed, keeper.events_analyzed) == (2, 1)


# ------------------------------------------------------------------ the rule


def test_keeper_analyses_only_past_its_trigger(engine):
    subscribe(engine, "t", ["a"])
    _no_autovacuum(engine)
    keeper = StatisticsKeeper(engine, floor=1000, fraction=0.5)

    _publish(engine, 1000)
    with engine.begin() as conn:
        assert route_batch(conn, 1000).jobs == 1000
    assert keeper.routed(1000) is AnalyzeOutcome.NOT_DUE  # not above the floor
    assert _reltuples(engine) == -1

    _publish(engine, 1)
    with engine.begin() as conn:
        assert route_batch(conn, 1000).jobs == 1
    assert keeper.routed(1) is AnalyzeOutcome.ANALYZED  # never analysed counts as 0 rows: the floor rules
    assert _reltuples(engine) == 1001
    assert (keeper.pending, keeper.analyzed) == (0, 1)

    # Analysed at 1,001 rows: the trigger is max(1,000, 0.5 * 1,001) = 1,000 jobs.
    _publish(engine, 1001)
    assert route_all(engine).jobs == 1001
    assert keeper.routed(1000) is AnalyzeOutcome.NOT_DUE
    assert keeper.routed(0) is AnalyzeOutcome.NOT_DUE
    assert keeper.routed(1) is AnalyzeOutcome.ANALYZED
    assert _reltuples(engine) == 2002
    # Analysed at 2,002 rows: the trigger is max(1,000, 0.5 * 2,002) = 1,001 jobs.
    assert keeper.routed(1001) is AnalyzeOutcome.NOT_DUE
    assert keeper.routed(1) is AnalyzeOutcome.ANALYZED
    assert (keeper.analyzed, keeper.skipped, keeper.failed) == (3, 0, 0)


def test_keeper_waits_for_the_table_to_double_but_at_most_its_cap(engine):
    """By default the next ANALYZE is due once the table may have doubled, and after at most
    ``at_most`` jobs however large the table (a day of done jobs must not hide a burst)."""
    subscribe(engine, "t", ["a"])
    _no_autovacuum(engine)
    _publish(engine, 3000)
    route_all(engine)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sa.text("ANALYZE outbox_jobs"))
    doubling = StatisticsKeeper(engine, floor=100)
    assert doubling.routed(3000) is AnalyzeOutcome.NOT_DUE  # analysed at 3,000 rows: due past 3,000
    assert doubling.routed(1) is AnalyzeOutcome.ANALYZED
    capped = StatisticsKeeper(engine, floor=100, at_most=500)
    assert capped.routed(500) is AnalyzeOutcome.NOT_DUE
    assert capped.routed(1) is AnalyzeOutcome.ANALYZED  # 501 of a 3,000-row table: the cap rules
    assert (doubling.analyzed, capped.analyzed) == (1, 1)


def test_keeper_does_not_analyse_again_what_someone_else_just_analysed(engine):
    subscribe(engine, "t", ["a"])
    _no_autovacuum(engine)
    _publish(engine, 3000)
    route_all(engine)
    keeper = StatisticsKeeper(engine, floor=1000, fraction=0.5)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sa.text("ANALYZE outbox_jobs"))  # another relay, or autovacuum
    # 1,200 routed since its own (never run) ANALYZE, but the table was analysed at 3,000
    # rows: the trigger is 1,500, read from pg_class, so no second ANALYZE yet.
    assert keeper.routed(1200) is AnalyzeOutcome.NOT_DUE
    assert keeper.analyzed == 0
    assert keeper.routed(301) is AnalyzeOutcome.ANALYZED


# ------------------------------------------------------------------ failures


def test_analyze_is_skipped_while_another_session_holds_a_conflicting_lock(engine, settings):
    ob = subscribe(engine, "t", ["a"])
    _no_autovacuum(engine)
    holder = engine.connect()
    holder.begin()
    # What autovacuum or another relay's ANALYZE holds; it does not conflict with routing.
    holder.execute(sa.text("LOCK TABLE outbox_jobs IN SHARE UPDATE EXCLUSIVE MODE"))
    try:
        _publish(engine, 3000)
        relay = _route_with_relay(ob, settings)
        try:
            wait_for(lambda: _unrouted(engine) == 0 and relay.router.statistics.skipped >= 1, timeout=30,
                     what="every event routed while the ANALYZE is skipped")
            assert relay.stats["jobs_created"] == 3000
            assert (relay.router.statistics.analyzed, relay.router.statistics.failed) == (0, 0)
            assert _reltuples(engine) == -1

            holder.rollback()  # the lock goes; the keeper tries again on a later round
            wait_for(lambda: relay.router.statistics.analyzed == 1, timeout=30, what="the retried ANALYZE")
        finally:
            relay.stop()
    finally:
        holder.close()
    assert _reltuples(engine) == 3000
    assert relay.router.statistics.pending == 0


def test_routing_goes_on_while_the_keepers_analyze_waits_for_its_lock(engine, settings):
    """The ANALYZE runs in the keeper's own thread: while it waits for its lock (held here by
    another session for as long as the keeper's lock_timeout allows), the router routes on.
    Run inline in the router's loop, as before, the first ANALYZE due held routing up for
    the whole wait: 1,000 of 3,000 events routed, the rest waiting on the ANALYZE."""
    ob = subscribe(engine, "t", ["a"])
    _no_autovacuum(engine)
    holder = engine.connect()
    holder.begin()
    holder.execute(sa.text("LOCK TABLE outbox_jobs IN SHARE UPDATE EXCLUSIVE MODE"))
    relay = Relay(ob, settings(route_batch=1000), work=False, maintain=False)
    relay.router.statistics = StatisticsKeeper(relay.engine, floor=500, lock_timeout=60.0)
    try:
        _publish(engine, 3000)
        relay.start()

        def analyze_waiting() -> bool:
            with engine.connect() as conn:
                return conn.execute(sa.text(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                    " AND query ILIKE 'ANALYZE%' AND wait_event_type = 'Lock'")).scalar_one() == 1

        wait_for(analyze_waiting, timeout=30, what="the keeper's ANALYZE waiting for its lock")
        wait_for(lambda: _unrouted(engine) == 0, timeout=30, what="every event routed while the ANALYZE waits")
        assert analyze_waiting() and relay.router.statistics.analyzed == 0
        assert relay.stats["jobs_created"] == 3000
        holder.rollback()  # the lock goes: the waiting ANALYZE runs
        wait_for(lambda: _reltuples(engine) == 3000 and relay.router.statistics.analyzed >= 1, timeout=30,
                 what="the ANALYZE once the lock went")
    finally:
        holder.close()
        relay.stop()
    assert relay.router.statistics.analyzed >= 1 and relay.router.statistics.failed == 0


def test_keeper_reports_a_lock_timeout_as_skipped_and_waits_before_retrying(engine):
    subscribe(engine, "t", ["a"])
    _no_autovacuum(engine)
    _publish(engine, 1500)
    route_all(engine)
    keeper = StatisticsKeeper(engine, floor=1000, retry_base=60.0, retry_cap=60.0)
    with engine.connect() as holder:
        holder.execute(sa.text("LOCK TABLE outbox_jobs IN SHARE UPDATE EXCLUSIVE MODE"))
        assert keeper.routed(1500) is AnalyzeOutcome.SKIPPED
        assert keeper.routed(10) is AnalyzeOutcome.NOT_DUE  # backing off: no second wait on the lock
        holder.rollback()
    assert (keeper.analyzed, keeper.skipped, keeper.failed, keeper.pending) == (0, 1, 0, 1510)
    assert _reltuples(engine) == -1


def test_keeper_survives_a_database_without_the_table(empty_db_url):
    from outbox.db.engine import make_engine

    engine = make_engine(empty_db_url)
    try:
        keeper = StatisticsKeeper(engine, floor=10)
        assert keeper.routed(11) is AnalyzeOutcome.FAILED  # logged, not raised
        assert (keeper.analyzed, keeper.skipped, keeper.failed) == (0, 0, 1)
    finally:
        engine.dispose()


def test_relay_vacuums_the_queue_tables_itself_when_autovacuum_is_off(engine, settings, caplog):
    """With autovacuum off for ``outbox_jobs`` the dead rows of finished and pruned jobs
    would pile up for ever: the relay's maintenance loop vacuums after each pruning round."""
    _no_autovacuum(engine)
    ob = Outbox()
    ob.subscriber("t", consumer="a")(lambda job: None)
    _publish(engine, 2000)
    caplog.set_level("WARNING", logger="outbox.relay")
    with running_relay(ob, settings(retention_done=0.001, prune_interval=0.5)) as relay:  # 0 would delete at completion
        wait_for(lambda: relay.stats["pruned_jobs"] == 2000 and relay.stats["vacuums"] >= 2, timeout=30,
                 what="jobs done and pruned, then a vacuum")

    def vacuumed() -> bool:  # the server's own count: the VACUUM really ran on outbox_jobs
        with engine.connect() as conn:
            return conn.execute(sa.text(
                "SELECT vacuum_count FROM pg_stat_user_tables WHERE relname = 'outbox_jobs'")).scalar_one() >= 1

    wait_for(vacuumed, timeout=10, what="pg_stat_user_tables to count the relay's VACUUM")
    assert any("autovacuum is off for outbox_jobs" in r.getMessage() for r in caplog.records)


# ------------------------------------------------------- claims after a redrive


def _jobs_read(plan: dict, limit: int) -> list[tuple[str, float]]:
    """Every scan of ``outbox_jobs`` in an EXPLAIN (ANALYZE, FORMAT JSON) plan whose rows
    read over all its loops exceed twice ``limit``: (index or scan, rows x loops)."""
    found = []
    stack = [plan]
    while stack:
        node = stack.pop()
        stack.extend(node.get("Plans", []))
        if node.get("Relation Name") == "outbox_jobs" and "Scan" in node["Node Type"]:
            read = node["Actual Rows"] * node["Actual Loops"] + node.get("Rows Removed by Filter", 0)
            if read > 2 * limit:
                found.append((node.get("Index Name", node["Node Type"]), read))
    return found


def test_claims_read_only_what_they_take_after_a_large_redrive(engine):
    """20,000 dead jobs, ANALYZE (the statistics now say none is ready), then a redrive of
    all of them: both claim statements read about as many job rows as they claim. Before
    the claim's update probed the primary key, the planner, trusting the statistics, joined
    the picked ids to a scan of every ready job: 20,000 rows read per picked row."""
    from outbox.admin import redrive

    subscribe(engine, "t", ["x"])
    _no_autovacuum(engine)
    with engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO outbox_events (topic, payload, routed_at)"
                             " SELECT 't', jsonb_build_object('n', g), now() FROM generate_series(1, 20000) g"))
        conn.execute(sa.text("INSERT INTO outbox_jobs (event_id, consumer, status, attempts, max_attempts, finished_at)"
                             " SELECT id, 'x', 'dead', 5, 5, now() FROM outbox_events"))
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sa.text("ANALYZE outbox_jobs"))
    with engine.begin() as conn:
        assert len(redrive(conn, consumer="x")) == 20_000
    claim = {"consumers": ["x"], "leases": [30.0], "limit": 50, "worker": "plan-guard"}
    after = {**claim, "after_priority": -32768, "after_run_at": "-infinity", "after_id": 0, "relay": None,
             "start_now": 0, "forwarding": [], "skip": [], "only": None}
    public = queries.in_schema("public")
    for statement, params in ((public.job_claim_many, claim), (public.job_claim_after_many, after)):
        with engine.connect() as conn:
            [plan] = conn.execute(sa.text("EXPLAIN (ANALYZE, FORMAT JSON) " + statement.text), params).scalar_one()
            conn.rollback()
        assert _jobs_read(plan["Plan"], 50) == [], plan


def test_fenced_completion_finds_its_jobs_by_primary_key_in_the_generic_plan(engine):
    """``job_complete_many`` as psycopg prepares it (a generic plan), 300 of 21,000 jobs running:
    the lock step, the UPDATE and the DELETE (``retention_done = 0``) probe ``pk_outbox_jobs``; through ``ix_outbox_jobs_lease``
    they read every running job, once per completed job (performance notes, "Issue 14")."""
    subscribe(engine, "t", CONSUMERS)
    _publish(engine, 7000)
    route_all(engine)
    with engine.begin() as conn:
        conn.execute(sa.text(
            "UPDATE outbox_jobs SET status = 'running', attempts = 1, fence = nextval('outbox_fence_seq'),"
            " lease_until = now() + interval '30 seconds' WHERE id IN (SELECT id FROM outbox_jobs ORDER BY id LIMIT 300)"))
        conn.execute(sa.text("ANALYZE outbox_jobs"))
    text = queries.in_schema("public").job_complete_many.text.replace(":ids", "$1").replace(":fences", "$2")
    text = text.replace(":keep_done", "$3")
    with engine.connect() as conn:
        conn.execute(sa.text("SET plan_cache_mode = force_generic_plan"))
        conn.exec_driver_sql(f"PREPARE complete_guard(bigint[], bigint[], boolean) AS {text}")
        plan = "\n".join(conn.exec_driver_sql(
            "EXPLAIN EXECUTE complete_guard('{1,2,3}', '{1,2,3}', true)").scalars().all())
        conn.rollback()
    assert "pk_outbox_jobs" in plan, plan
    assert "ix_outbox_jobs_lease" not in plan, plan
