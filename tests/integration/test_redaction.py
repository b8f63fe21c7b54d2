"""Secrets of a URL never leave outbox (issue 26, item 5): every path that prints, logs,
serves or hands on a database or broker URL, run for real with a URL carrying a userinfo
password, ``?password=`` and ``?sslpassword=``: the CLI commands as processes (reachable
and unreachable database), the relay's start and error lines, the dashboard's start line
and its 503 page on an unreachable database, pytest's report header, the brokers'
"unreachable" errors, and ``outbox-relay psql``'s command line (read from /proc)."""

from __future__ import annotations

import html
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL

from outbox.sinks import SinkUnavailableError
from outbox.testing import wait_for

ROOT = Path(__file__).resolve().parents[2]
TOKEN = uuid.uuid4().hex[:10]
USER_PW, QUERY_PW, SSL_PW = f"userPW{TOKEN}", f"queryPW{TOKEN}", f"sslPW{TOKEN}"
UNREACHABLE = f"postgresql://outbox:{USER_PW}@127.0.0.1:1/outbox?password={QUERY_PW}&sslpassword={SSL_PW}"
SHOWN_UNREACHABLE = "postgresql+psycopg://outbox:***@127.0.0.1:1/outbox?password=***&sslpassword=***"


def with_secrets(url: URL) -> tuple[str, tuple[str, ...]]:
    """``url`` as text carrying three secrets (a userinfo password, ``password=`` and
    ``sslpassword=`` in the query), and the secrets. libpq takes the query's password over
    the userinfo's (SQLAlchemy's psycopg dialect passes the query last), so the query holds
    the URL's own password when it has one (a server that asks for it gets it); a server
    that trusts its local logins ignores the others."""
    query_pw = url.password or QUERY_PW
    text = url.set(password=USER_PW).update_query_dict({"password": query_pw, "sslpassword": SSL_PW})
    return text.render_as_string(hide_password=False), (USER_PW, query_pw, SSL_PW)


def environment(**variables: str) -> dict[str, str]:
    """This process's environment without OUTBOX_* variables, plus ``variables``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env.update(variables)
    return env


def run_cli(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "outbox.ops.cli", *args], cwd=cwd, env=env or environment(),
                          capture_output=True, text=True, timeout=60)


def assert_no_secret(text: str, secrets: tuple[str, ...] = (USER_PW, QUERY_PW, SSL_PW)) -> None:
    leaked = [s for s in secrets if s in text]
    assert not leaked, f"{leaked} in:\n{text}"


def masked(text: str) -> tuple[int, int]:
    """How many times ``text`` shows ``password=***`` and ``sslpassword=***`` as query parameters."""
    return len(re.findall(r"[?&]password=\*\*\*", text)), len(re.findall(r"[?&]sslpassword=\*\*\*", text))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ------------------------------------------------------------------------- the CLI


@pytest.mark.parametrize("command", [["status"], ["migrate"], ["relays"], ["dead"], ["redrive", "--all"], ["run"],
                                     ["grants", "--relay", "r", "--apply"]])
@pytest.mark.parametrize("source", ["flag", "environment"])
def test_cannot_reach_the_database_shows_no_secret(tmp_path, command, source):
    args = [*command, "--database-url", UNREACHABLE] if source == "flag" else command
    result = run_cli(*args, cwd=tmp_path, env=environment(OUTBOX_DATABASE_URL=UNREACHABLE))
    assert result.returncode == 2, result.stderr
    assert f"outbox-relay: error: cannot reach the database at {SHOWN_UNREACHABLE}: " in result.stderr
    assert_no_secret(result.stdout + result.stderr)


@pytest.mark.parametrize("url, fragment", [
    (f"postgresql://outbox:{USER_PW}@db.example:notaport/x?password={QUERY_PW}&sslpassword={SSL_PW}",
     "database URL is malformed: postgresql://outbox:***@db.example:notaport/x?password=***&sslpassword=***"),
    (f"mysql://outbox:{USER_PW}@db.example/x?password={QUERY_PW}&sslpassword={SSL_PW}",
     "must be a PostgreSQL URL (postgresql://...), got mysql://outbox:***@db.example/x?password=***&sslpassword=***"),
    (f"postgresql://outbox:{USER_PW}@127.0.0.1/x?password={QUERY_PW}&sslpassword={SSL_PW}&port=abc",
     "is not usable: Received non-integer port arguments"),
    (f"postgresql://outbox:{USER_PW}@127.0.0.1/x?PASSWORD={QUERY_PW}&SslPassword={SSL_PW}&bogus=1",
     "?PASSWORD=***&SslPassword=***&bogus=1 is not usable: ProgrammingError: invalid connection option"),
], ids=["malformed", "not-postgresql", "bad-port", "unknown-option"])  # stable ids: the URLs hold random secrets
def test_a_url_outbox_refuses_shows_no_secret(tmp_path, url, fragment):
    """Errors raised about the URL itself (before any connection, or by the driver refusing
    an option): one line, the secrets hidden, whatever the case of the parameter's name."""
    result = run_cli("status", "--database-url", url, cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert fragment in result.stderr
    assert_no_secret(result.stdout + result.stderr)


def test_commands_on_a_reachable_database_show_no_secret(server, db_url, empty_db_url, tmp_path):
    url, secrets = with_secrets(db_url)
    env = environment(OUTBOX_DATABASE_URL=url)
    for command, status in ((["status"], 0), (["migrate"], 0), (["relays"], 1), (["dead"], 0)):
        result = run_cli(*command, cwd=tmp_path, env=env)
        assert result.returncode == status, (command, result.stderr)
        assert_no_secret(result.stdout + result.stderr, secrets)
    # no tables at all: "outbox tables are missing" (said before the URL is named)
    empty, empty_secrets = with_secrets(empty_db_url)
    missing = run_cli("run", cwd=tmp_path, env=environment(OUTBOX_DATABASE_URL=empty))
    assert missing.returncode == 2 and "outbox tables are missing" in missing.stderr, missing.stderr
    assert_no_secret(missing.stdout + missing.stderr, empty_secrets)
    # a table gone after the check of the schema: "outbox tables are missing in schema public of <URL>"
    admin = sa.create_engine(db_url, poolclass=sa.pool.NullPool)
    with admin.begin() as conn:
        conn.execute(sa.text("ALTER TABLE outbox_jobs RENAME TO outbox_jobs_gone"))
    gone = run_cli("dead", cwd=tmp_path, env=env)
    assert gone.returncode == 2 and "outbox tables are missing in schema public of postgresql+psycopg://" in gone.stderr, \
        gone.stderr
    assert masked(gone.stderr) == (1, 1)
    assert_no_secret(gone.stdout + gone.stderr, secrets)
    # a statement the database refuses (a role with no privilege): "database error in <URL>"
    role = f"outbox_redact_{TOKEN}"
    with sa.create_engine(server[0], isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool).connect() as conn:
        conn.exec_driver_sql(f"CREATE ROLE {role} LOGIN")
        try:
            as_role, role_secrets = with_secrets(db_url.set(username=role))
            refused = run_cli("status", cwd=tmp_path, env=environment(OUTBOX_DATABASE_URL=as_role))
        finally:
            conn.exec_driver_sql(f"DROP ROLE {role}")
    assert refused.returncode == 2 and f"database error in postgresql+psycopg://{role}:***@" in refused.stderr, \
        refused.stderr
    assert masked(refused.stderr) == (1, 1) and "InsufficientPrivilege" in refused.stderr
    assert_no_secret(refused.stdout + refused.stderr, role_secrets)


# ------------------------------------------------------------------------ the relay


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_the_relays_start_line_shows_no_secret(db_url, tmp_path, log_format):
    """The start line names the database and the LISTEN connection (here a URL of its own,
    ``OUTBOX_LISTEN_URL``, with secrets of its own), both redacted by the one rule."""
    url, secrets = with_secrets(db_url)
    listen, _ = with_secrets(db_url)
    listen = listen.replace(USER_PW, "listenPW" + TOKEN)
    log = tmp_path / "relay.log"
    env = environment(OUTBOX_DATABASE_URL=url, OUTBOX_LISTEN_URL=listen, PYTHONUNBUFFERED="1")
    with open(log, "w") as out:
        relay = subprocess.Popen([sys.executable, "-m", "outbox.ops.cli", "run", "--log-format", log_format],
                                 cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: "relay started" in log.read_text() or relay.poll() is not None, timeout=30,
                 what="the relay's start line")
        assert relay.poll() is None, log.read_text()
    finally:
        relay.send_signal(signal.SIGTERM)
        assert relay.wait(30) == 0, log.read_text()
    text = log.read_text()
    started = next(line for line in text.splitlines() if "relay started" in line)
    assert "database postgresql+psycopg://" in started and "LISTEN on postgresql://" in started, started
    assert masked(started) == (2, 2), started
    assert_no_secret(text, (*secrets, "listenPW" + TOKEN))


# -------------------------------------------------------------------- the dashboard


def test_the_dashboards_503_page_and_start_line_show_no_secret(tmp_path):
    """A real ``outbox-relay dashboard`` on a database that does not answer: it starts, its
    pages answer 503 "cannot reach the database at <URL>", the URL redacted, for every
    visitor to read; its log holds no secret either."""
    pytest.importorskip("starlette", reason="the dashboard's extra [dashboard] is not installed")
    port = free_port()
    log = tmp_path / "dashboard.log"
    with open(log, "w") as out:
        dashboard = subprocess.Popen([sys.executable, "-m", "outbox.ops.cli", "dashboard", "--port", str(port)],
                                     cwd=tmp_path, env=environment(OUTBOX_DATABASE_URL=UNREACHABLE),
                                     stdout=out, stderr=subprocess.STDOUT)

    def page() -> tuple[int, str] | None:
        assert dashboard.poll() is None, log.read_text()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode()
        except OSError:
            return None

    try:
        status, body = wait_for(page, timeout=30, what="the dashboard to answer")
    finally:
        dashboard.terminate()
        dashboard.wait(30)
    assert status == 503 and "cannot reach the database at" in body, body
    assert masked(html.unescape(body)) == (1, 1), body
    assert_no_secret(body)
    text = log.read_text()
    shown = SHOWN_UNREACHABLE.replace("postgresql+psycopg://", "postgresql://")  # as given: not parsed yet
    assert f"dashboard on http://127.0.0.1:{port} for {shown}" in text, text
    assert_no_secret(text)


# -------------------------------------------------------------- pytest's report header


def test_pytests_report_header_shows_no_secret(tmp_path):
    result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-p", "no:cacheprovider",
                             "tests/unit/test_backoff.py"], cwd=ROOT,
                            env=environment(OUTBOX_TEST_DATABASE_URL=UNREACHABLE), capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    header = next(line for line in result.stdout.splitlines() if line.startswith("outbox: testing against"))
    assert "outbox:***@127.0.0.1:1/outbox?password=***&sslpassword=***" in header, header
    assert_no_secret(result.stdout + result.stderr)


# -------------------------------------------------------------------------- brokers


def test_an_unreachable_broker_is_named_without_its_secrets():
    """The errors a forwarder logs and records when its broker does not answer, and the demo's
    "forwarding skipped" line, name the broker by the one rule: RabbitMQ's password, NATS's
    password and NATS's token hidden."""
    import asyncio

    from outbox.sinks.jetstream import JetStream
    from outbox.sinks.rabbitmq import RabbitMQ

    closed = free_port()  # nothing listens there
    sinks = [RabbitMQ(f"amqp://relay:{USER_PW}@127.0.0.1:{closed}/?password={QUERY_PW}", connect_timeout=2),
             JetStream(f"nats://relay:{USER_PW}@127.0.0.1:{closed}", connect_timeout=2),
             JetStream(f"nats://{SSL_PW}@127.0.0.1:{closed}", connect_timeout=2)]
    for sink in sinks:
        with pytest.raises(SinkUnavailableError) as refused:
            asyncio.run(sink.connect())
        message = str(refused.value)
        assert f"127.0.0.1:{closed}" in message and "***" in message, message
        assert_no_secret(message + sink.describe())
    from outbox.demo.stream import DemoStream, ForwardingSkipped

    with pytest.raises(ForwardingSkipped) as skipped:  # the demo's own NATS check
        DemoStream.create(f"nats://{SSL_PW}@127.0.0.1:{closed}", 2.0)
    assert f"nats://***@127.0.0.1:{closed}" in str(skipped.value), skipped.value
    assert_no_secret(str(skipped.value))


# ----------------------------------------------------------------------------- psql


def test_psql_gets_its_secrets_outside_its_command_line(db_url, tmp_path):
    """``outbox-relay psql``: psql's command line (/proc/<pid>/cmdline, which any local user
    may read) holds no secret; the password reaches it in its environment (PGPASSWORD), the
    sslpassword in a service file only this user may read, deleted when psql exits. The
    shell psql runs for ``\\!`` reads its parent's (psql's) /proc entries."""
    if shutil.which("psql") is None:
        pytest.skip("psql is not installed")
    url, secrets = with_secrets(db_url)
    probe = ('\\! tr "\\0" " " < /proc/$PPID/cmdline; echo; echo "password from env: $PGPASSWORD"; '
             'echo "service file: $PGSERVICEFILE"; stat -c "mode %a" "$PGSERVICEFILE"; cat "$PGSERVICEFILE"')
    result = run_cli("psql", "--database-url", url, "-c", probe, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    command_line = lines[0]
    assert_no_secret(command_line, secrets)
    assert "psql" in command_line and "--dbname" in command_line and "service=outbox_psql" in command_line, lines
    assert f"password from env: {secrets[1]}" in lines  # the query's password: the one libpq would take
    service_file = Path(lines[lines.index(next(x for x in lines if x.startswith("service file: ")))][14:])
    assert "mode 600" in lines and f"sslpassword={SSL_PW}" in lines, lines
    assert not service_file.exists() and not service_file.parent.exists()
    assert_no_secret(result.stderr, secrets)
