"""Scenario 3, the peers: PgQueuer, procrastinate and awa (``awa-pg``) on the same number
of jobs as the end-to-end scenario (3 N), on the same server, in the same invocation.

They live in their own virtualenv, ``bench/.venv-peers``, built from
``bench/requirements-peers.txt`` on first use (and rebuilt when that file changes); their
workloads run there as subprocesses (``bench/peer_pgqueuer.py``,
``bench/peer_procrastinate.py``, ``bench/peer_awa.py``), each on a fresh database. None
is ever a dependency of outbox. awa-pg shares the venv: it requires no other package, so
nothing of the others' can conflict with it.

PgQueuer: a short sweep over driver and batch size (on the sweep size), then its best
configuration ``runs`` times on 3 N jobs. procrastinate: concurrency 8, one drain (some
30 times slower than the others, it is far from every ratio's target: more runs would add
a minute and decide nothing), stopped after ``procrastinate_cap`` seconds (see
peer_procrastinate.py). awa:
a short sweep over worker permits and claim batch (``Size.awa_sweep``, on the sweep size),
then its best configuration ``runs`` times on 3 N jobs; its drain is timed after a COPY
enqueue, and the enqueue + drain rate of the same runs is kept beside it (see
peer_awa.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .common import BENCH, Databases, Size, conninfo, create_database, drop_quietly, log, median

VENV = BENCH / ".venv-peers"
REQUIREMENTS = BENCH / "requirements-peers.txt"
PGQ_SWEEP = (("apg", 10), ("apg", 50), ("apg", 200), ("psy", 200))  # driver, batch size


def venv_python() -> Path:
    return VENV / "bin" / "python"


def ensure_venv() -> Path:
    """Create or refresh bench/.venv-peers from requirements-peers.txt; returns its python."""
    stamp = VENV / ".requirements.sha256"
    digest = hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()
    if venv_python().exists() and stamp.exists() and stamp.read_text() == digest:
        return venv_python()
    log(f"creating the peers' venv {VENV} from {REQUIREMENTS.name} (first use, about 20 s)")
    if not venv_python().exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    subprocess.run([str(venv_python()), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                    "-r", str(REQUIREMENTS)], check=True)
    stamp.write_text(digest)
    return venv_python()


def peer(script: str, url: Any, *args: str) -> dict[str, Any]:
    out = subprocess.run([str(venv_python()), str(BENCH / script), conninfo(url), *args],
                         capture_output=True, text=True, check=False, timeout=900)
    lines = [l for l in out.stdout.splitlines() if l.startswith("{")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{script} failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(lines[-1])


def run(dbs: Databases, size: Size, results: Path) -> dict[str, Any]:
    ensure_venv()
    with awa_template(dbs) as template:
        return _run(dbs, size, template)


def _run(dbs: Databases, size: Size, template: str) -> dict[str, Any]:
    versions = subprocess.run([str(venv_python()), "-c", "import importlib.metadata as m; "
                               "print(m.version('pgqueuer'), m.version('procrastinate'), m.version('awa-pg'))"],
                              capture_output=True, text=True, check=True).stdout.split()
    jobs, sweep_jobs = size.events * 3, size.sweep_events * 3
    sweep = []
    for driver, batch in PGQ_SWEEP:
        with dbs.fresh(migrated=False) as url:
            r = peer("peer_pgqueuer.py", url, "--jobs", str(sweep_jobs), "--driver", driver, "--batch", str(batch))
        log(f"pgqueuer sweep driver={driver} batch={batch}: {r['jobs_per_s']:,.0f} jobs/s")
        sweep.append(r)
    best = max(sweep, key=lambda r: r["jobs_per_s"])
    awa_sweep = []
    for workers, claim_batch in size.awa_sweep:
        r = awa(dbs, template, sweep_jobs, workers, claim_batch, size.awa_cap)
        log(f"awa sweep workers={workers} claim_batch={claim_batch}: {r['jobs_per_s']:,.0f} jobs/s")
        awa_sweep.append(r)
    awa_best = max(awa_sweep, key=lambda r: r["jobs_per_s"])
    pgq_runs, pro_runs, awa_runs = [], [], []
    for _rep in range(size.runs):
        with dbs.fresh(migrated=False) as url:
            r = peer("peer_pgqueuer.py", url, "--jobs", str(jobs), "--driver", best["driver"],
                     "--batch", str(best["batch"]))
        log(f"pgqueuer driver={r['driver']} batch={r['batch']}: {r['jobs_per_s']:,.0f} jobs/s ({r['done']} jobs)")
        pgq_runs.append(r)
        if not pro_runs:
            with dbs.fresh(migrated=False) as url:
                r = peer("peer_procrastinate.py", url, "--jobs", str(jobs), "--concurrency", "8",
                         "--cap", str(size.procrastinate_cap))
            log(f"procrastinate concurrency 8: {r['jobs_per_s']:,.0f} jobs/s ({r['done']} of {jobs} jobs"
                f"{', capped' if r['capped'] else ''})")
            pro_runs.append(r)
        r = awa(dbs, template, jobs, awa_best["workers"], awa_best["claim_batch"], size.awa_cap)
        log(f"awa workers={r['workers']} claim_batch={r['claim_batch']}: {r['jobs_per_s']:,.0f} jobs/s, "
            f"{r['jobs_per_s_with_enqueue']:,.0f} with the enqueue ({r['done']} of {jobs} jobs"
            f"{', capped' if r['capped'] else ''})")
        awa_runs.append(r)
    return {
        "versions": {"pgqueuer": versions[0], "procrastinate": versions[1], "awa-pg": versions[2]},
        "jobs": jobs,
        "pgqueuer": {"jobs_per_s": median([r["jobs_per_s"] for r in pgq_runs]), "driver": best["driver"],
                     "batch": best["batch"], "dequeue": best["dequeue"], "sweep": sweep, "runs": pgq_runs},
        "procrastinate": {"jobs_per_s": median([r["jobs_per_s"] for r in pro_runs]), "concurrency": 8,
                          "capped": any(r["capped"] for r in pro_runs), "cap_seconds": size.procrastinate_cap,
                          "runs": pro_runs},
        "awa": {"jobs_per_s": median([r["jobs_per_s"] for r in awa_runs]),
                "jobs_per_s_with_enqueue": median([r["jobs_per_s_with_enqueue"] for r in awa_runs]),
                "workers": awa_best["workers"], "claim_batch": awa_best["claim_batch"], "pool": awa_best["pool"],
                "capped": any(r["capped"] for r in awa_runs), "cap_seconds": size.awa_cap,
                "sweep": awa_sweep, "runs": awa_runs},
    }


@contextlib.contextmanager
def awa_template(dbs: Databases) -> Iterator[str]:
    """A database holding awa's schema (its migrations and queue storage, 1.7 MB of SQL:
    7-37 s each on this machine), made once per invocation; each awa run gets a copy
    (``CREATE DATABASE ... TEMPLATE``, under a second), like outbox's own runs. Yields its
    name; dropped afterwards."""
    with dbs.fresh(migrated=False) as url:
        r = peer("peer_awa.py", url, "--migrate-only")
        log(f"awa schema installed in a template in {r['migrate_seconds']:.1f}s")
        assert url.database is not None
        yield url.database


def awa(dbs: Databases, template: str, jobs: int, workers: int, claim_batch: int, cap: float) -> dict[str, Any]:
    """One awa drain of ``jobs`` no-op jobs on a fresh copy of ``template`` (awa_template)."""
    url = create_database(dbs.server, "outbox_bench", template=template)
    try:
        return peer("peer_awa.py", url, "--jobs", str(jobs), "--workers", str(workers),
                    "--claim-batch", str(claim_batch), "--cap", str(cap))
    finally:
        drop_quietly(url)
