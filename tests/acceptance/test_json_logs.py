"""The relay's log as JSON (``outbox-relay run --log-format json``): every line one JSON
object; the state-change lines carry the job's fields; at DEBUG one line per finished job;
a topic with no subscriber is named at WARNING once per topic."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.engine import URL

from outbox.testing import wait_for

from ..integration.helpers import publish_events

APP = '''
from outbox import Job, Outbox, PermanentError

ob = Outbox()


@ob.subscriber("t", consumer="ok")
def ok(job: Job) -> None:
    pass


@ob.subscriber("t", consumer="bad", max_attempts=2)
def bad(job: Job) -> None:
    raise RuntimeError("bad fails")


@ob.subscriber("t", consumer="perm")
def perm(job: Job) -> None:
    raise PermanentError("never")
'''

N = 5


def _statuses(engine: sa.Engine) -> dict[tuple[str, str], int]:
    with engine.connect() as c:
        return {(r.consumer, r.status): r.n for r in c.execute(sa.text(
            "SELECT consumer, status, count(*) AS n FROM outbox_jobs GROUP BY consumer, status"))}


def _routed(engine: sa.Engine) -> bool:
    with engine.connect() as c:
        return not c.execute(sa.text("SELECT count(*) FROM outbox_events WHERE routed_at IS NULL")).scalar()


def test_json_log_lines_parse_and_carry_the_jobs_fields(engine, db_url: URL, tmp_path: Path):
    (tmp_path / "jsonapp.py").write_text(textwrap.dedent(APP))
    log_path = tmp_path / "relay.log"
    environ = {**os.environ, "OUTBOX_DATABASE_URL": db_url.render_as_string(hide_password=False),
               "PYTHONUNBUFFERED": "1", "OUTBOX_LOG_FORMAT": "json"}
    environ.pop("OUTBOX_TEST_DATABASE_URL", None)
    with open(log_path, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "outbox.ops.cli", "run", "--app", "jsonapp:ob", "--log-level",
                                 "DEBUG", "--backoff-base", "0.01", "--backoff-cap", "0.02", "--poll-interval", "0.1"],
                                cwd=tmp_path, env=environ, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_for(lambda: "relay started" in log_path.read_text() or proc.poll() is not None, timeout=20,
                     what="relay start")
            assert proc.poll() is None, log_path.read_text()
            publish_events(engine, "t", [{"n": i} for i in range(N)])
            publish_events(engine, "nobody.listens", [{"n": 1}])
            wait_for(lambda: _routed(engine), timeout=20, what="the first unsubscribed event routed")
            publish_events(engine, "nobody.listens", [{"n": 2}, {"n": 3}])  # a later round, within the minute
            publish_events(engine, "nobody.either", [{"n": 4}])
            final = {("ok", "done"): N, ("bad", "dead"): N, ("perm", "dead"): N}
            wait_for(lambda: _statuses(engine) == final and _routed(engine), timeout=30, what="every job finished")
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(20) == 0
    lines = [line for line in log_path.read_text().splitlines() if line.strip()]
    entries = [json.loads(line) for line in lines]  # every line is one JSON object
    for entry in entries:
        assert {"ts", "level", "logger", "message"} <= entry.keys(), entry
    with engine.connect() as c:
        jobs = {r.id: r for r in c.execute(sa.text("SELECT id, event_id, consumer, fence, attempts FROM outbox_jobs"))}

    def about(**fields: object) -> list[dict]:
        return [e for e in entries if all(e.get(k) == v for k, v in fields.items())]

    dead = about(outcome="dead", level="ERROR")
    assert len(dead) == 2 * N
    for entry in dead:
        job = jobs[entry["job_id"]]
        assert (entry["event_id"], entry["consumer"], entry["fence"], entry["attempt"]) == (
            job.event_id, job.consumer, job.fence, job.attempts)
        assert entry["topic"] == "t" and entry["duration_seconds"] >= 0 and entry["message"].startswith("dead-lettered")
    retried = about(outcome="retried", consumer="bad")
    assert len(retried) == N and all(e["attempt"] == 1 and e["delay_seconds"] >= 0 for e in retried)
    done = about(outcome="done", level="DEBUG")  # one DEBUG line per finished job
    assert sorted(e["job_id"] for e in done) == sorted(i for i, j in jobs.items() if j.consumer == "ok")
    # A topic with no subscriber: one WARNING naming it, however many rounds met it within the minute.
    unsubscribed = [e for e in entries if e["level"] == "WARNING" and "matched no subscription" in e["message"]]
    assert sorted((e["topic"], e["events"]) for e in unsubscribed) == [("nobody.either", 1), ("nobody.listens", 1)]
    assert all(repr(e["topic"]) in e["message"] for e in unsubscribed)
