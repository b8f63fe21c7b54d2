"""`outbox-relay demo` end to end at a small size: relays SIGKILLed and SIGSTOPped past
their lease, and every invariant the demo checks against the database holds; with a NATS
server (OUTBOX_TEST_NATS_URL, default nats://127.0.0.1:4222) its fourth consumer forwards
every committed order to a JetStream stream of its own exactly once and deletes the stream;
without one (a closed port) it says so in one line and passes all the same."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import re
import socket
import subprocess
import sys
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from outbox.demo.kafka import kafka_missing
from outbox.testing import drop_database

NATS_URL = os.environ.get("OUTBOX_TEST_NATS_URL", "nats://127.0.0.1:4222")


def _nats_missing() -> str | None:
    """Why the NATS part cannot run here, or None."""
    if importlib.util.find_spec("nats") is None:
        return "nats-py is not installed (pip install 'outbox-relay[nats]')"
    parts = urlsplit(NATS_URL)
    try:
        socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 4222), timeout=2).close()
    except OSError as exc:
        return f"NATS is not reachable at {NATS_URL}: {exc}"
    return None


def _demo(server, tmp_path: Path, nats_url: str, *flags: str) -> subprocess.CompletedProcess[str]:
    url, _ = server
    name = f"outbox_demo_test_{uuid.uuid4().hex[:10]}"
    command = [
        sys.executable, "-m", "outbox.ops.cli", "demo",
        "--database-url", url.render_as_string(hide_password=False), "--db-name", name,
        "--log-dir", str(tmp_path / "logs"), "--progress-every", "1", *flags,
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env["OUTBOX_DEMO_NATS_URL"] = nats_url
    try:
        return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    finally:
        drop_database(url.set(database=name))


FAULTS = ("--orders", "150", "--duration", "8", "--relays", "3", "--lease", "1", "--kill-at", "1",
          "--stop-at", "2.5", "--grace", "3", "--drain-timeout", "30")


@pytest.fixture(scope="module")
def fault_run(server, tmp_path_factory) -> subprocess.CompletedProcess[str]:
    """One demo run with faults, forwarding to NATS when it is reachable."""
    return _demo(server, tmp_path_factory.mktemp("demo"), NATS_URL, *FAULTS)


def _output(done: subprocess.CompletedProcess[str]) -> str:
    return f"--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"


@pytest.mark.slow
def test_demo_small_run_holds_every_invariant(fault_run):
    output = _output(fault_run)
    assert fault_run.returncode == 0, output
    assert "invariants hold" in fault_run.stdout, output
    assert "fault: SIGKILL relay-1" in fault_run.stdout and "fault: SIGSTOP relay-2" in fault_run.stdout, output
    assert "fault: SIGCONT relay-2" in fault_run.stdout, output


@pytest.mark.slow
@pytest.mark.skipif(_nats_missing() is not None, reason=_nats_missing() or "")
def test_demo_forwards_each_committed_order_once_to_jetstream_and_deletes_its_stream(fault_run):
    output = _output(fault_run)
    assert fault_run.returncode == 0, output
    assert ("ok    JetStream stream holds exactly one message per committed order (by Nats-Msg-Id / "
            "Outbox-Event-Id), none for a rolled-back order") in fault_run.stdout, output
    committed = re.search(r"(\d+) committed, \d+ rolled back on purpose", fault_run.stdout)
    stored = re.search(r"stream (OUTBOX_DEMO_\w+): (\d+) messages stored for (\d+) committed orders; 0 orders "
                       r"missing, 0 stored twice, 0 for rolled-back orders", fault_run.stdout)
    assert committed and stored, output
    assert int(stored.group(2)) == int(stored.group(3)) == int(committed.group(1)) > 0, output
    assert re.search(r"forward_to_nats +\d+ +0 +0 +0 ", fault_run.stdout), output  # every job done, none dead
    assert f"nats: stream {stored.group(1)} deleted" in fault_run.stdout, output
    assert not _stream_exists(stored.group(1)), f"the demo left its stream {stored.group(1)} behind"


@pytest.mark.slow
@pytest.mark.skipif(kafka_missing() is not None, reason=kafka_missing() or "")
def test_demo_forwards_each_committed_order_to_kafka_at_least_once_and_stops_its_broker(fault_run):
    output = _output(fault_run)
    assert fault_run.returncode == 0, output
    assert ("ok    Kafka topic holds every committed order at least once (by Outbox-Event-Id), a second copy only of "
            "a job sent again, none for a rolled-back order") in fault_run.stdout, output
    committed = re.search(r"(\d+) committed, \d+ rolled back on purpose", fault_run.stdout)
    stored = re.search(r"topic (outbox-demo-\w+): (\d+) records for (\d+) committed orders; 0 orders missing, "
                       r"(\d+) stored twice \(0 of jobs sent once\), 0 for rolled-back orders, 0 with a wrong id",
                       fault_run.stdout)
    assert committed and stored, output
    assert int(stored.group(3)) == int(committed.group(1)) > 0, output
    assert int(stored.group(2)) == int(stored.group(3)) + int(stored.group(4)), output
    assert re.search(r"forward_to_kafka +\d+ +0 +0 +0 ", fault_run.stdout), output  # every job done, none dead
    assert "kafka: test broker stopped" in fault_run.stdout, output


def _stream_exists(name: str) -> bool:
    import nats
    from nats.js.errors import NotFoundError

    async def look() -> bool:
        nc = await nats.connect(NATS_URL)
        try:
            await nc.jetstream().stream_info(name)
        except NotFoundError:
            return False
        finally:
            await nc.close()
        return True

    return asyncio.run(look())


@pytest.mark.slow
def test_demo_without_nats_skips_forwarding_in_one_line_and_passes(server, tmp_path):
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    done = _demo(server, tmp_path, f"nats://127.0.0.1:{port}", "--orders", "40", "--duration", "2", "--relays", "2",
                 "--no-faults", "--grace", "3")
    output = _output(done)
    assert done.returncode == 0, output
    assert "invariants hold" in done.stdout, output
    skipped = [line for line in done.stdout.splitlines() if line.startswith("nats:")]
    assert len(skipped) == 1, output
    assert skipped[0].startswith(f"nats: forwarding skipped: no NATS server answers at nats://127.0.0.1:{port} ("
                                 "ConnectionRefusedError"), output
    assert "forward_to_nats" not in done.stdout and "JetStream" not in done.stdout, output


@pytest.mark.slow
def test_the_two_service_demo_has_one_effect_per_committed_order_under_faults(server, tmp_path):
    """``demo --services 2``: A's relays and B's intake holder SIGKILLed, B's next holder
    SIGSTOPped past its lease, NATS cut: every invariant holds, B booked each committed order
    of A once, in each customer's order."""
    why = _nats_missing()
    if why is not None:
        pytest.skip(why)
    url, _ = server
    name = f"outbox_demo_test_{uuid.uuid4().hex[:10]}"
    command = [sys.executable, "-m", "outbox.ops.cli", "demo", "--services", "2", "--database-url",
               url.render_as_string(hide_password=False), "--db-name", name, "--log-dir", str(tmp_path / "logs"),
               "--orders", "200", "--duration", "10", "--lease", "2", "--cut-for", "2", "--drain-timeout", "60"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    try:
        done = subprocess.run(command, cwd=tmp_path, env={**env, "OUTBOX_DEMO_NATS_URL": NATS_URL},
                              capture_output=True, text=True, timeout=180)
    finally:
        for suffix in ("_a", "_b"):
            drop_database(url.set(database=name + suffix))
    assert done.returncode == 0, _output(done)
    out = done.stdout
    assert "all 9 invariants hold" in out, _output(done)
    assert "(the intake's holder)" in out and ", the intake's holder," in out and "broker cut" in out, _output(done)
    assert "B was handed copies: 20 messages re-sent by A's sender" in out, _output(done)
    booked = re.search(r"B booked exactly A's committed orders: (\d+) booked, (\d+) committed", out)
    assert booked is not None and booked.group(1) == booked.group(2) and int(booked.group(1)) > 150, _output(done)
