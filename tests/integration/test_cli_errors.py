"""`outbox-relay` as a user runs it (a subprocess): every mistake a user can make prints one
line ``outbox-relay: error: ...`` and exits non-zero, with no traceback and never the
database password; configuration comes from OUTBOX_* variables with flags on top."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL

from outbox.db.migrate import head_revision
from outbox.ops.cli import main

SECRET = "s3cretPW"
UNREACHABLE = f"postgresql://outbox:{SECRET}@127.0.0.1:1/outbox"


def run_cli(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``python -m outbox.ops.cli ARGS`` as a process from ``cwd`` (which is importable),
    with no OUTBOX_* variable but those in ``env``."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    environ["PYTHONPATH"] = str(cwd)
    environ.update(env or {})
    return subprocess.run([sys.executable, "-m", "outbox.ops.cli", *args], cwd=cwd, env=environ,
                          capture_output=True, text=True, timeout=60)


@pytest.fixture
def cli(monkeypatch, capsys, app_dir):
    """Run ``outbox.ops.cli.main(ARGS)`` in this process (fast; the same code path as the
    console script), with ``app_dir`` importable and only the OUTBOX_* variables given;
    returns a CompletedProcess like :func:`run_cli`."""
    monkeypatch.setattr(sys, "path", [str(app_dir), *sys.path])
    before = set(sys.modules)

    def call(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        for name in list(os.environ):
            if name.startswith("OUTBOX_"):
                monkeypatch.delenv(name)
        for name, value in (env or {}).items():
            monkeypatch.setenv(name, value)
        capsys.readouterr()
        status = main(list(args))
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(list(args), status, out, err)

    yield call
    for name in set(sys.modules) - before:  # the application modules imported from app_dir
        if getattr(sys.modules[name], "__file__", "") and str(app_dir) in (sys.modules[name].__file__ or ""):
            del sys.modules[name]


def assert_one_error_line(result: subprocess.CompletedProcess[str], *fragments: str, secret: str = SECRET,
                          info_lines: bool = False) -> str:
    """Exit status 2, nothing on stdout, and on stderr one line ``outbox-relay: error: ...``
    holding every fragment (besides log lines at INFO level, with ``info_lines``)."""
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "Traceback" not in output, output
    assert secret not in output, output
    assert result.stdout == ""
    lines = [line for line in result.stderr.splitlines() if not (info_lines and " INFO " in line)]
    assert len(lines) == 1, output
    [line] = lines
    assert line.startswith("outbox-relay: error: "), line
    for fragment in fragments:
        assert fragment in line, line
    return line


def with_secret(url: URL) -> tuple[str, str]:
    """``url`` as text carrying a password, and that password. A server that trusts its
    local logins (the default local and embedded ones) ignores a password it did not ask
    for, so a known one is put in when the URL has none."""
    if url.password:
        return url.render_as_string(hide_password=False), url.password
    candidate = url.set(password=SECRET)
    with sa.create_engine(candidate, poolclass=sa.pool.NullPool).connect():
        pass
    return candidate.render_as_string(hide_password=False), SECRET


@pytest.fixture
def app_dir(tmp_path: Path) -> Path:
    """A folder of small application modules, importable by the CLI."""
    modules = {
        "good_app.py": """
            from outbox import Outbox
            ob = Outbox()

            @ob.subscriber("order.placed", consumer="noop")
            def noop(job):
                pass
        """,
        "not_an_outbox.py": "ob = 42\nname = 'text'\n",
        "raises_on_import.py": "raise RuntimeError('boom while importing\\nsecond line of the message')\n",
        "broken_syntax.py": "def broken(:\n",
        "bad_factory.py": "def make():\n    raise ValueError('factory failed')\n",
        "imports_missing.py": "import no_such_dependency_abc\n",
    }
    for name, source in modules.items():
        (tmp_path / name).write_text(textwrap.dedent(source))
    return tmp_path


# ------------------------------------------------------------ as a real process
# A handful of cases run `python -m outbox.ops.cli` for real: exit status, stderr holding one
# line (logging included), no traceback from the interpreter. The variations after this
# section run main() in-process, the same code path, to keep the suite fast.


def test_process_bad_app_module(app_dir):
    result = run_cli("--app", "no_such_module_xyz:ob", "--database-url", UNREACHABLE, cwd=app_dir)
    assert_one_error_line(result, "--app 'no_such_module_xyz:ob'", "no module named 'no_such_module_xyz'")


def test_process_app_raising_on_import(app_dir):
    result = run_cli("--app", "raises_on_import:ob", "--database-url", UNREACHABLE, cwd=app_dir)
    assert_one_error_line(result, "importing raises_on_import raised RuntimeError: boom while importing",
                          "second line of the message")


def test_process_malformed_url(tmp_path):
    result = run_cli("migrate", "--database-url", f"postgresql://outbox:{SECRET}@db.example:notaport/x", cwd=tmp_path)
    assert_one_error_line(result, "database URL is malformed")


def test_process_unreachable_database(app_dir):
    result = run_cli("--app", "good_app:ob", "--database-url", UNREACHABLE, cwd=app_dir)
    line = assert_one_error_line(result, "cannot reach the database at postgresql+psycopg://outbox:***@127.0.0.1:1/outbox")
    assert "Connection refused" in line


def test_process_database_without_migrations(app_dir, empty_db_url):
    url, secret = with_secret(empty_db_url)
    result = run_cli("--app", "good_app:ob", "--database-url", url, cwd=app_dir)
    assert_one_error_line(result, "outbox tables are missing", "run `outbox-relay migrate`", secret=secret)


def test_process_migrate_ok_from_environment(empty_db_url, tmp_path):
    url, secret = with_secret(empty_db_url)
    first = run_cli("migrate", cwd=tmp_path, env={"OUTBOX_DATABASE_URL": url})
    assert first.returncode == 0, first.stderr
    assert first.stdout == f"outbox schema public at revision {head_revision()}\n"
    assert "Traceback" not in first.stderr and "error" not in first.stderr.lower()
    assert secret not in first.stdout + first.stderr
    # the flag wins over an environment naming an unreachable server
    status = run_cli("status", "--database-url", url, cwd=tmp_path, env={"OUTBOX_DATABASE_URL": UNREACHABLE})
    assert status.returncode == 0, status.stderr
    assert "unrouted events: 0" in status.stdout
    assert secret not in status.stdout + status.stderr


# ------------------------------------------------------------------------ --app


@pytest.mark.parametrize("spec, fragments", [
    ("no_such_module_xyz:ob", ["--app 'no_such_module_xyz:ob'", "no module named 'no_such_module_xyz'"]),
    ("not_an_outbox:ob", ["is a int, not an outbox.Outbox"]),
    ("not_an_outbox:name", ["is a str, not an outbox.Outbox"]),
    ("not_an_outbox:missing", ["has no attribute 'missing'"]),
    ("raises_on_import:ob", ["importing raises_on_import raised RuntimeError: boom while importing",
                             "/ second line of the message"]),
    ("broken_syntax:ob", ["importing broken_syntax raised SyntaxError"]),
    ("bad_factory:make", ["calling make raised ValueError: factory failed"]),
    ("imports_missing:ob", ["importing imports_missing failed", "no_such_dependency_abc"]),
    ("good_app", ["--app must look like 'package.module:attribute'"]),
    ("good_app:", ["--app must look like"]),
    (":ob", ["--app must look like"]),
])
def test_bad_app(cli, spec, fragments):
    # The app is loaded before the database is touched: an unreachable one does not matter.
    assert_one_error_line(cli("--app", spec, "--database-url", UNREACHABLE), *fragments)


# --------------------------------------------------------------------- database


@pytest.mark.parametrize("url, fragment", [
    (f"postgresql://outbox:{SECRET}@db.example:notaport/outbox", "database URL is malformed"),
    (SECRET, "database URL is malformed"),
    (f"mysql://outbox:{SECRET}@127.0.0.1/outbox", "must be a PostgreSQL URL"),
    (f"postgresql+asyncpg://outbox:{SECRET}@127.0.0.1/outbox", "driver 'postgresql+asyncpg' is not supported"),
    (f"postgresql://outbox:{SECRET}@127.0.0.1:5432/outbox?bogus_option=1", 'invalid connection option "bogus_option"'),
    (f"postgresql://outbox:{SECRET}@127.0.0.1:5432/outbox?sslmode=sometimes", "sslmode"),
    (f"postgresql://outbox:{SECRET}@127.0.0.1:99999/outbox", "port"),
    (f"postgresql://outbox:{SECRET}@127.0.0.1/outbox?port=abc", "Received non-integer port arguments"),
])
@pytest.mark.parametrize("command", ["migrate", "run", "status"])
def test_malformed_database_url(cli, url, fragment, command):
    assert_one_error_line(cli(command, "--database-url", url), fragment)


@pytest.mark.parametrize("command", [["migrate"], ["status"], ["dead"], ["redrive", "--all"], ["run"],
                                     ["run", "--app", "good_app:ob"]])
def test_unreachable_database(cli, command):
    line = assert_one_error_line(cli(*command, "--database-url", UNREACHABLE),
                                 "cannot reach the database at postgresql+psycopg://outbox:***@127.0.0.1:1/outbox")
    assert "Connection refused" in line


def test_unreachable_database_from_environment(cli):
    assert_one_error_line(cli("migrate", env={"OUTBOX_DATABASE_URL": UNREACHABLE}),
                          "cannot reach the database", "127.0.0.1:1")


def test_no_database_configured(cli):
    assert_one_error_line(cli("migrate"), "no database configured", "OUTBOX_DATABASE_URL")
    assert_one_error_line(cli("--app", "good_app:ob"), "no database configured")


def test_wrong_password(cli, server, empty_db_url):
    role, right = f"outbox_pw_{uuid.uuid4().hex[:8]}", "right-Pw-1"
    admin = sa.create_engine(server[0], isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    with admin.connect() as conn:
        conn.exec_driver_sql(f"CREATE ROLE {role} LOGIN PASSWORD '{right}'")
    try:
        wrong = empty_db_url.set(username=role, password=SECRET)
        try:
            psycopg.connect(wrong.set(drivername="postgresql").render_as_string(hide_password=False)).close()
        except psycopg.OperationalError:
            pass
        else:
            pytest.skip("this server trusts local logins (trust authentication): no password is ever refused")
        assert_one_error_line(cli("migrate", "--database-url", wrong.render_as_string(hide_password=False)),
                              "cannot reach the database", "password authentication failed")
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f"DROP ROLE IF EXISTS {role}")
        admin.dispose()


@pytest.mark.parametrize("command", [["status"], ["dead"], ["subscriptions"], ["redrive", "--all"],
                                     ["unsubscribe", "noop"], ["run", "--app", "good_app:ob"], ["run"]])
def test_database_without_migrations(cli, empty_db_url, command):
    url, secret = with_secret(empty_db_url)
    assert_one_error_line(cli(*command, "--database-url", url),
                          "outbox tables are missing", "run `outbox-relay migrate`", secret=secret)


@pytest.mark.parametrize("command", [["status"], ["run", "--app", "good_app:ob"]])
def test_database_at_another_schema_revision(cli, db_url, command):
    """A database migrated by an older (or newer) outbox: every command refuses to run on it
    and says which revision it found and which it needs."""
    with sa.create_engine(db_url, poolclass=sa.pool.NullPool).begin() as conn:
        conn.execute(sa.text("UPDATE outbox_alembic_version SET version_num = '0000_older'"))
    url, secret = with_secret(db_url)
    assert_one_error_line(cli(*command, "--database-url", url),
                          "schema public is at revision 0000_older", "run `outbox-relay migrate`", secret=secret)


@pytest.fixture
def limited_role(server):
    """Build the URL of a database for a new login role (password ``SECRET``) that may only
    connect, plus the grants given (SQL after ``GRANT``); ``revoke_create`` also takes
    CREATE on schema ``public`` away from PUBLIC in that database (PostgreSQL 15 does that
    by default, older servers do not). The role is dropped afterwards."""
    role = f"outbox_limited_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(server[0], isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    with admin.connect() as conn:
        conn.exec_driver_sql(f"CREATE ROLE {role} LOGIN PASSWORD '{SECRET}'")
    touched: list[URL] = []

    def build(url: URL, grants: tuple[str, ...] = (), revoke_create: bool = False) -> str:
        with sa.create_engine(url, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool).connect() as conn:
            touched.append(url)
            if revoke_create:
                conn.exec_driver_sql("REVOKE CREATE ON SCHEMA public FROM PUBLIC")
            for grant in grants:
                conn.exec_driver_sql(f"GRANT {grant} TO {role}")
        return url.set(username=role, password=SECRET).render_as_string(hide_password=False)

    yield build
    for url in touched:  # privileges inside a database dropped already went with it
        with admin.connect() as conn:
            if not conn.exec_driver_sql("SELECT 1 FROM pg_database WHERE datname = %(name)s",
                                        {"name": url.database}).first():
                continue
        with sa.create_engine(url, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool).connect() as conn:
            conn.exec_driver_sql(f"DROP OWNED BY {role}")
    with admin.connect() as conn:
        conn.exec_driver_sql(f"DROP ROLE IF EXISTS {role}")
    admin.dispose()


def test_process_migrate_refused_by_the_database_is_one_line(limited_role, empty_db_url, tmp_path):
    """A statement the database refuses (here: a role without CREATE on schema public) ends
    ``migrate`` with one line naming the error, not with a traceback."""
    result = run_cli("migrate", "--database-url", limited_role(empty_db_url, revoke_create=True), cwd=tmp_path)
    assert_one_error_line(result, "database error in postgresql+psycopg://outbox_limited_", ":***@",
                          "InsufficientPrivilege: permission denied for schema public",
                          info_lines=True)  # alembic's, before the failing statement


@pytest.mark.parametrize("command, grants, fragment", [
    (["migrate"], (), "permission denied for table outbox_alembic_version"),
    (["status"], (), "permission denied for table outbox_alembic_version"),
    (["dead"], ("SELECT ON outbox_alembic_version",), "permission denied for table outbox_jobs"),
    (["subscriptions"], ("SELECT ON outbox_alembic_version",), "permission denied for table outbox_subscriptions"),
    (["run", "--app", "good_app:ob"], ("SELECT ON outbox_alembic_version",),
     "permission denied for table outbox_subscriptions"),
])
def test_statement_refused_by_the_database_is_one_line(cli, limited_role, db_url, command, grants, fragment):
    """Every command that meets a database error other than the ones it explains itself
    (unreachable, no tables, another revision) prints it as one line and exits 2; a version
    table the role may not read is not mistaken for a missing one."""
    url = limited_role(db_url, grants)
    assert_one_error_line(cli(*command, "--database-url", url), "database error in", "InsufficientPrivilege", fragment,
                          info_lines=True)


# ------------------------------------------------------------------ settings


@pytest.mark.parametrize("env, args, fragment", [
    ({"OUTBOX_CONCURRENCY": "abc"}, [], "concurrency (OUTBOX_CONCURRENCY or --concurrency): Input should be a valid integer"),
    ({"OUTBOX_LOG_LEVEL": "loud"}, [], "log_level"),
    ({"OUTBOX_POLL_INTERVAL": "-1"}, [], "poll_interval (OUTBOX_POLL_INTERVAL or --poll-interval): Input should be greater than 0"),
    ({}, ["--concurrency", "0"], "concurrency (OUTBOX_CONCURRENCY or --concurrency): Input should be greater than or equal to 1"),
    ({}, ["--backoff-base", "10", "--backoff-cap", "5"], "backoff_base (10) must not exceed backoff_cap (5)"),
    ({"OUTBOX_BACKOFF_CAP": "5"}, ["--backoff-base", "10"], "must not exceed backoff_cap"),
    ({}, ["--poll-interval", "nan"], "poll_interval (OUTBOX_POLL_INTERVAL or --poll-interval): Input should be a finite number"),
    ({"OUTBOX_DEFAULT_LEASE": "inf"}, [], "default_lease (OUTBOX_DEFAULT_LEASE or --default-lease): Input should be a finite number"),
    ({}, ["--database-url", ""], "--database-url is empty"),
])
def test_invalid_setting(cli, env, args, fragment):
    assert_one_error_line(cli("run", "--database-url", UNREACHABLE, *args, env=env), fragment)


@pytest.mark.parametrize("limit", ["-1", "0", "99999999999999999999", "ten"])
def test_dead_limit_out_of_range_is_a_usage_error(app_dir, limit):
    result = run_cli("dead", "--limit", limit, "--database-url", UNREACHABLE, cwd=app_dir)
    assert result.returncode == 2 and "argument --limit" in result.stderr and "Traceback" not in result.stderr


def test_flag_overrides_environment(cli, db_url):
    url, secret = with_secret(db_url)
    # the environment names an unreachable server; the flag wins
    result = cli("status", "--database-url", url, env={"OUTBOX_DATABASE_URL": UNREACHABLE})
    assert result.returncode == 0, result.stderr
    assert "unrouted events: 0" in result.stdout
    # and an invalid environment value is overridden by a valid flag
    result = cli("status", "--database-url", url, "--log-level", "error", env={"OUTBOX_LOG_LEVEL": "loud"})
    assert result.returncode == 0, result.stderr
    assert secret not in result.stdout + result.stderr


# -------------------------------------------------------------------- migrate


def test_migrate_ok_and_again(cli, empty_db_url):
    url, secret = with_secret(empty_db_url)
    first = cli("migrate", "--database-url", url)
    assert (first.returncode, first.stdout, first.stderr) == (0, f"outbox schema public at revision {head_revision()}\n", "")
    again = cli("migrate", "--database-url", url)
    assert (again.returncode, again.stdout, again.stderr) == (0, first.stdout, "")
    status = cli("status", "--database-url", url)
    assert status.returncode == 0 and status.stdout.startswith("unrouted events: 0"), status
    assert secret not in first.stdout + again.stdout + status.stdout


def test_a_reader_that_leaves_early_gets_no_traceback(db_url, tmp_path):
    """`outbox-relay status | head -1`: the pipe closes before status has written; it exits
    quietly (141, as a shell reports SIGPIPE) instead of printing a BrokenPipeError."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    process = subprocess.Popen([sys.executable, "-m", "outbox.ops.cli", "status", "--database-url",
                                db_url.render_as_string(hide_password=False)],
                               cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    process.stdout.close()  # the reader is gone before the first line
    stderr = process.stderr.read()
    assert process.wait(60) == 141, stderr
    assert "Traceback" not in stderr and "BrokenPipe" not in stderr, stderr


@pytest.mark.parametrize("name, fragment", [("x" * 20_000, "20000 characters long, the limit is 255"),
                                            ("a\x00b", "NUL"), ("  ", "needs a consumer name")])
def test_pause_and_resume_refuse_a_name_no_registry_could_declare_before_connecting(cli, name, fragment):
    """Checked before anything connects (the database here is unreachable): the error names
    the name's problem, not the database (a 20,000-character name used to reach the server
    and come back as 'cannot reach the database ... index row requires 20016 bytes')."""
    unreachable = {"OUTBOX_DATABASE_URL": "postgresql://postgres@127.0.0.1:1/nowhere"}
    for command in ("pause", "resume"):
        assert_one_error_line(cli(command, name, env=unreachable), command, fragment)


@pytest.mark.parametrize("args, fragment", [
    (["--older-than", "ten minutes"], "--older-than: not an age: 'ten minutes'"),
    (["--newer-than=-5m"], "--newer-than: not an age: '-5m'"),
    (["--older-than", "1" * 400], "--older-than: '111"),
    (["--older-than", "99999999999d"], "is more than 1000 years"),
    (["--older-than", "1h", "--newer-than", "30m"], "--newer-than 30m is not above --older-than 1h"),
    (["--consumer", ""], "jobs needs a consumer name"),
    (["--key", ""], "--key: must be a non-empty text"),
])
def test_jobs_refuses_a_bad_filter_naming_the_flag_before_connecting(cli, args, fragment):
    assert_one_error_line(cli("jobs", *args, "--database-url", UNREACHABLE), fragment)


@pytest.mark.parametrize("args, fragment", [
    (["--limit", "0"], "argument --limit: must be between 1 and 1000, got 0"),
    (["--limit", "1001"], "argument --limit: must be between 1 and 1000, got 1001"),
    (["--after", "0"], "argument --after: must be between 1 and"),
    (["--event", "x"], "argument --event: not a whole number: 'x'"),
    (["--status", "deadd"], "argument --status: invalid choice: 'deadd'"),
])
def test_jobs_argument_out_of_range_is_a_usage_error(app_dir, args, fragment):
    result = run_cli("jobs", *args, "--database-url", UNREACHABLE, cwd=app_dir)
    assert result.returncode == 2 and fragment in result.stderr and "Traceback" not in result.stderr
