"""The pytest plugin (entry point ``pytest11``) as an application's test suite meets it: a
throwaway project, run with ``pytest`` in a subprocess, uses ``outbox_engine`` /
``outbox_database_url`` (a migrated database per test), ``make_job`` and ``drain``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

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
