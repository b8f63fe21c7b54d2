"""`outbox-relay demo` end to end at a small size: relays SIGKILLed and SIGSTOPped past
their lease, and every invariant the demo checks against the database holds."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest

from outbox.testing import drop_database


@pytest.mark.slow
def test_demo_small_run_holds_every_invariant(server, tmp_path):
    url, _ = server
    name = f"outbox_demo_test_{uuid.uuid4().hex[:10]}"
    command = [
        sys.executable, "-m", "outbox.cli", "demo",
        "--database-url", url.render_as_string(hide_password=False), "--db-name", name,
        "--orders", "150", "--duration", "8", "--relays", "3", "--lease", "1",
        "--kill-at", "1", "--stop-at", "2.5", "--grace", "3", "--drain-timeout", "30",
        "--log-dir", str(tmp_path / "logs"), "--progress-every", "1",
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    try:
        done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    finally:
        drop_database(url.set(database=name))
    output = f"--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
    assert done.returncode == 0, output
    assert "invariants hold" in done.stdout, output
    assert "fault: SIGKILL relay-1" in done.stdout and "fault: SIGSTOP relay-2" in done.stdout, output
    assert "fault: SIGCONT relay-2" in done.stdout, output
