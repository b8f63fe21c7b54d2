"""``outbox-relay dashboard``: a small server-rendered web dashboard (extra ``[dashboard]``:
Starlette, Jinja2, uvicorn; htmx vendored under ``static/``, no build step) that reads and
acts only through :mod:`outbox.admin`.

Pages: the overview (per consumer ready / running / pending / dead / cancelled, lag, done per
minute over the last minutes as a server-rendered SVG chart, paused and blocked state;
unrouted events and topics nobody subscribes to; live relays; refreshed by htmx every few
seconds), a consumer's jobs by status in keyset pages with dead letters' errors (traceback
folded) and the actions redrive, retry now, cancel, pause and resume, each confirmed on a
page of its own; an event by id or key with its job for every consumer (attempts, fence,
lease, relay, status, last error); the relay registry.

Safety (:func:`serve`): binds 127.0.0.1 unless told otherwise; any address but a literal
loopback one (127.0.0.0/8, ``::1``; a name such as ``localhost`` is not one) needs
credentials (``OUTBOX_DASHBOARD_TOKEN``, or ``OUTBOX_DASHBOARD_USER`` and
``OUTBOX_DASHBOARD_PASSWORD``) and is refused without them, as are a token shorter than 16 characters and a blank user or
password; secrets are never logged. Only the Host values no other site can send are
answered (without credentials: ``localhost`` and loopback addresses on the dashboard's port,
plus ``OUTBOX_DASHBOARD_ALLOWED_HOSTS``; 400 otherwise, against DNS rebinding;
:mod:`.origin`). Every action is a POST from the dashboard's own origin (``Origin`` or
``Referer``; 403 otherwise) carrying a CSRF token bound to the browser's session; wrong
credentials hold their client address for a doubling time (:mod:`.throttle`); the access log
writes no query parameter but the dashboard's own (:mod:`.accesslog`); every value is
escaped by Jinja2's autoescape, and a Content-Security-Policy allows scripts from the
dashboard only; ``read_only`` hides and refuses (403) every action. Request input reaches
SQL only as bound parameters of the statements :mod:`outbox.admin` runs.
"""

from __future__ import annotations

import logging
import socket
from typing import Any

from outbox.errors import ConfigurationError
from outbox.ops.dashboard.accesslog import redact_access_log
from outbox.ops.dashboard.app import create_app
from outbox.ops.dashboard.auth import DashboardAuth, bind_address, is_loopback
from outbox.ops.dashboard.origin import HostPolicy
from outbox.settings import OutboxSettings

__all__ = ["DashboardAuth", "bind_address", "create_app", "is_loopback", "check_bind", "listen", "serve"]

log = logging.getLogger(__name__)


def check_bind(host: str, auth: DashboardAuth | None) -> None:
    """Refuse (:class:`~outbox.errors.ConfigurationError`) to listen on ``host`` without
    credentials unless it is a literal loopback address (:func:`is_loopback`): on any other
    interface, whoever reaches the port could redrive, cancel and pause."""
    if auth is None and not is_loopback(host):
        raise ConfigurationError(
            f"dashboard: refusing to listen on {host} without authentication; set OUTBOX_DASHBOARD_TOKEN (or "
            "OUTBOX_DASHBOARD_USER and OUTBOX_DASHBOARD_PASSWORD), or bind 127.0.0.1")


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host`` (an address or a name; ``[::1]`` as ``::1``) and
    ``port``, listening. Raises :class:`~outbox.errors.ConfigurationError`, in one line, when
    the name does not resolve or the address cannot be bound (in use, not on this host), so
    the dashboard fails before it announces anything."""
    address = bind_address(host)
    try:
        family, kind, proto, _, where = socket.getaddrinfo(address or None, port, type=socket.SOCK_STREAM,
                                                           flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as exc:
        raise ConfigurationError(f"dashboard: cannot listen on --host {host!r}: {exc}") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(where)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise ConfigurationError(f"dashboard: cannot listen on {host} port {port}: {exc.strerror or exc}") from None
    return sock


def serve(settings: OutboxSettings, *, host: str = "127.0.0.1", port: int = 8000, read_only: bool = False) -> int:
    """Run the dashboard on ``host``:``port`` until interrupted (uvicorn), on the database of
    ``settings``; returns 0 after a clean stop. Checks the bind (:func:`check_bind`) and
    the allowed hosts (:class:`~outbox.ops.dashboard.origin.HostPolicy`) first, so nothing
    listens when it refuses. A database that is down at start or later makes
    pages answer 503; the server stays up and recovers with the database."""
    from outbox.db.engine import make_engine, redact

    auth = DashboardAuth.from_settings(settings)
    check_bind(host, auth)
    HostPolicy.from_settings(settings, authenticated=auth is not None)  # refused entries fail before listening
    url = settings.url()
    if url is None:
        raise ConfigurationError("no database configured: set OUTBOX_DATABASE_URL or pass --database-url")
    sock = listen(host, port)
    engine = make_engine(url, pool_size=4, application_name="outbox-dashboard")
    app = create_app(engine, settings, read_only=read_only, auth=auth)
    address = bind_address(host)
    shown = f"[{address}]" if ":" in address else address
    log.info("dashboard on http://%s:%d for %s, schema %s%s; auth: %s", shown, port, redact(url),
             settings.schema_name, " (read-only)" if read_only else "", auth.describe() if auth else "none (loopback)")
    redact_access_log()
    try:
        started = serve_app(app, sock, address, port)
    finally:
        engine.dispose()
    if not started:
        raise ConfigurationError(f"dashboard: the server on {host} port {port} did not start (its log says why)")
    return 0


def serve_app(app: Any, sock: socket.socket, address: str, port: int) -> bool:
    """Serve the ASGI ``app`` with uvicorn on the bound ``sock`` (``address``, ``port``: what
    uvicorn reports) until interrupted (Ctrl-C ends it cleanly), then close ``sock``. Returns
    whether the server started. Outbox's HTTP commands (the dashboard, ``intake-http``) share it."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=address, port=port, log_config=None, server_header=False))
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
    return bool(server.started)
