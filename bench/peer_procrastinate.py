"""procrastinate, no-op task, one worker at concurrency 8, run in the peers' venv
(bench/.venv-peers) as ``python bench/peer_procrastinate.py CONNINFO --jobs N --cap S``.

Applies procrastinate's schema to the given (fresh) database, defers N jobs with
``batch_defer_async`` (5,000 per call), then runs ``run_worker_async(concurrency=8,
wait=False)``, which returns once the queue is empty. When draining takes longer than
``--cap`` seconds the worker is stopped there and the rate is the jobs finished so far
over the time taken (procrastinate processes jobs at a steady rate, so the rate of a
capped run is that of the whole drain). Prints one JSON line. Imports nothing from outbox.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import time


async def main(args: argparse.Namespace) -> dict:
    import procrastinate
    import psycopg

    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=args.conninfo))

    @app.task(name="noop")
    async def noop() -> None:
        return None

    async with app.open_async():
        await app.schema_manager.apply_schema_async()
        start = time.perf_counter()
        chunk = 5_000
        for i in range(0, args.jobs, chunk):
            await noop.batch_defer_async(*({} for _ in range(min(chunk, args.jobs - i))))
        enqueue_seconds = time.perf_counter() - start

        start = time.perf_counter()
        worker = asyncio.create_task(app.run_worker_async(
            concurrency=args.concurrency, wait=False, install_signal_handlers=False))
        capped = False
        try:
            await asyncio.wait_for(asyncio.shield(worker), args.cap)
        except TimeoutError:
            capped = True
        elapsed = time.perf_counter() - start
        async with await psycopg.AsyncConnection.connect(args.conninfo, autocommit=True) as conn:
            cur = await conn.execute("SELECT count(*) FROM procrastinate_jobs WHERE status = 'succeeded'")
            done = (await cur.fetchone())[0]
        if capped:
            worker.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(worker, 30)
    return {"peer": "procrastinate", "concurrency": args.concurrency, "jobs": args.jobs, "done": done,
            "capped": capped, "enqueue_seconds": enqueue_seconds, "seconds": elapsed,
            "jobs_per_s": done / elapsed}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("conninfo")
    parser.add_argument("--jobs", type=int, default=50_000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--cap", type=float, default=60.0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("procrastinate.blueprints").setLevel(logging.ERROR)  # "App is instantiated in the main module"
    print(json.dumps(asyncio.run(main(args))), flush=True)
