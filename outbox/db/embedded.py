"""The embedded PostgreSQL used when no database is configured (extra ``embedded``:
``pip install 'outbox-relay[embedded]'``, which installs ``pgserver``, a PostgreSQL server
shipped in a wheel). Meant for the demo and the test suite, not for production."""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path

from outbox.errors import ConfigurationError

log = logging.getLogger(__name__)

#: Where the embedded server keeps its data unless told otherwise.
DEFAULT_DATA_DIR = Path(".outbox") / "pgdata"


def start_embedded(data_dir: str | os.PathLike[str] = DEFAULT_DATA_DIR, *, delete_on_exit: bool = False) -> str:
    """Start (or reuse) an embedded PostgreSQL keeping its files in ``data_dir``; returns
    its URL (``postgresql://postgres:@/postgres?host=<socket dir>``: it listens on a Unix
    socket only, no TCP port). It stops when the last process using it exits; with
    ``delete_on_exit`` its data folder is deleted then too (pgserver's ``cleanup_mode
    "delete"``, the way pgserver's docs give for a temporary server), else it is kept for
    the next start (the demo's data). A process killed without running its exit handlers
    (SIGKILL, an unhandled SIGTERM) leaves the server running and its folder behind.

    Raises :class:`ConfigurationError` when the ``embedded`` extra is not installed.
    """
    logging.getLogger("pgserver").setLevel(logging.WARNING)  # it narrates every pg_ctl call at INFO
    try:
        with warnings.catch_warnings():  # its platformdirs complains when XDG_RUNTIME_DIR is unset
            warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR")
            # From its module: pgserver's __init__ does not re-export it for type checkers.
            from pgserver.postgres_server import get_server
    except ImportError:
        raise ConfigurationError(
            "no database configured and the embedded server is not installed: "
            "set OUTBOX_DATABASE_URL, or pip install 'outbox-relay[embedded]'") from None
    path = Path(data_dir).resolve()
    path.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR")
        server = get_server(path, cleanup_mode="delete" if delete_on_exit else "stop")
    log.info("embedded PostgreSQL running with its data in %s", path)
    return server.get_uri()


def psql_binary() -> str:
    """Path of the psql program shipped with the embedded server."""
    import pgserver

    return str(Path(pgserver.__file__).parent / "pginstall" / "bin" / "psql")
