"""Scenario 8, ordered delivery per key (issue 10): what ``ordered=True`` costs.

Three measurements, each against a baseline taken in the same run, interleaved:

* **ordered / unordered**: one consumer (``bench.apps:fanout`` with ``BENCH_CONSUMERS=1``),
  ``ordered_events`` events spread over ``ordered_keys`` keys, run once with the consumer
  unordered and once ordered (``BENCH_ORDERED=1``); jobs/s as in scenario 2 (first event
  created to last job done, database clock). Target: ordered >= 50 % of unordered.
* **hot key**: the same number of events, half of them on one key and the rest over the
  other keys; the figure is the rate at which the *other* keys' jobs finish, beside a run of
  the other keys' events alone (the same events, the hot key's left out). Target: the hot
  key cuts it by at most 20 %. Measured twice. *From a backlog* (the target's figure): the
  consumer is paused (``outbox-relay pause``) while the events are published and routed,
  and the rate is the other keys' jobs over the time from ``resume`` to the last of them
  done, so both runs do the same consumer-side work but for the hot key's chain. *Live*
  (for information): published while the relay runs, from the first event created; the
  hot run then also publishes and routes twice as many events inside its window, which
  the baseline does not, so this ratio charges the hot key with the cost of its events'
  publishing and routing as well. A hot run ends once the other keys' jobs are done: the
  hot key's own chain (one job at a time, a few hundred a second) would take a minute more
  and is not part of either figure.
* **claim cost behind a blocked key**: no relay; a database with ``claim_ready`` ready jobs,
  and a copy that also has one dead job blocking a key with ``blocked_jobs`` pending jobs
  queued behind it. A loop claims :data:`CLAIM_BATCH` jobs and completes them
  (``job_claim_many`` + ``job_complete_many``, the relay's statements) on each database in
  turn for ``claim_seconds`` each; the figure is the median seconds per claim. Target: <= 1.2x the cost
  with none blocked.

Events go out with ``publish_many`` (500 per transaction), keys ``k0..k{keys-1}`` in turn.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg

from .common import ROOT, TOPIC, Databases, RelayProcess, Size, conninfo, engine, log, median, wait_drained

HOT_KEY = "hot"
BLOCKED_KEY = "blocked"
CLAIM_BATCH = 50


def publish_keyed(eng: Any, n: int, keys: int, hot_share: float = 0.0, per_txn: int = 500,
                  without_hot: bool = False) -> tuple[int, int]:
    """Publish ``n`` events over ``keys`` keys; with ``hot_share`` > 0 that share of them
    (every other event at 0.5) goes to :data:`HOT_KEY` instead, or, ``without_hot``, is left
    out (the other keys' events alone, for the baseline). Returns how many were published,
    and how many of them on the hot key."""
    from outbox import publish_many

    every = round(1 / hot_share) if hot_share else 0
    done = published = on_hot = 0
    while done < n:
        items = []
        for i in range(done, min(n, done + per_txn)):
            hot = bool(every) and i % every == 0
            if not (hot and without_hot):
                on_hot += hot
                items.append({"topic": TOPIC, "payload": {"n": i}, "key": HOT_KEY if hot else f"k{i % keys}"})
        with eng.begin() as conn:
            publish_many(conn, items)
        done += per_txn
        published += len(items)
    return published, on_hot


def relay_run(dbs: Databases, size: Size, results: Path, tag: str, *, ordered: bool,
              hot_share: float = 0.0, without_hot: bool = False, backlog: bool = False) -> dict[str, Any]:
    """One relay (defaults but ``ordered_settings``) draining ``ordered_events`` keyed events
    (fewer ``without_hot``: see :func:`publish_keyed`). The clock starts at the first event
    created, or, with ``backlog``, at ``outbox-relay resume`` of the consumer, paused while
    the events were published and routed."""
    events = size.ordered_events
    with dbs.fresh() as url:
        relay = RelayProcess(url, results / "logs" / f"relay-ordered-{tag}.log", size.ordered_settings,
                             env={"BENCH_CONSUMERS": "1", "BENCH_ORDERED": "1" if ordered else "0"})
        try:
            relay.wait_ready(1)
            if backlog:
                flow_command(url, "pause")
            eng = engine(url)
            with psycopg.connect(conninfo(url), autocommit=True) as mon:
                events, on_hot = publish_keyed(eng, events, size.ordered_keys, hot_share, without_hot=without_hot)
                start = "(SELECT min(created_at) FROM outbox_events)"
                if backlog:
                    wait_routed(mon, timeout=size.e2e_cap * 3)
                    resumed_at = mon.execute("SELECT now()").fetchone()[0]
                    flow_command(url, "resume")
                    start = "CAST(%(resumed_at)s AS timestamptz)"
                if on_hot:  # the other keys' jobs are what is measured
                    drained = wait_others_done(mon, events - on_hot, timeout=size.e2e_cap * 3)
                else:
                    drained = wait_drained(mon, expected_jobs=events, timeout=size.e2e_cap * 3, raise_on_timeout=False)
                t0, t1, jobs, others, others_t1 = mon.execute(
                    f"SELECT {start},"
                    " (SELECT max(finished_at) FROM outbox_jobs WHERE status = 'done'),"
                    " (SELECT count(*) FROM outbox_jobs WHERE status = 'done'),"
                    " (SELECT count(*) FROM outbox_jobs j JOIN outbox_events e ON e.id = j.event_id"
                    "   WHERE j.status = 'done' AND e.key <> %(hot)s),"
                    " (SELECT max(j.finished_at) FROM outbox_jobs j JOIN outbox_events e ON e.id = j.event_id"
                    "   WHERE j.status = 'done' AND e.key <> %(hot)s)",
                    {"hot": HOT_KEY, "resumed_at": resumed_at if backlog else None}).fetchone()
            eng.dispose()
        finally:
            relay.stop()
    out = {"events": events, "jobs": jobs, "jobs_per_s": jobs / (t1 - t0).total_seconds(),
           "other_keys_per_s": others / (others_t1 - t0).total_seconds(), "drained": drained}
    log(f"ordered {tag}: {out['jobs_per_s']:,.0f} jobs/s, other keys {out['other_keys_per_s']:,.0f} jobs/s"
        f" ({jobs} jobs{'' if drained else ', NOT DRAINED'})")
    return out


def flow_command(url: Any, command: str) -> None:
    """``outbox-relay pause c1`` or ``resume c1`` on the database at ``url``, as an operator runs it
    (the command of the Python running the bench, as the relays are: its virtualenv need not be on PATH)."""
    env = dict(os.environ, OUTBOX_DATABASE_URL=url.render_as_string(hide_password=False))
    subprocess.run([sys.executable, "-m", "outbox.ops.cli", command, "c1"], env=env, check=True, capture_output=True,
                   cwd=ROOT)


def wait_others_done(conn: psycopg.Connection, expected: int, timeout: float, interval: float = 0.25) -> bool:
    """Wait until ``expected`` jobs of keys other than :data:`HOT_KEY` are done; False on timeout."""
    deadline = time.monotonic() + timeout
    while conn.execute("SELECT count(*) FROM outbox_jobs j JOIN outbox_events e ON e.id = j.event_id"
                       " WHERE j.status = 'done' AND e.key <> %s", (HOT_KEY,)).fetchone()[0] < expected:
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


def wait_routed(conn: psycopg.Connection, timeout: float) -> None:
    """Wait until no event is left unrouted (the consumer is paused: its jobs wait)."""
    deadline = time.monotonic() + timeout
    while conn.execute("SELECT EXISTS (SELECT 1 FROM outbox_events WHERE routed_at IS NULL)").fetchone()[0]:
        if time.monotonic() > deadline:
            raise TimeoutError(f"events still unrouted after {timeout:.0f} s")
        time.sleep(0.05)


def seed_claimable(conn: psycopg.Connection, ready: int, blocked: int) -> None:
    """``ready`` ready jobs of an ordered consumer ``c1`` (one key each), and when
    ``blocked`` > 0 one dead job holding :data:`BLOCKED_KEY` with ``blocked`` pending jobs
    behind it; statistics analysed, as a relay's router keeps them."""
    conn.execute("INSERT INTO outbox_subscriptions (topic, consumer, max_attempts, lease_seconds, ordered)"
                 " VALUES (%s, 'c1', 5, 30, true)", (TOPIC,))
    conn.execute(
        "WITH e AS (INSERT INTO outbox_events (topic, key, payload, routed_at)"
        " SELECT %(topic)s, CASE WHEN g <= %(ready)s THEN 'k' || g ELSE %(blocked_key)s END, '{}', now()"
        " FROM generate_series(1, %(total)s) g RETURNING id, key)"
        " INSERT INTO outbox_jobs (event_id, consumer, max_attempts, status, ordering_key, finished_at)"
        " SELECT id, 'c1', 5, CASE WHEN key <> %(blocked_key)s THEN 'ready'"
        "   WHEN id = (SELECT min(id) FROM e WHERE key = %(blocked_key)s) THEN 'dead' ELSE 'pending' END,"
        " key, CASE WHEN key = %(blocked_key)s THEN now() END FROM e",
        {"topic": TOPIC, "ready": ready, "blocked_key": BLOCKED_KEY, "total": ready + (blocked + 1 if blocked else 0)})
    conn.execute("ANALYZE outbox_jobs")
    conn.execute("ANALYZE outbox_events")


def claim_costs(dbs: Databases, size: Size) -> tuple[float, float]:
    """Median seconds per claim of :data:`CLAIM_BATCH` (claim + complete) with no key
    blocked and with ``blocked_jobs`` behind a blocked key. The two databases take turns,
    one claim each, for ``claim_seconds`` each, so whatever else loads the machine weighs
    on both alike."""
    from outbox.db.jobs import claim_jobs, complete_jobs

    with dbs.fresh() as clear_url, dbs.fresh() as blocked_url, \
            psycopg.connect(conninfo(clear_url), autocommit=True) as clear, \
            psycopg.connect(conninfo(blocked_url), autocommit=True) as blocked:
        seed_claimable(clear, size.claim_ready, 0)
        seed_claimable(blocked, size.claim_ready, size.blocked_jobs)
        times: dict[int, list[float]] = {0: [], 1: []}
        deadline = time.monotonic() + 2 * size.claim_seconds
        while time.monotonic() < deadline:
            for side, conn in enumerate((clear, blocked)):
                t = time.perf_counter()
                jobs = claim_jobs(conn, {"c1": 30.0}, CLAIM_BATCH, "bench")
                complete_jobs(conn, jobs)
                times[side].append(time.perf_counter() - t)
            if not jobs:
                break
    return median(times[0]), median(times[1])


def run(dbs: Databases, size: Size, results: Path) -> dict[str, Any]:
    unordered, ordered, hot, others, clear, behind = [], [], [], [], [], []
    hot_backlog, others_backlog = [], []
    for rep in range(size.runs):
        unordered.append(relay_run(dbs, size, results, f"unordered-{rep}", ordered=False))
        ordered.append(relay_run(dbs, size, results, f"ordered-{rep}", ordered=True))
        hot.append(relay_run(dbs, size, results, f"hot-{rep}", ordered=True, hot_share=0.5))
        others.append(relay_run(dbs, size, results, f"others-{rep}", ordered=True, hot_share=0.5, without_hot=True))
        hot_backlog.append(relay_run(dbs, size, results, f"hot-backlog-{rep}", ordered=True, hot_share=0.5,
                                     backlog=True))
        others_backlog.append(relay_run(dbs, size, results, f"others-backlog-{rep}", ordered=True, hot_share=0.5,
                                        without_hot=True, backlog=True))
        cost, cost_blocked = claim_costs(dbs, size)
        clear.append(cost)
        behind.append(cost_blocked)
        log(f"claim cost {rep}: {clear[-1] * 1e3:.2f} ms with no key blocked, "
            f"{behind[-1] * 1e3:.2f} ms with {size.blocked_jobs:,} jobs behind a blocked key")
    return {
        "events": size.ordered_events, "keys": size.ordered_keys, "settings": size.ordered_settings,
        "unordered_jobs_per_s": median([r["jobs_per_s"] for r in unordered]),
        "ordered_jobs_per_s": median([r["jobs_per_s"] for r in ordered]),
        "ordered_ratio": median([o["jobs_per_s"] / u["jobs_per_s"] for o, u in zip(ordered, unordered)]),
        "hot_other_keys_per_s": median([r["other_keys_per_s"] for r in hot_backlog]),
        "others_alone_per_s": median([r["jobs_per_s"] for r in others_backlog]),
        "hot_ratio": median([h["other_keys_per_s"] / o["jobs_per_s"] for h, o in zip(hot_backlog, others_backlog)]),
        "hot_live_other_keys_per_s": median([r["other_keys_per_s"] for r in hot]),
        "others_live_alone_per_s": median([r["jobs_per_s"] for r in others]),
        "hot_live_ratio": median([h["other_keys_per_s"] / o["jobs_per_s"] for h, o in zip(hot, others)]),
        "claim_ready": size.claim_ready, "blocked_jobs": size.blocked_jobs,
        "claim_ms": median(clear) * 1e3, "claim_blocked_ms": median(behind) * 1e3,
        "claim_ratio": median([b / c for b, c in zip(behind, clear)]),
        "runs": {"unordered": unordered, "ordered": ordered, "hot": hot, "others": others,
                 "hot_backlog": hot_backlog, "others_backlog": others_backlog, "claim_s": clear,
                 "claim_blocked_s": behind},
    }
