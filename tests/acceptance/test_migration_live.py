"""Upgrading a live queue (issue 14): the newest migration, run as an operator runs it
(``outbox-relay migrate``, a process of its own), while relays and publishers of the previous
release work on a queue holding jobs in every status; then a relay of this release takes over
(a rolling restart). Written against "the revision before head -> head", whichever migration
is newest.

**The previous release** is the source tree of the commit before the one that added the
newest migration (``git archive`` of ``outbox/`` and ``alembic/``), first on the
``PYTHONPATH`` of its processes. Its relays pass their schema check at the previous revision
(this release's refuse to start there) and keep running across the upgrade: what a rolling
upgrade asks of a migration. Skipped, saying why, where git or that commit is missing (an
unpacked sdist, a shallow clone).

**Before the upgrade**, made by the previous release (its relay; its ``publish``,
``admin.pause`` and ``admin.cancel`` in the test's client process; the application and the
client are tests/acceptance/migration_app.py):
done jobs (lease mode and transactional), dead ones (``PermanentError``), running ones with
a live lease (lease mode, held by the test's gates), one of them with ``cancel_requested``,
an ordered key's head running and its next job pending, a transactional job running whose
open transaction has published a follow-up event (so it holds a lock on ``outbox_events``),
ready jobs of a paused consumer and a cancelled one.

**During**: the previous release's publisher commits a transaction every 0.1 s; a
migration that locks tables (``LOCKED_TABLES``) cannot get ``outbox_events`` while the
transactional job holds it, so it times out and retries (the test waits for the retry in its
log), and the test then lets that job finish; one that locks none (0010: functions only) must
finish while that job still holds it. **After**: the publisher goes on; the gates open; this release publishes, starts a
relay and resumes the paused consumer; the previous release's relay is stopped (SIGTERM,
exit 0); everything drains.

**Checks**: schema at head with no drift from ``outbox.db.tables``; done, dead and cancelled
jobs from before unchanged, column for column; the ready, running and pending ones done
(the one asked to cancel: cancelled), the running ones under the fence they held before the
upgrade; one job per (event, subscribed consumer) for every event, and no other event than
those published plus the one follow-up; each lease-mode job run once (at-least-once permits
a re-run only after a lost lease: none was lost, the leases being long enough), each
transactional effect committed once with its job's fence, every claim's fence distinct and
the claims after the snapshot above every fence before it; an ordered key's jobs run in
commit order; the relays logged no error (the poison events' dead-lettering apart).
"""

from __future__ import annotations

import io
import json
import os
import selectors
import subprocess
import sys
import tarfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from alembic.script import ScriptDirectory
from sqlalchemy.engine import URL
from sqlalchemy.orm import Session

from outbox import admin, publish
from outbox.db.engine import make_engine
from outbox.db.migrate import alembic_config, head_revision, upgrade
from outbox.testing import wait_for
from tests.acceptance.migration_app import LEASE_MODE, SUBSCRIBERS, TABLES, TRANSACTIONAL
from tests.acceptance.relays import Fleet
from tests.integration.migration_helpers import drift, head_script, job_rows, previous_revision, schema_revision

ROOT = Path(__file__).resolve().parents[2]
APP = "tests.acceptance.migration_app:app"
RELAY_FLAGS = ("--concurrency", "8", "--poll-interval", "0.2", "--reap-interval", "0.5",
               "--shutdown-grace", "10", "--retention-done", "3600")
#: Seconds the test waits for its client's reply to one command.
REPLY_WAIT = 60.0
#: The statuses the queue holds before the upgrade (a running job with cancel_requested apart).
STATES = {"ready", "pending", "running", "running+cancel_requested", "done", "dead", "cancelled"}


class Client:
    """The test's client of the previous release (``python -m tests.acceptance.migration_app``:
    its ``serve``, one JSON command and reply per line)."""

    def __init__(self, tree: Path, url: str, cwd: Path) -> None:
        self.tree = tree
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.acceptance.migration_app"],
                                     env=previous_env(tree, url), cwd=cwd, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.started = False

    def call(self, op: str, **arguments: Any) -> dict[str, Any]:
        if not self.started:  # its first line says which outbox it imported
            self.started = True
            self.call_reply()
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **arguments}) + "\n")
        self.proc.stdin.flush()
        return self.call_reply()

    def call_reply(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as selector:  # a client that hangs fails the test, never stalls it
            selector.register(self.proc.stdout, selectors.EVENT_READ)
            assert selector.select(REPLY_WAIT), f"the previous release's client did not answer in {REPLY_WAIT}s"
        line = self.proc.stdout.readline()
        assert line, f"the previous release's client exited {self.proc.wait(10)}"
        reply = json.loads(line)
        assert Path(reply["outbox"]).is_relative_to(self.tree), reply
        assert "error" not in reply or reply["error"] is None, reply
        return reply

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def previous_env(tree: Path, url: str) -> dict[str, str]:
    """The environment of a process of the previous release: ``tree`` first on the path."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    return {**environ, "OUTBOX_DATABASE_URL": url, "PYTHONPATH": os.pathsep.join([str(tree), str(ROOT)]),
            "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="session")
def previous_release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The source tree of the release before the newest migration (module notes); its newest
    migration must be the one head upgrades from."""
    script = Path(head_script().path).resolve()
    if not script.is_relative_to(ROOT):
        pytest.skip(f"the migrations ({script.parent}) are not those of the checkout {ROOT}")
    try:
        added = subprocess.run(["git", "-C", str(ROOT), "log", "--diff-filter=A", "--format=%H", "--",
                                str(script.relative_to(ROOT))], capture_output=True, text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"no git history to take the previous release from: {exc}")
    commit = f"{added[-1]}^" if added else "HEAD"  # not committed yet: the previous release is HEAD
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", commit, "outbox", "alembic"],
                             capture_output=True)
    if archive.returncode != 0:
        pytest.skip(f"git has no tree for {commit} (a shallow clone?): {archive.stderr.decode(errors='replace')}")
    tree = tmp_path_factory.mktemp("previous-release")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(tree, filter="data")
    revision = ScriptDirectory(str(tree / "alembic")).get_current_head()
    assert revision == previous_revision(), f"{commit} ships revision {revision}, head upgrades from {previous_revision()}"
    return tree


@pytest.fixture
def live(empty_db_url: URL, tmp_path: Path) -> Iterator[tuple[sa.Engine, Fleet]]:
    """A database at the revision before head with the application's tables, and a fleet of
    relays on it (cleaned up at the end)."""
    engine = make_engine(empty_db_url, pool_size=5)
    upgrade(engine, previous_revision())
    with engine.begin() as conn:
        conn.exec_driver_sql(TABLES)
    fleet = Fleet(tmp_path, empty_db_url.render_as_string(hide_password=False), app=APP, base_flags=RELAY_FLAGS)
    try:
        yield engine, fleet
    finally:
        fleet.cleanup()
        engine.dispose()


def state(job: dict[str, Any]) -> str:
    return job["status"] + ("+cancel_requested" if job["cancel_requested"] else "")


def states(engine: sa.Engine) -> Counter[tuple[str, str]]:
    """How many jobs each (consumer, state) has."""
    return Counter((j["consumer"], state(j)) for j in job_rows(engine).values())


def job_of(engine: sa.Engine, event_id: int, consumer: str) -> dict[str, Any]:
    found = [j for j in job_rows(engine).values() if (j["event_id"], j["consumer"]) == (event_id, consumer)]
    assert len(found) == 1, found
    return found[0]


def set_flag(engine: sa.Engine, name: str) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO mig_flags (name) VALUES (:n)"), {"n": name})


def has_flag(engine: sa.Engine, name: str) -> bool:
    with engine.connect() as conn:
        return conn.execute(sa.text("SELECT 1 FROM mig_flags WHERE name = :n"), {"n": name}).first() is not None


def rows(engine: sa.Engine, sql: str) -> list[dict[str, Any]]:
    with engine.connect() as conn:
        return [dict(r) for r in conn.exec_driver_sql(sql).mappings()]


def unfinished(engine: sa.Engine) -> int:
    """Jobs still to run or running, plus events not routed yet."""
    with engine.connect() as conn:
        return conn.exec_driver_sql(
            "SELECT (SELECT count(*) FROM outbox_jobs WHERE status IN ('ready', 'running', 'pending'))"
            " + (SELECT count(*) FROM outbox_events WHERE routed_at IS NULL)").scalar_one()


def test_upgrade_under_a_live_queue(live, previous_release: Path, tmp_path: Path):
    engine, fleet = live
    url = fleet.url
    head = head_revision()

    # ------------------------------------------------ the queue, made by the previous release
    # Its own command line: outbox.cli before the layout of issue 27 moved it to outbox.ops.cli.
    cli = "outbox.ops.cli" if (previous_release / "outbox" / "ops" / "cli.py").exists() else "outbox.cli"
    old_relay = fleet.start(env={"PYTHONPATH": previous_env(previous_release, url)["PYTHONPATH"]}, wait=False,
                            cli=cli)
    old = Client(previous_release, url, tmp_path)
    try:
        old.call("pause", consumer="later")
        wait_for(lambda: old_relay.started() or old_relay.proc.poll() is not None, what="the old relay to start")
        assert old_relay.proc.poll() is None and f"outbox from {previous_release}" in old_relay.log, old_relay.log
        work, poison, hold, seq, slow, later = old.call("publish", batches=[
            ("mig.work", [{"n": i} for i in range(20)], None), ("mig.poison", [{"n": 0}, {"n": 1}], None),
            ("mig.hold", [{"gate": "h1"}, {"gate": "h2"}], None), ("mig.seq", [{"gate": "q1"}, {"n": 1}], "k1"),
            ("mig.slow", [{"gate": "slow"}], None), ("mig.later", [{"n": i} for i in range(3)], None)])["ids"]
        setup_ids = [*work, *poison, *hold, *seq, *slow, *later]
        expected = Counter({("work_lease", "done"): 20, ("work_tx", "done"): 20, ("poison", "dead"): 2,
                            ("holder", "running"): 2, ("seq", "running"): 1, ("seq", "pending"): 1,
                            ("slow_tx", "running"): 1, ("later", "ready"): 3})
        wait_for(lambda: states(engine) == expected and has_flag(engine, "holding:slow"), timeout=30,
                 what=f"the queue before the upgrade: {expected}")
        asked, cancelled = job_of(engine, hold[1], "holder")["id"], job_of(engine, later[0], "later")["id"]
        reply = old.call("cancel", ids=[asked, cancelled])
        assert (reply["cancelled"], reply["requested"]) == ([cancelled], [asked])
        before = job_rows(engine)
        assert {state(j) for j in before.values()} == STATES
        with engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT bool_and(lease_until > now()) FROM outbox_jobs"
                                        " WHERE status = 'running'").scalar_one()
        fence_before = max(j["fence"] or 0 for j in before.values())

        # --------------------------------------------- the upgrade, publishers and relays live
        old.call("stream_start", pause=0.1)
        wait_for(lambda: old.call("stream_count")["count"] >= 6, what="the stream to run")
        migrate_out, migrate_err = tmp_path / "migrate.out", tmp_path / "migrate.err"
        environ = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
        with open(migrate_out, "w") as out, open(migrate_err, "w") as err:
            migrate = subprocess.Popen([sys.executable, "-m", "outbox.ops.cli", "migrate", "--database-url", url],
                                       env=environ, cwd=tmp_path, stdout=out, stderr=err)
        try:
            if hasattr(head_script(ScriptDirectory.from_config(alembic_config())).module, "LOCKED_TABLES"):
                # The transactional job's open transaction holds outbox_events: the migration retries.
                wait_for(lambda: "trying again" in migrate_err.read_text() or migrate.poll() is not None,
                         timeout=60, what="the migration to retry")
                assert migrate.poll() is None, migrate_err.read_text()
                set_flag(engine, "open:slow")
                assert migrate.wait(90) == 0, migrate_err.read_text()
            else:  # it locks no table: done while that transaction still holds outbox_events
                assert migrate.wait(90) == 0, migrate_err.read_text()
                assert "trying again" not in migrate_err.read_text()
                set_flag(engine, "open:slow")
        finally:
            if migrate.poll() is None:
                migrate.kill()
        assert migrate_out.read_text() == f"outbox schema public at revision {head}\n", migrate_err.read_text()
        assert schema_revision(engine) == [head]
        new_relay = fleet.start(wait=False)  # this release: its schema check passes now
        by_upgrade = old.call("stream_count")["count"]
        for gate in ("h1", "h2", "q1"):
            set_flag(engine, f"open:{gate}")
        after_ids = []
        for i in range(10):
            with Session(engine) as s, s.begin():
                after_ids += [publish(s, "mig.work", {"n": i, "after": True}),
                              publish(s, "mig.seq", {"n": i}, key=f"t{i % 3}")]
        wait_for(lambda: new_relay.started() or new_relay.proc.poll() is not None, what="the new relay to start")
        assert new_relay.proc.poll() is None, new_relay.log
        wait_for(lambda: old.call("stream_count")["count"] >= by_upgrade + 6, what="the stream to go on")
        assert fleet.terminate(old_relay, 30) == 0, old_relay.log
        with engine.begin() as conn:
            admin.resume(conn, "later")
        streamed = old.call("stream_stop")["ids"]
    finally:
        old.close()
    wait_for(lambda: unfinished(engine) == 0, timeout=60, what="the queue to drain")
    fleet.check_count()
    fleet.terminate_all()

    # ----------------------------------------------------------------------------- checks
    assert schema_revision(engine) == [head]
    assert [d for d in drift(engine) if not (d[0] == "remove_table" and d[1].name.startswith("mig_"))] == []
    after = job_rows(engine)
    events = {e["id"]: e for e in rows(engine, "SELECT id, topic, payload FROM outbox_events")}
    published = {*setup_ids, *streamed, *after_ids}
    follow_ups = {i for i, e in events.items() if "follow_up_of" in e["payload"]}
    assert [events[i]["payload"]["follow_up_of"] for i in follow_ups] == slow  # its transaction committed once
    assert set(events) == published | follow_ups
    assert {(j["event_id"], j["consumer"]) for j in after.values()} == {
        (i, consumer) for i, e in events.items() for consumer in SUBSCRIBERS[e["topic"]]}
    assert len(after) == sum(len(SUBSCRIBERS[e["topic"]]) for e in events.values())

    for job_id, job in after.items():
        was = before.get(job_id)
        if was is not None and was["status"] in ("done", "dead", "cancelled"):
            assert {column: job[column] for column in was} == was, (was, job)  # columns the upgrade adds aside
        elif job_id == asked:
            assert job["status"] == "cancelled", job
        else:
            assert job["status"] == "done", (was, job)
        if was is not None and was["status"] == "running":
            assert job["fence"] == was["fence"], (was, job)  # finished by the claim it held across the upgrade
        elif was is None or was["status"] in ("ready", "pending"):
            if job["status"] != "cancelled":
                assert job["fence"] > fence_before, (was, job)

    runs = rows(engine, "SELECT * FROM mig_runs ORDER BY id")
    assert not [r for r in runs if r["lease_lost"]]
    ran = {i for i, j in after.items() if j["consumer"] in LEASE_MODE and j["status"] in ("done", "dead")} | {asked}
    assert Counter(r["job_id"] for r in runs) == dict.fromkeys(ran, 1)
    for r in runs:
        assert (r["event_id"], r["fence"]) == (after[r["job_id"]]["event_id"], after[r["job_id"]]["fence"]), r
    tx_log = rows(engine, "SELECT * FROM mig_tx_log")
    committed = {i for i, j in after.items() if j["consumer"] in TRANSACTIONAL}
    assert {j["status"] for i, j in after.items() if i in committed} == {"done"}
    assert Counter(r["job_id"] for r in tx_log) == dict.fromkeys(committed, 1)
    assert {r["job_id"]: r["fence"] for r in tx_log} == {i: after[i]["fence"] for i in committed}
    assert {r["event_id"]: r["fence"] for r in rows(engine, "SELECT * FROM mig_effects")} == {
        after[i]["event_id"]: after[i]["fence"] for i in committed}
    fences = [r["fence"] for r in runs] + [r["fence"] for r in tx_log]
    assert len(fences) == len(set(fences))
    keys: dict[str, list[int]] = {}
    for r in runs:
        if r["consumer"] == "seq":
            keys.setdefault(r["key"], []).append(r["event_id"])
    assert keys and all(ids == sorted(ids) for ids in keys.values()), keys
    # The relays only waited for the migration: no error but the poison events' dead-lettering.
    errors = [line for line in fleet.logs().splitlines()
              if (" ERROR " in line and "dead-lettered job" not in line) or "Traceback" in line]
    assert errors == [], "\n".join(errors)
    print(f"live upgrade: {len(published)} events published ({by_upgrade} by the previous release's stream"
          f" until the migration ended), {len(after)} jobs, migration retries:"
          f" {migrate_err.read_text().count('trying again')}")
