"""PgQueuer's drain benchmark shape, run in the peers' venv (bench/.venv-peers) as
``python bench/peer_pgqueuer.py CONNINFO --jobs N --driver apg --batch 10 --dequeue 5``.

Like PgQueuer's own ``tools/benchmark.py --strategy drain``: install its schema on the
given (fresh) database, enqueue N jobs in one call, then ``--dequeue`` PgQueuer instances,
each on its own connection, drain them with no-op entrypoints in ``drain`` mode. Between
the two, outside the clock, ``ANALYZE`` gives PgQueuer's tables current statistics, as
autovacuum would on most servers (it is off on this machine's CI server, and without it
PgQueuer's dequeue plan degrades on a 150,000-job queue: 4,700 instead of 11,000 jobs/s in
one run); outbox's relay analyses its own table after bursts. Prints one JSON line: enqueue
seconds, drain seconds, jobs/s. Imports nothing from outbox.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time


async def make_driver(kind: str, dsn: str):
    from pgqueuer.db import AsyncpgDriver, AsyncpgPoolDriver, PsycopgDriver

    if kind == "apg":
        import asyncpg

        return AsyncpgDriver(await asyncpg.connect(dsn=dsn))
    if kind == "apgpool":
        import asyncpg

        return AsyncpgPoolDriver(await asyncpg.create_pool(dsn=dsn))
    if kind == "psy":
        import psycopg

        return PsycopgDriver(await psycopg.AsyncConnection.connect(conninfo=dsn, autocommit=True))
    raise ValueError(kind)


async def main(args: argparse.Namespace) -> dict:
    from pgqueuer import PgQueuer
    from pgqueuer.queries import Queries
    from pgqueuer.types import QueueExecutionMode

    setup = Queries(await make_driver("apg", args.conninfo))
    await setup.install()
    start = time.perf_counter()
    chunk = 50_000
    for i in range(0, args.jobs, chunk):
        k = min(chunk, args.jobs - i)
        await setup.enqueue(["noop"] * k, [None] * k, [0] * k)
    enqueue_seconds = time.perf_counter() - start
    import asyncpg

    stats = await asyncpg.connect(dsn=args.conninfo)
    await stats.execute("ANALYZE")
    await stats.close()

    done = 0
    pgqs = []
    for _ in range(args.dequeue):
        pgq = PgQueuer(await make_driver(args.driver, args.conninfo))

        @pgq.entrypoint("noop")
        async def noop(job) -> None:
            nonlocal done
            done += 1

        pgqs.append(pgq)
    start = time.perf_counter()
    await asyncio.gather(*(p.run(batch_size=args.batch, mode=QueueExecutionMode.drain) for p in pgqs))
    drain_seconds = time.perf_counter() - start
    left = sum(s.count for s in await setup.queue_size() if s.status in ("queued", "picked"))
    return {"peer": "pgqueuer", "driver": args.driver, "batch": args.batch, "dequeue": args.dequeue,
            "jobs": args.jobs, "done": done, "left": left, "enqueue_seconds": enqueue_seconds,
            "seconds": drain_seconds, "jobs_per_s": done / drain_seconds}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("conninfo")
    parser.add_argument("--jobs", type=int, default=50_000)
    parser.add_argument("--driver", default="apg", choices=("apg", "apgpool", "psy"))
    parser.add_argument("--batch", type=int, default=10)
    parser.add_argument("--dequeue", type=int, default=5)
    args = parser.parse_args()
    try:
        import uvloop

        result = uvloop.run(main(args))
    except ImportError:
        result = asyncio.run(main(args))
    print(json.dumps(result), flush=True)
