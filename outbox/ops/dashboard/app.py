"""The dashboard's web application: Starlette routes rendering Jinja2 templates, reading and
acting only through :mod:`outbox.admin`.

Pages: ``/`` (overview; ``/overview`` is its refreshing part, fetched by htmx), ``/consumers/<name>``
(jobs by status, keyset pages, actions), ``/events`` (look-up by id or key) and
``/events/<id>``, ``/relays``. Actions: ``GET /confirm`` shows what an action will do with
a form; only its ``POST /actions/<action>`` acts, and only with the form's CSRF token. Every
endpoint is a plain function run in Starlette's thread pool on a SQLAlchemy engine.

Failures: the database unreachable (or outbox's tables missing) answers 503 with a
readable line (the page reloads itself and recovers when the database is back; the
overview's refresh keeps polling); bad input (a non-numeric id, an unknown status) answers
400, an unknown consumer or event 404, an action in read-only mode or without a valid CSRF
token 403, an unexpected error 500: always a page, never a traceback. Before any route
(:class:`Guard`): a Host the dashboard does not answer 400, a POST from another origin 403,
missing or wrong credentials 401, and 429 while wrong ones hold the client.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import jinja2
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import TimeoutError as PoolTimeoutError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from outbox import admin
from outbox.db.engine import translate_errors
from outbox.errors import (
    AdminError,
    DatabaseStatementError,
    DatabaseUnavailableError,
    SchemaNotReadyError,
)
from outbox.ops.dashboard.auth import (
    AUTH_COOKIE,
    SESSION_COOKIE,
    CsrfGuard,
    DashboardAuth,
)
from outbox.ops.dashboard.origin import HostPolicy, same_origin
from outbox.ops.dashboard.throttle import LoginThrottle, client_key, retry_after
from outbox.settings import OutboxSettings

log = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
#: Seconds between the overview's refreshes; minutes its throughput chart covers.
REFRESH_SECONDS = 3.0
CHART_MINUTES = 10
#: Jobs per page of the consumer page.
PAGE_SIZE = 50
#: What the action buttons do, by name: (label, needs a job id, allowed without one).
ACTIONS: dict[str, tuple[str, bool, bool]] = {
    "redrive": ("Redrive", False, True),   # a dead job, or every dead job of the consumer
    "retry": ("Retry now", False, True),   # a ready job in backoff, or all of the consumer's
    "cancel": ("Cancel", True, False),     # one ready, pending or running job
    "pause": ("Pause", False, True),
    "resume": ("Resume", False, True),
}
#: Headers of every response: no script, style or frame from anywhere but the dashboard itself
#: (a second wall behind the escaping of every value), no referrer to other sites (``same-origin``:
#: with ``no-referrer`` a browser sends ``Origin: null`` with the dashboard's own forms, which the
#: Origin check refuses), no MIME sniffing.
SECURITY_HEADERS = {
    "content-security-policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "frame-ancestors 'none'; base-uri 'none'; form-action 'self'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "same-origin",
    "x-frame-options": "DENY",
    "cache-control": "no-store",
}
#: Methods that change nothing, so they need no Origin check (RFC 9110, "Safe Methods").
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def _environment() -> jinja2.Environment:
    """Jinja2 with autoescape on for every template and every value (payloads, errors and
    topic names are hostile input) and undefined names as errors."""
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"), autoescape=True,
                             undefined=jinja2.StrictUndefined)
    env.filters["when"] = _when
    env.filters["age"] = _age
    env.filters["pretty"] = lambda value: json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True)
    env.filters["first_line"] = lambda text: (text or "").strip().splitlines()[0] if (text or "").strip() else ""
    env.globals["bars"] = bars
    return env


def _when(value: datetime | None) -> str:
    return "-" if value is None else value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _age(seconds: float | None) -> str:
    """A duration for people (:func:`outbox.admin.age_text`)."""
    return admin.age_text(seconds)


def bars(counts: list[int], width: int = 150, height: int = 28) -> list[dict[str, float]]:
    """The bars of a small SVG chart of ``counts`` (oldest first) in a ``width`` x ``height``
    box: one per count, x, y, w, h in pixels (the tallest bar fills the height; a zero
    count gets a 1-pixel stub so the minute is visible), with the count as ``n``."""
    if not counts:
        return []
    top = max(max(counts), 1)
    step = width / len(counts)
    out = []
    for i, n in enumerate(counts):
        h = max(1.0, height * n / top) if n else 1.0
        out.append({"x": round(i * step + 1, 1), "y": round(height - h, 1), "w": round(max(step - 2, 1), 1),
                    "h": round(h, 1), "n": n})
    return out


class Dashboard:
    """The state the endpoints share: the engine, the schema, read-only or not, the
    credentials, the Host values answered, the throttle of wrong credentials and the CSRF
    guard, the templates."""

    def __init__(self, engine: Engine, settings: OutboxSettings, *, read_only: bool, auth: DashboardAuth | None,
                 hosts: HostPolicy, throttle: LoginThrottle, refresh_seconds: float) -> None:
        self.engine = engine
        self.schema = settings.schema_name
        self.read_only = read_only
        self.auth = auth
        self.hosts = hosts
        self.throttle = throttle
        self.refresh_seconds = refresh_seconds
        self.csrf = CsrfGuard()
        self.templates = _environment()

    @contextmanager
    def connect(self) -> Iterator[Connection]:
        """A connection in a transaction, committed at the end; database errors come out as
        outbox's (:func:`outbox.db.engine.translate_errors`)."""
        with translate_errors(self.engine.url, self.schema):
            try:
                with self.engine.begin() as conn:
                    yield conn
            except PoolTimeoutError as exc:
                raise DatabaseUnavailableError(f"no database connection free: {exc}") from exc

    def render(self, request: Request, template: str, status_code: int = 200, *, session: bool = True,
               **context: Any) -> HTMLResponse:
        """``template`` rendered with ``context`` plus what every page uses; ``session``
        False: with no CSRF token in it (an answer to a refused Host or Origin)."""
        session_id = request.cookies.get(SESSION_COOKIE) or request.scope.get("outbox.session") or ""
        html = self.templates.get_template(template).render(
            request=request, read_only=self.read_only, signed_in=self.auth is not None and self.auth.token is not None,
            csrf=self.csrf.token(session_id) if session and session_id else "", refresh=self.refresh_seconds,
            **context)
        return HTMLResponse(html, status_code=status_code)

    def error(self, request: Request, status_code: int, title: str, message: str, *,
              session: bool = True) -> HTMLResponse:
        """The error page: a heading and one readable line; a 503 page reloads itself."""
        return self.render(request, "error.html", status_code, session=session, title=title, message=message,
                           reload=status_code == 503)

    def sign_in(self, request: Request, status_code: int, *, wrong: bool = False, wait: float = 0.0) -> HTMLResponse:
        """The sign-in page: 401 (``wrong``: after a wrong token typed into it), or 429 with
        ``Retry-After`` while the client is held for ``wait`` more seconds."""
        assert self.auth is not None
        response = self.render(request, "login.html", status_code, wrong=wrong, basic=self.auth.user is not None,
                               token=self.auth.token is not None, wait=retry_after(wait) if wait > 0 else None)
        if wait > 0:
            response.headers["retry-after"] = retry_after(wait)
        return response


class Guard:
    """ASGI middleware before every route, in this order: the ``Host`` check (400 for a Host
    the dashboard does not answer: DNS rebinding, :mod:`outbox.ops.dashboard.origin`), the
    ``Origin`` check of every request but GET, HEAD and OPTIONS (403 from another origin), the
    credentials check (401 with a sign-in page, or a basic-auth challenge; 429 while the
    client is held for wrong ones, :mod:`outbox.ops.dashboard.throttle`), the session cookie the
    CSRF token is bound to, and the security headers on every response. A refused Host or
    Origin gets no session cookie."""

    def __init__(self, app: ASGIApp, dashboard: Dashboard) -> None:
        self.app = app
        self.dashboard = dashboard

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        refusal = self.refusal(request)
        if refusal is not None:
            await refusal(scope, receive, _secured(send, None))
            return
        new_session = None
        if not request.cookies.get(SESSION_COOKIE):
            new_session = CsrfGuard.new_session()
            scope["outbox.session"] = new_session
        path = scope["path"]
        if self.dashboard.auth is not None and path != "/login" and not path.startswith("/static/"):
            denied = self.authenticate(request)
            if denied is not None:
                await denied(scope, receive, _secured(send, new_session))
                return
        await self.app(scope, receive, _secured(send, new_session))

    def refusal(self, request: Request) -> Response | None:
        """The answer to a request from or to the wrong address, None for the others."""
        dash = self.dashboard
        host = request.headers.get("host")
        server = request.scope.get("server")
        port = server[1] if server else None
        if not dash.hosts.allows(host, port):
            return dash.error(request, 400, "Wrong address",
                              f"this dashboard does not answer to the host name {(host or '')[:100]!r}: open it at "
                              f"one of {dash.hosts.describe(port)} (or list the name in "
                              "OUTBOX_DASHBOARD_ALLOWED_HOSTS)", session=False)
        if request.method not in SAFE_METHODS and not same_origin(
                request.headers.get("origin"), request.headers.get("referer"), host):
            return dash.error(request, 403, "Refused",
                              "this form was not sent from the dashboard's own pages (its Origin, or Referer, names "
                              "another site or none): open the dashboard and confirm the action there", session=False)
        return None

    def authenticate(self, request: Request) -> Response | None:
        """None when the request carries valid credentials; else the 401 (or 429) answer.
        A valid sign-in cookie passes at once; an ``Authorization`` header is checked only
        while its client is not held, and a wrong one counts against it."""
        dash = self.dashboard
        auth = dash.auth
        assert auth is not None
        if auth.cookie_matches(request.cookies.get(AUTH_COOKIE)):
            return None
        authorization = request.headers.get("authorization")
        if authorization:
            client = client_key(request.client.host if request.client else None)
            wait = dash.throttle.wait(client)
            if wait > 0:
                return dash.sign_in(request, 429, wait=wait)
            if auth.authorization_matches(authorization):
                dash.throttle.succeeded(client)
                return None
            dash.throttle.failed(client)
        response = dash.sign_in(request, 401)
        if auth.user is not None:
            response.headers["www-authenticate"] = 'Basic realm="outbox dashboard", charset="UTF-8"'
        return response


def _secured(send: Send, new_session: str | None) -> Send:
    """``send`` with the security headers added to the response's start, and the cookie of a
    ``new_session`` (None: none to set)."""
    async def send_with_headers(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = list(message.get("headers", []))
            headers += [(k.encode(), v.encode()) for k, v in SECURITY_HEADERS.items()]
            if new_session is not None:
                headers.append((b"set-cookie", f"{SESSION_COOKIE}={new_session}; HttpOnly; SameSite=Strict; "
                                               "Path=/".encode()))
            message["headers"] = headers
        await send(message)
    return send_with_headers


def create_app(engine: Engine, settings: OutboxSettings, *, read_only: bool = False,
               auth: DashboardAuth | None = None, refresh_seconds: float = REFRESH_SECONDS,
               throttle: LoginThrottle | None = None) -> Starlette:
    """The dashboard as an ASGI application on ``engine``'s database, the outbox in
    ``settings.schema_name``. ``read_only``: no action is shown, and every action is refused
    (403). ``auth``: the credentials every request must carry (None: none; only for a
    loopback bind, which :func:`outbox.ops.dashboard.serve` enforces). The Host values it answers
    come from ``settings.dashboard_allowed_hosts`` and ``auth``
    (:class:`~outbox.ops.dashboard.origin.HostPolicy`; raises
    :class:`~outbox.errors.ConfigurationError` for an entry it refuses). ``refresh_seconds``:
    how often the overview refreshes itself. ``throttle``: the hold on wrong credentials
    (default :class:`~outbox.ops.dashboard.throttle.LoginThrottle` with its defaults; tests give
    one a clock of their own)."""
    hosts = HostPolicy.from_settings(settings, authenticated=auth is not None)
    dash = Dashboard(engine, settings, read_only=read_only, auth=auth, hosts=hosts,
                     throttle=throttle or LoginThrottle(), refresh_seconds=refresh_seconds)

    def page(handler: Callable[[Request], Response]) -> Callable[[Request], Response]:
        """Turn the exceptions of ``handler`` into pages (see the module notes)."""
        def endpoint(request: Request) -> Response:
            try:
                return handler(request)
            except HTTPException as exc:
                return dash.error(request, exc.status_code, _TITLES.get(exc.status_code, "Error"), str(exc.detail))
            except AdminError as exc:
                return dash.error(request, 400, "Bad request", str(exc))
            except (DatabaseUnavailableError, SchemaNotReadyError) as exc:
                log.warning("dashboard: %s", exc)
                return dash.error(request, 503, "Database unavailable", str(exc))
            except DatabaseStatementError as exc:
                log.warning("dashboard: %s", exc)
                return dash.error(request, 500, "Database error", str(exc))
            except Exception:
                log.exception("dashboard: %s %s failed", request.method, request.url.path)
                return dash.error(request, 500, "Internal error", "the dashboard failed on this request; its log "
                                                                  "has the details")
        endpoint.__name__ = handler.__name__
        return endpoint

    def overview(request: Request) -> Response:
        return dash.render(request, "overview.html", **_overview(dash))

    def overview_part(request: Request) -> Response:
        try:
            return dash.render(request, "_overview.html", **_overview(dash))
        except (DatabaseUnavailableError, SchemaNotReadyError) as exc:
            log.warning("dashboard: %s", exc)
            return dash.render(request, "_overview.html", 503, failure=str(exc))

    def consumer_page(request: Request) -> Response:
        name = request.path_params["consumer"]
        status = request.query_params.get("status", "dead")
        if status not in admin.JOB_STATUSES:
            raise HTTPException(400, f"unknown status {status!r}; one of {', '.join(admin.JOB_STATUSES)}")
        before = _id_param(request.query_params.get("before"), "before")
        with dash.connect() as conn:
            consumer = _consumer(conn, name, dash.schema)
            jobs = admin.jobs_page(conn, name, status, before=before, limit=PAGE_SIZE, schema=dash.schema)
        message = request.query_params.get("msg")
        shown = message if dash.csrf.sealed(message, request.query_params.get("seal")) else None
        return dash.render(request, "consumer.html", consumer=consumer, page=jobs, statuses=admin.JOB_STATUSES,
                           message=shown, before=before)

    def events_lookup(request: Request) -> Response:
        raw_id = (request.query_params.get("id") or "").strip()
        key = _text_param(request.query_params.get("key"), "key")
        if raw_id:
            event_id = _id_param(raw_id, "event id")
            return RedirectResponse(f"/events/{event_id}", status_code=303)
        traces: list[admin.EventTrace] = []
        if key:
            with dash.connect() as conn:
                traces = admin.events_by_key(conn, key, schema=dash.schema)
        return dash.render(request, "events.html", key=key, traces=traces, scan=admin.KEY_SCAN)

    def jobs_list(request: Request) -> Response:
        query = request.query_params
        filters = {name: (query.get(name) or "").strip() for name in ("consumer", "status", "key", "event", "older_than")}
        older = filters["older_than"]
        after = _id_param(query.get("after"), "after")
        with dash.connect() as conn:
            jobs = admin.list_jobs(
                conn, consumer=_text_param(filters["consumer"], "consumer") or None,
                statuses=[filters["status"]] if filters["status"] else None,
                key=_text_param(filters["key"], "key") or None, event_id=_id_param(filters["event"], "event id"),
                older_than=admin.age_seconds(older, "older than") if older else None, after=after,
                limit=PAGE_SIZE, schema=dash.schema)
        given = {name: value for name, value in filters.items() if value}
        return dash.render(request, "jobs.html", page=jobs, filters=given, statuses=admin.JOB_STATUSES, after=after)

    def event_page(request: Request) -> Response:
        event_id = _id_param(request.path_params["event_id"], "event id")
        assert event_id is not None
        with dash.connect() as conn:
            trace = admin.event_trace(conn, event_id, schema=dash.schema)
        if trace is None:
            raise HTTPException(404, f"no event {event_id} (never published, or pruned)")
        return dash.render(request, "event.html", trace=trace, history_kept=admin.HISTORY_KEPT)

    def relays_page(request: Request) -> Response:
        with dash.connect() as conn:
            rows = admin.relays(conn, schema=dash.schema)
        return dash.render(request, "relays.html", relays=rows, gone_after=admin.RELAY_SILENT_AFTER)

    def confirm(request: Request) -> Response:
        if dash.read_only:
            raise HTTPException(403, "the dashboard is read-only: actions are off")
        action, name, job = _action_args(request.query_params.get("action"), request.query_params.get("consumer"),
                                         request.query_params.get("job"))
        with dash.connect() as conn:
            consumer = _consumer(conn, name, dash.schema)
            _check_owner(dash, name, job, conn)
        return dash.render(request, "confirm.html", action=action, label=ACTIONS[action][0], consumer=consumer,
                           job=job, back=request.query_params.get("status") or "dead")

    async def act(request: Request) -> Response:
        form = await request.form()
        fields = {k: v for k, v in form.items() if isinstance(v, str)}
        return await _threadpool(act_sync, request, fields)

    def act_sync(request: Request, fields: dict[str, str]) -> Response:
        if dash.read_only:
            raise HTTPException(403, "the dashboard is read-only: actions are off")
        if not dash.csrf.valid(request.cookies.get(SESSION_COOKIE), fields.get("csrf")):
            raise HTTPException(403, "the form's CSRF token is missing or does not match this browser's session: "
                                     "reload the page and confirm again")
        action, name, job = _action_args(request.path_params["action"], fields.get("consumer"), fields.get("job"))
        with dash.connect() as conn:
            _consumer(conn, name, dash.schema)
        message = _perform(dash, action, name, job)
        log.info("dashboard: %s", message)
        back = fields.get("back")
        query = urlencode({"status": back if back in admin.JOB_STATUSES else "dead", "msg": message,
                           "seal": dash.csrf.seal(message)})
        return RedirectResponse(f"/consumers/{_quote(name)}?{query}", status_code=303)

    async def login(request: Request) -> Response:
        auth = dash.auth
        if request.method == "GET" or auth is None:
            if auth is None:
                return RedirectResponse("/", status_code=303)
            return dash.sign_in(request, 200)
        client = client_key(request.client.host if request.client else None)
        wait = dash.throttle.wait(client)
        if wait > 0:  # held: the token is not even read, right or wrong (module notes of .throttle)
            return dash.sign_in(request, 429, wait=wait)
        form = await request.form()
        token = form.get("token")
        cookie = auth.cookie_value()
        if not isinstance(token, str) or cookie is None or not auth.token_matches(token.strip()):
            dash.throttle.failed(client)
            return dash.sign_in(request, 401, wrong=True)
        dash.throttle.succeeded(client)
        response = RedirectResponse("/", status_code=303)
        response.set_cookie(AUTH_COOKIE, cookie, httponly=True, samesite="strict")
        return response

    async def logout(request: Request) -> Response:
        form = await request.form()
        token = form.get("csrf")
        if not dash.csrf.valid(request.cookies.get(SESSION_COOKIE), token if isinstance(token, str) else None):
            return dash.error(request, 403, "Refused", "the form's CSRF token is missing or does not match")
        response = RedirectResponse("/login", status_code=303)
        response.delete_cookie(AUTH_COOKIE)
        return response

    async def _threadpool(fn: Callable[[Request, dict[str, str]], Response], request: Request,
                          fields: dict[str, str]) -> Response:
        from starlette.concurrency import run_in_threadpool

        return await run_in_threadpool(page(lambda r: fn(r, fields)), request)

    async def not_found(request: Request, exc: Exception) -> Response:
        status_code = exc.status_code if isinstance(exc, HTTPException) else 404
        return dash.error(request, status_code, _TITLES.get(status_code, "Error"),
                          "no such page" if status_code == 404 else str(getattr(exc, "detail", "")))

    async def server_error(request: Request, exc: Exception) -> Response:
        log.error("dashboard: %s %s failed", request.method, request.url.path, exc_info=exc)
        return dash.error(request, 500, "Internal error", "the dashboard failed on this request; its log has the "
                                                          "details")

    routes = [
        Route("/", page(overview)),
        Route("/overview", page(overview_part)),
        Route("/consumers/{consumer:path}", page(consumer_page)),
        Route("/jobs", page(jobs_list)),
        Route("/events", page(events_lookup)),
        Route("/events/{event_id}", page(event_page)),
        Route("/relays", page(relays_page)),
        Route("/confirm", page(confirm)),
        Route("/actions/{action}", act, methods=["POST"]),
        Route("/login", login, methods=["GET", "POST"]),
        Route("/logout", logout, methods=["POST"]),
        Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
    ]
    return Starlette(routes=routes, middleware=[Middleware(Guard, dashboard=dash)],
                     exception_handlers={404: not_found, 405: not_found, 500: server_error})


_TITLES = {400: "Bad request", 401: "Sign in", 403: "Refused", 404: "Not found", 405: "Not allowed",
           429: "Too many attempts", 503: "Database unavailable"}


def _quote(name: str) -> str:
    from urllib.parse import quote

    return quote(name, safe="")


def _id_param(raw: str | None, what: str) -> int | None:
    """A job or event id from request input (None: not given); 400 unless a whole number from
    1 to 2**63 - 1."""
    if raw is None or raw == "":
        return None
    if not raw.isascii() or not raw.isdigit() or not 1 <= int(raw) <= 2**63 - 1:
        raise HTTPException(400, f"{what} must be a whole number from 1 to {2**63 - 1}, got {raw[:40]!r}")
    return int(raw)


def _text_param(raw: str | None, what: str) -> str | None:
    """Text from request input that reaches the database; 400 when PostgreSQL's text cannot
    hold it: a NUL character, or a lone surrogate (no UTF-8 form)."""
    if raw is None:
        return None
    try:
        raw.encode("utf-8")
    except UnicodeEncodeError:
        raise HTTPException(400, f"{what} is not valid text (a lone surrogate)") from None
    if "\x00" in raw:
        raise HTTPException(400, f"{what} holds a NUL character, which no key, topic or consumer can")
    return raw


def _consumer(conn: Connection, name: str, schema: str) -> admin.ConsumerStatus:
    """The consumer ``name`` (its counts), or 404 when the outbox knows no such consumer."""
    for consumer in admin.consumer_statuses(conn, schema=schema):
        if consumer.consumer == name:
            return consumer
    raise HTTPException(404, f"no consumer {name[:200]!r} (no subscription, flow-control row or unfinished job)")


def _action_args(action: str | None, consumer: str | None, job: str | None) -> tuple[str, str, int | None]:
    """An action's name, consumer and job id from request input; 400 for an unknown action, no
    consumer, a bad job id, or a job missing where the action needs one."""
    if action not in ACTIONS:
        raise HTTPException(400, f"unknown action {str(action)[:40]!r}; one of {', '.join(ACTIONS)}")
    consumer = _text_param(consumer, "consumer")
    if not consumer:
        raise HTTPException(400, f"{action} needs a consumer")
    job_id = _id_param(job, "job id")
    _, needs_job, _ = ACTIONS[action]
    if needs_job and job_id is None:
        raise HTTPException(400, f"{action} needs a job id")
    if action in ("pause", "resume") and job_id is not None:
        raise HTTPException(400, f"{action} acts on a consumer, not a job")
    return action, consumer, job_id


def _perform(dash: Dashboard, action: str, consumer: str, job: int | None) -> str:
    """Do ``action`` through :mod:`outbox.admin` and say what changed, in one line. An action
    on a job acts only when the job is one of ``consumer``'s: its statement is scoped to
    both, so a job of another consumer changes nothing, and is then refused (404)."""
    ids = [job] if job is not None else None
    target = f"job {job}" if job is not None else f"consumer {consumer}"
    if action == "cancel":
        with translate_errors(dash.engine.url, dash.schema):
            result = admin.cancel(dash.engine, ids, consumer, schema=dash.schema)
        if result.cancelled:
            return f"cancelled job {job}"
        if result.requested:
            return f"asked running job {job} to stop (it is recorded cancelled when its attempt ends)"
        _check_owner(dash, consumer, job)
        if job in result.unchanged:
            return f"job {job} not cancelled: it is {result.unchanged[job]}"
        return f"job {job} not cancelled: it is not ready, pending or running"
    with dash.connect() as conn:
        if action == "redrive":
            changed = admin.redrive(conn, ids, consumer, schema=dash.schema)
            if changed:
                return f"redriven {len(changed)} job(s) of {consumer}: {changed[:20]}"
            _check_owner(dash, consumer, job, conn)
            return f"nothing redriven: {target} has no dead job"
        if action == "retry":
            changed = admin.retry(conn, ids, consumer, schema=dash.schema)
            if changed:
                return f"due now: {len(changed)} job(s): {changed[:20]}"
            _check_owner(dash, consumer, job, conn)
            return f"nothing made due: {target} has no ready job waiting to be due"
        if action == "pause":
            paused = admin.pause(conn, consumer, schema=dash.schema)
            return f"consumer {consumer} was already paused" if paused.was_paused_at else \
                f"paused consumer {consumer}: no relay claims its jobs until it is resumed"
        resumed = admin.resume(conn, consumer, schema=dash.schema)
        return f"resumed consumer {consumer}" if resumed.was_paused_at else f"consumer {consumer} was not paused"


def _check_owner(dash: Dashboard, consumer: str, job: int | None, conn: Connection | None = None) -> None:
    """404 unless ``job`` (None: no job, nothing to check) is a job of ``consumer``: on the
    confirmation page, and after an action on a job changed nothing (the action's statement
    was scoped to ``consumer``, so a job of another one is untouched)."""
    if job is None:
        return
    if conn is None:
        with dash.connect() as own:
            owner = admin.job_consumer(own, job, schema=dash.schema)
    else:
        owner = admin.job_consumer(conn, job, schema=dash.schema)
    if owner != consumer:
        raise HTTPException(404, f"job {job} is not a job of consumer {consumer[:200]!r}" +
                            ("" if owner is not None else " (no such job, or pruned)"))


def _overview(dash: Dashboard) -> dict[str, Any]:
    with dash.connect() as conn:
        state = admin.status(conn, schema=dash.schema)
        rate = admin.throughput(conn, minutes=CHART_MINUTES, schema=dash.schema)
        relays = admin.relays(conn, schema=dash.schema)
    total = [sum(col) for col in zip(*rate.values())] if rate else [0] * CHART_MINUTES
    return {"state": state, "rate": rate, "total": total, "relays": relays, "minutes": CHART_MINUTES,
            "failure": None, "empty": [0] * CHART_MINUTES}
