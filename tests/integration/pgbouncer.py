"""A throw-away PgBouncer for tests: started on a free port of 127.0.0.1 with a config file
in a temporary folder, pooling in transaction mode in front of the test server, stopped
afterwards. :func:`unavailable` says why one cannot be started here (no ``pgbouncer``
binary; a server not reached over TCP, such as the embedded one on a Unix socket)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from sqlalchemy.engine import URL

#: Where Debian's package puts the binary (not on root's PATH in every shell).
CANDIDATES = ("pgbouncer", "/usr/sbin/pgbouncer", "/usr/bin/pgbouncer")


def binary() -> str | None:
    """Path of the pgbouncer program, or None."""
    for name in CANDIDATES:
        found = shutil.which(name)
        if found:
            return found
    return None


def unavailable(server: URL) -> str | None:
    """Why no PgBouncer can front ``server`` here, or None when one can."""
    if binary() is None:
        return "pgbouncer is not installed (.ci/run installs Debian's package: apt-get install -y pgbouncer)"
    host = server.host or server.query.get("host")
    if not host or str(host).startswith("/"):
        return f"the test server is not reached over TCP (host {host!r}): the test's PgBouncer forwards to host:port"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def pgbouncer(server: URL, *, pool_size: int = 4, extra: str = "") -> Iterator[URL]:
    """Run PgBouncer 1.x (``pool_mode = transaction``, ``auth_type = trust``, at most
    ``pool_size`` server connections per database and user) in front of ``server``'s host
    and port; yields ``server``'s URL with its host and port replaced by PgBouncer's.
    ``extra`` is appended to the ``[pgbouncer]`` section. As root, PgBouncer (which refuses
    to run as root) is told to switch to the ``postgres`` user."""
    program = binary()
    assert program is not None, "check unavailable() first"
    port = _free_port()
    folder = Path(tempfile.mkdtemp(prefix="outbox-pgbouncer-"))
    user = server.username or "postgres"
    (folder / "userlist.txt").write_text(f'"{user}" ""\n')
    run_as = "user = postgres\n" if os.geteuid() == 0 else ""
    (folder / "pgbouncer.ini").write_text(
        "[databases]\n"
        f"* = host={server.host} port={server.port or 5432}\n"
        "[pgbouncer]\n"
        f"listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n"
        f"auth_type = trust\nauth_file = {folder / 'userlist.txt'}\n"
        f"pool_mode = transaction\ndefault_pool_size = {pool_size}\nmax_client_conn = 500\n"
        f"logfile = {folder / 'pgbouncer.log'}\npidfile = {folder / 'pgbouncer.pid'}\n"
        f"{run_as}{extra}\n")
    if os.geteuid() == 0:
        shutil.chown(folder, "postgres")
        for child in folder.iterdir():
            shutil.chown(child, "postgres")
    proc = subprocess.Popen([program, str(folder / "pgbouncer.ini")], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                log = (folder / "pgbouncer.log").read_text() if (folder / "pgbouncer.log").exists() else ""
                out = proc.stdout.read().decode(errors="replace") if proc.stdout and proc.poll() is not None else ""
                raise RuntimeError(f"pgbouncer did not start (exit {proc.poll()}): {out}{log}")
            time.sleep(0.05)
        yield server.set(host="127.0.0.1", port=port)
    finally:
        proc.send_signal(signal.SIGINT)  # immediate shutdown
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(folder, ignore_errors=True)
