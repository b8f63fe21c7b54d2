"""awa (PyPI ``awa-pg``: a Rust core with a Python SDK) drain benchmark, run in the
peers' venv (bench/.venv-peers) as ``python bench/peer_awa.py CONNINFO --jobs N
--workers 256 --claim-batch 512``.

On the given (fresh) database: awa's own migrations (``AsyncClient.migrate``) and its
queue-storage engine (``install_queue_storage``, the engine 0.6 runs fresh installs on;
``migrate`` alone leaves the older canonical one active), then N no-op jobs enqueued with
``enqueue_many_copy`` (COPY into queue storage, 10,000 per call) on one queue, then
``ANALYZE`` as for PgQueuer (autovacuum is off on this machine's CI server), all outside
the clock. The clock runs from ``AsyncClient.start`` (one queue, ``--workers`` worker
permits, ``--claim-batch`` jobs per claim) until the database holds N completions, read
every 50 ms on a connection of the harness's own. awa's ``awa.jobs`` and
``awa.terminal_jobs`` views reconstruct every job and take about 10 s for 3,000 jobs, so
the poll counts completions where queue storage records them: ``completed_count`` of
``awa.receipt_completion_batches`` (one row per completed claim batch), completed rows of
``awa.done_entries``, and ``pruned_completed_count`` of ``awa.queue_terminal_rollups``: a
ring slot whose jobs are all finished is pruned a second or two later and its
completions move into that counter (the sum was seen unchanged across the move). A drain
longer than ``--cap`` seconds stops there (the rate is then the completions so far over
the time taken). Every job keeps awa's lease (``run_lease``) and heartbeat machinery; the
handler only counts its calls.

Prints one JSON line: migration, enqueue and drain seconds, jobs/s of the drain and of
enqueue + drain. Imports nothing from outbox.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass

QUEUE = "bench"
COMPLETED = ("SELECT (SELECT coalesce(sum(completed_count), 0) FROM awa.receipt_completion_batches WHERE queue = %s)"
             " + (SELECT count(*) FROM awa.done_entries WHERE queue = %s AND state = 'completed')"
             " + (SELECT coalesce(sum(pruned_completed_count), 0) FROM awa.queue_terminal_rollups WHERE queue = %s)")


@dataclass
class Noop:
    """The job's arguments: none (awa derives the kind ``noop`` from the name)."""


async def completed(conn) -> int:
    cur = await conn.execute(COMPLETED, (QUEUE, QUEUE, QUEUE))
    return int((await cur.fetchone())[0])


async def main(args: argparse.Namespace) -> dict:
    import awa
    import psycopg

    client = awa.AsyncClient(args.conninfo, max_connections=args.pool)
    start = time.perf_counter()
    await client.migrate()  # a no-op on a copy of a migrated template (peers.py)
    await client.install_queue_storage()
    migrate_seconds = time.perf_counter() - start
    if args.migrate_only:
        return {"migrate_seconds": migrate_seconds}

    start = time.perf_counter()
    chunk = 10_000
    for i in range(0, args.jobs, chunk):
        await client.enqueue_many_copy([Noop() for _ in range(min(chunk, args.jobs - i))], queue=QUEUE)
    enqueue_seconds = time.perf_counter() - start

    handled = 0

    @client.task(Noop, queue=QUEUE)
    async def noop(job) -> None:
        nonlocal handled
        handled += 1

    async with await psycopg.AsyncConnection.connect(args.conninfo, autocommit=True) as conn:
        await conn.execute("ANALYZE")
        start = time.perf_counter()
        queue = {"name": QUEUE, "max_workers": args.workers, "claim_batch_size": args.claim_batch}
        if args.claimers:
            queue["claimers"] = args.claimers
        await client.start([queue])
        capped = False
        while (done := await completed(conn)) < args.jobs:
            if time.perf_counter() - start > args.cap:
                capped = True
                break
            await asyncio.sleep(0.05)
        drain_seconds = time.perf_counter() - start
        await client.shutdown(timeout_ms=5000)
        final = await completed(conn)
    await client.close()
    return {"peer": "awa", "workers": args.workers, "claim_batch": args.claim_batch, "pool": args.pool,
            "claimers": args.claimers,
            "jobs": args.jobs, "done": done, "done_after_shutdown": final, "handled": handled, "capped": capped,
            "migrate_seconds": migrate_seconds, "enqueue_seconds": enqueue_seconds, "seconds": drain_seconds,
            "jobs_per_s": done / drain_seconds,
            "jobs_per_s_with_enqueue": done / (enqueue_seconds + drain_seconds)}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("conninfo")
    parser.add_argument("--jobs", type=int, default=50_000)
    parser.add_argument("--workers", type=int, default=256, help="worker permits of the queue (max_workers)")
    parser.add_argument("--claim-batch", type=int, default=512, help="jobs per claim (claim_batch_size)")
    parser.add_argument("--pool", type=int, default=20, help="the client's connection pool (max_connections)")
    parser.add_argument("--claimers", type=int, help="claim loops sharing the queue's permits (default: awa's)")
    parser.add_argument("--cap", type=float, default=300.0, help="seconds a drain may take")
    parser.add_argument("--migrate-only", action="store_true", help="install awa's schema and stop (a template)")
    args = parser.parse_args()
    print(json.dumps(asyncio.run(main(args))), flush=True)
