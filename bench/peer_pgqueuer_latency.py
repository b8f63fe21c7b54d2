"""PgQueuer's own latency beside outbox's (scenario 5), run in the peers' venv as
``python bench/peer_pgqueuer_latency.py CONNINFO --rate 1000 --seconds 15 --consumers 3``.

The shape of outbox's latency scenario: installs PgQueuer's schema on the given (fresh)
database; one PgQueuer instance at its defaults (LISTEN-driven ``continuous`` mode, batch
10) serves ``consumers`` entrypoints ``c1..cK`` that note ``time.time()`` as they start;
``PUBLISHERS`` threads, each with its own event loop and asyncpg connection, enqueue one
job per entrypoint in one statement (one transaction, one NOTIFY: PgQueuer's enqueue) on
a fixed schedule at ``rate`` a second for ``seconds``, noting ``time.time()`` when each
returns. Latency of a job = its entrypoint's start - its enqueue's commit (same machine,
same clock). Prints one JSON line: rate achieved, p50/p95/p99 in milliseconds (each the
median over three windows of equal counts in commit order, as outbox's scenario reports), jobs seen. Imports
nothing from outbox.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time

PUBLISHERS = 4
WINDOWS = 3


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


def publish(conninfo: str, consumers: int, rate: float, n: int, first: int, every: int, t0: float,
            commits: dict[int, float]) -> None:
    """Enqueue slots ``first, first + every, ...`` of ``n`` at ``t0 + slot / rate``."""
    async def go() -> None:
        import asyncpg
        from pgqueuer.db import AsyncpgDriver
        from pgqueuer.queries import Queries

        conn = await asyncpg.connect(dsn=conninfo)
        queries = Queries(AsyncpgDriver(conn))
        names = [f"c{i}" for i in range(1, consumers + 1)]
        for slot in range(first, n, every):
            delay = t0 + slot / rate - time.time()
            if delay > 0:
                await asyncio.sleep(delay)
            ids = await queries.enqueue(names, [None] * consumers, [0] * consumers)
            now = time.time()
            for job_id in ids:
                commits[int(job_id)] = now
        await conn.close()

    asyncio.run(go())


async def main(args: argparse.Namespace) -> dict:
    import asyncpg
    from pgqueuer import PgQueuer
    from pgqueuer.db import AsyncpgDriver
    from pgqueuer.queries import Queries

    setup = Queries(AsyncpgDriver(await asyncpg.connect(dsn=args.conninfo)))
    await setup.install()
    pgq = PgQueuer(AsyncpgDriver(await asyncpg.connect(dsn=args.conninfo)))
    starts: dict[int, float] = {}
    for i in range(1, args.consumers + 1):
        @pgq.entrypoint(f"c{i}")
        async def handler(job, _note=starts.__setitem__, _now=time.time) -> None:
            _note(int(job.id), _now())

    runner = asyncio.create_task(pgq.run())
    await asyncio.sleep(1.0)  # listening
    n = int(args.rate * args.seconds)
    commits: dict[int, float] = {}
    t0 = time.time() + 0.2
    threads = [threading.Thread(target=publish, args=(args.conninfo, args.consumers, args.rate, n, k, PUBLISHERS,
                                                      t0, commits)) for k in range(PUBLISHERS)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        await asyncio.sleep(0.1)
    published = time.time() - t0
    deadline = time.time() + 60
    while len(starts) < len(commits) and time.time() < deadline:
        await asyncio.sleep(0.1)
    pgq.shutdown.set()
    await asyncio.wait_for(runner, 30)
    seen = sorted((commits[j], starts[j] - commits[j]) for j in commits if j in starts)
    chunk = len(seen) // WINDOWS  # equal counts in commit order, as outbox's scenario cuts them
    windows = [[latency * 1000 for _, latency in seen[w * chunk:(w + 1) * chunk]] for w in range(WINDOWS)]
    out = {"peer": "pgqueuer", "rate_asked": args.rate, "rate_achieved": n / published, "jobs": len(commits),
           "seen": len(seen)}
    for p in (50, 95, 99):
        per_window = sorted(percentile(w, p) for w in windows if w)
        out[f"p{p}_ms"] = per_window[len(per_window) // 2]
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("conninfo")
    parser.add_argument("--rate", type=float, default=1000.0)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--consumers", type=int, default=3)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(main(args))), flush=True)
