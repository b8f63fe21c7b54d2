"""``outbox-relay intake-http``: the web server of an application's webhook intakes
(:class:`~outbox.intake.webhooks.Webhook`; Starlette and uvicorn, extra ``[dashboard]``).

Each webhook intake ``name`` of the registry is served at ``POST /webhooks/<name>``; the
module notes of :mod:`outbox.intake.webhooks` say what each answer means. A request's body
is read up to the intake's ``max_body_bytes`` (a larger one is refused with 413 as soon as
it passes the limit, before it is read whole), its signature checked, then it is taken in
exactly as a broker message is (:func:`outbox.intake.taking.take_in`, one transaction, on a
worker thread) and answered after the commit. ``GET /healthz`` answers 200 while the process
runs. Several servers may run behind a load balancer: concurrent retries of one webhook id
write one event whichever server takes them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

from sqlalchemy.engine import Engine

from outbox.errors import ConfigurationError
from outbox.intake import Intake, arrival
from outbox.intake.taking import RacedError, Taken, take_in
from outbox.intake.webhooks import Refused, Webhook
from outbox.registry import Outbox
from outbox.settings import OutboxSettings

log = logging.getLogger(__name__)

#: Tries of one request's transaction when concurrent retries of its id race it.
RACE_TRIES = 5


def webhook_intakes(registry: Outbox) -> dict[str, Intake]:
    """The registry's webhook intakes by name."""
    return {i.name: i for i in registry.intakes if isinstance(i.source, Webhook)}


def create_app(engine: Engine, registry: Outbox, settings: OutboxSettings) -> Any:
    """The Starlette application serving ``registry``'s webhook intakes on ``engine``.
    Raises :class:`ConfigurationError` when the registry declares none."""
    from starlette.applications import Starlette  # noqa: PLC0415 (an optional dependency)
    from starlette.requests import ClientDisconnect, Request  # noqa: PLC0415
    from starlette.responses import JSONResponse, PlainTextResponse, Response  # noqa: PLC0415
    from starlette.routing import Route  # noqa: PLC0415

    hooks = webhook_intakes(registry)
    if not hooks:
        raise ConfigurationError("intake-http: the registry declares no webhook intake "
                                 "(ob.intake(name, source=Webhook(secret=...), ...))")
    schema = settings.schema_name

    async def receive(request: Request) -> Response:
        name = request.path_params["name"]
        intake = hooks.get(name)
        if intake is None:
            return PlainTextResponse("no such webhook intake", 404)
        source = intake.source
        assert isinstance(source, Webhook)
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > source.max_body_bytes:
            return PlainTextResponse(f"body over {source.max_body_bytes} bytes", 413)
        body = bytearray()
        try:
            async for chunk in request.stream():
                body += chunk
                if len(body) > source.max_body_bytes:
                    return PlainTextResponse(f"body over {source.max_body_bytes} bytes", 413)
        except ClientDisconnect:
            return Response(status_code=400)
        try:
            headers = {k.lower(): v for k, v in request.headers.items()}
            if "webhook-signature" in headers:  # every signature of every such header line may match
                headers["webhook-signature"] = " ".join(request.headers.getlist("webhook-signature"))
            received = source.verify(headers, bytes(body), time.time())
        except Refused as refused:
            log.info("webhook %s refused (%d): %s", name, refused.status, refused.reason)
            return PlainTextResponse(refused.reason, refused.status)
        item = arrival(intake, dataclasses.replace(received, subject=received.subject or intake.name))
        if item.event is None:
            return PlainTextResponse(item.problem or "not an event", 400)
        try:
            taken = await asyncio.to_thread(_take, engine, intake, item, schema)
        except Exception as exc:  # noqa: BLE001 - the database: the sender retries later
            log.warning("webhook %s: not taken in (%s: %s); answered 503", name, type(exc).__name__, exc)
            return PlainTextResponse("database unavailable; retry later", 503)
        event_id = taken.events.get(item.identity)
        if event_id is None:
            return JSONResponse({"status": "already taken in"})
        return JSONResponse({"status": "taken in", "event_id": event_id})

    async def healthz(request: Request) -> Response:
        return PlainTextResponse("ok")

    return Starlette(routes=[Route("/webhooks/{name}", receive, methods=["POST"]),
                             Route("/healthz", healthz, methods=["GET"])])


def _take(engine: Engine, intake: Intake, item: Any, schema: str) -> Taken:
    for _ in range(RACE_TRIES - 1):
        try:
            with engine.begin() as conn:
                return take_in(conn, intake.name, [item], schema=schema)
        except RacedError:
            continue
    with engine.begin() as conn:
        return take_in(conn, intake.name, [item], schema=schema)


def serve(registry: Outbox, settings: OutboxSettings, *, host: str = "127.0.0.1", port: int = 8080) -> int:
    """Serve ``registry``'s webhook intakes on ``host``:``port`` until interrupted; returns
    0 after a clean stop. Raises :class:`ConfigurationError` when no database is configured,
    the registry declares no webhook intake, or the address cannot be bound."""
    from outbox.db.engine import make_engine, redact  # noqa: PLC0415
    from outbox.ops.dashboard import listen, serve_app  # noqa: PLC0415
    from outbox.ops.dashboard.auth import bind_address  # noqa: PLC0415

    url = settings.url()
    if url is None:
        raise ConfigurationError("no database configured: set OUTBOX_DATABASE_URL or pass --database-url")
    engine = make_engine(url, pool_size=8, application_name="outbox-intake-http")
    app = create_app(engine, registry, settings)
    sock = listen(host, port)
    address = bind_address(host)
    log.info("intake-http on http://%s:%d for %s, schema %s: %s", f"[{address}]" if ":" in address else address,
             port, redact(url), settings.schema_name,
             ", ".join(f"POST /webhooks/{name}" for name in webhook_intakes(registry)))
    try:
        serve_app(app, sock, address, port)
    finally:
        engine.dispose()
    return 0
