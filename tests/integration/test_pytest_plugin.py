"""The pytest plugin (entry point ``pytest11``) as an application's test suite meets it: a
throwaway project, run with ``pytest`` in a subprocess, uses ``outbox_engine`` /
``outbox_database_url`` (a migrated database per test), ``make_job`` and ``drain``; with no
server configured, on an embedded one that leaves nothing behind."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

APP_TESTS = '''
import sqlalchemy as sa
from sqlalchemy.orm import Session

from outbox import Job, Outbox, PermanentError, publish
from outbox.testing import drain, make_job

ob = Outbox()
sent = []


@ob.subscriber("order.placed", consumer="send_receipt", max_attempts=2)
def send_receipt(job: Job) -> None:
    if job.payload["order_id"] < 0:
        raise PermanentError("no such order")
    sent.append(job.payload["order_id"])


def test_handler_alone():
    send_receipt(make_job({"order_id": 7}))
    assert sent[-1] == 7


def test_drain_on_a_database_of_its_own(outbox_engine):
    with Session(outbox_engine) as s, s.begin():
        publish(s, "order.placed", {"order_id": 1})
        publish(s, "order.placed", {"order_id": -1})
    results = drain(outbox_engine, ob)
    assert [(r.outcome, r.consumer) for r in results] == [("done", "send_receipt"), ("dead", "send_receipt")]


def test_each_test_starts_empty(outbox_engine, outbox_database_url):
    assert outbox_engine.url.database == sa.make_url(outbox_database_url).database
    with outbox_engine.connect() as c:
        assert c.execute(sa.text("SELECT count(*) FROM outbox_events")).scalar() == 0
        assert c.execute(sa.text("SELECT count(*) FROM outbox_jobs")).scalar() == 0
'''


def test_plugin_fixtures_in_a_users_pytest_run(tmp_path, server):
    (tmp_path / "pytest.ini").write_text("[pytest]\naddopts = -p no:cacheprovider\n")
    (tmp_path / "test_app.py").write_text(textwrap.dedent(APP_TESTS))
    env = {**os.environ, "OUTBOX_DATABASE_URL": server[0].render_as_string(hide_password=False)}
    env.pop("OUTBOX_TEST_DATABASE_URL", None)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", str(tmp_path)], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "3 passed" in run.stdout, run.stdout


def test_plugin_contacts_no_server_unless_asked(tmp_path):
    """A test that uses none of the fixtures runs with no database configured and none
    reachable: the plugin is lazy."""
    (tmp_path / "pytest.ini").write_text("[pytest]\naddopts = -p no:cacheprovider\n")
    (tmp_path / "test_plain.py").write_text("def test_plain():\n    assert 1 + 1 == 2\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env["OUTBOX_DATABASE_URL"] = "postgresql://nobody@127.0.0.1:1/none"  # would fail at once if used
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", str(tmp_path), "--fixtures"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "outbox_engine" in run.stdout and "outbox_database_url" in run.stdout
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", str(tmp_path)], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "1 passed" in run.stdout, run.stdout + run.stderr


EMBEDDED_TESTS = '''
import sqlalchemy as sa


def test_on_the_embedded_server(outbox_engine, outbox_server_url):
    assert "host=" in outbox_server_url  # the embedded server: a Unix socket, no TCP port
    with outbox_engine.connect() as c:
        folder = c.execute(sa.text("SHOW data_directory")).scalar_one()
    with open("data_directory.txt", "w") as out:
        out.write(folder)
'''


def test_the_embedded_test_server_leaves_nothing_behind(tmp_path):
    """With no server configured, a test run starts an embedded PostgreSQL in a folder of the
    temporary directory, and stops it and deletes the folder when the run ends (before,
    the folder stayed: about 100 MB owned by pgserver's system user when run as root)."""
    pytest.importorskip("pgserver", reason="the extra [embedded] (pgserver) is not installed")
    psutil = pytest.importorskip("psutil")  # pgserver's own dependency
    (tmp_path / "pytest.ini").write_text("[pytest]\naddopts = -p no:cacheprovider\n")
    (tmp_path / "test_embedded.py").write_text(textwrap.dedent(EMBEDDED_TESTS))
    # The child's temporary directory: not under tmp_path, whose pytest-of-<user> folder every
    # pytest run that starts makes private again (mode 0700), out of reach of the server's
    # system user when run as root.
    # pgserver keeps its inter-process lock (an empty file, shared by every pgserver user, so
    # never deleted) in XDG_RUNTIME_DIR, or in <temporary directory>/runtime-<uid> without one:
    # the child gets one of its own, and the temporary directory holds the server only.
    temporary = Path(tempfile.mkdtemp(prefix="outbox-plugin-test-"))
    runtime = Path(tempfile.mkdtemp(prefix="outbox-plugin-runtime-"))
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
        env.update(TMPDIR=str(temporary), XDG_RUNTIME_DIR=str(runtime))
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", str(tmp_path)], cwd=tmp_path,
                             env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0 and "1 passed" in run.stdout, run.stdout + run.stderr
        folder = Path((tmp_path / "data_directory.txt").read_text())
        assert folder.is_relative_to(temporary), folder  # the server did run there
        assert not folder.exists() and list(temporary.iterdir()) == []
        running = [p.pid for p in psutil.process_iter(["cmdline"]) if str(folder) in " ".join(p.info["cmdline"] or ())]
        assert running == []
    finally:
        shutil.rmtree(temporary)
        shutil.rmtree(runtime)
