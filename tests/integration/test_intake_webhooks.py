"""Webhook intake (Standard Webhooks signatures) on a real uvicorn server and a real
PostgreSQL: a valid request is taken in once and answered after the commit; a bad signature
(401), a replay outside the tolerance (400), a body over the limit (413), a body that is not
JSON (400) write nothing; a retry and concurrent duplicates of one webhook id write one
event; a relay's transactional handler then has one effect per id. ``outbox-relay
intake-http`` serves a registry's webhook intakes as documented."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from outbox import Outbox
from outbox.settings import OutboxSettings
from outbox.testing import wait_for

from .helpers import running_relay
from .intake_helpers import intake_rows

httpx = pytest.importorskip("httpx", reason="httpx is not installed (pip install 'outbox-relay[dev]')")
pytest.importorskip("starlette", reason="starlette is not installed (pip install 'outbox-relay[dashboard]')")

from outbox.intake.webhooks import Webhook  # noqa: E402 (after the skip)

SECRET = "whsec_" + base64.b64encode(b"0123456789abcdef0123456789abcdef").decode()
OTHER = "whsec_" + base64.b64encode(b"another secret of 32 bytes!!!!!!").decode()


@contextlib.contextmanager
def serving(engine: sa.Engine, registry: Outbox) -> Iterator[str]:
    """The registry's webhook intakes served by uvicorn in a thread; yields the base URL."""
    import uvicorn

    from outbox.ops.intake_http import create_app

    app = create_app(engine, registry, OutboxSettings(_env_file=None))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=False, lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, timeout=20, what="the webhook server to start")
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(20)
        sock.close()


def signed(hook: Webhook, webhook_id: str, body: bytes, at: float | None = None) -> dict[str, str]:
    stamp = int(time.time() if at is None else at)
    return {"webhook-id": webhook_id, "webhook-timestamp": str(stamp),
            "webhook-signature": hook.sign(webhook_id, stamp, body), "content-type": "application/json"}


def order(n: int) -> bytes:
    return json.dumps({"type": "order.placed", "data": {"order_id": n}}).encode()


@pytest.fixture
def hook() -> Webhook:
    return Webhook([OTHER, SECRET], max_body_bytes=2000)


def registry(hook: Webhook) -> Outbox:
    ob = Outbox()
    ob.intake("billing", source=hook, topic={"order.placed": "order.placed"})
    return ob


def test_a_signed_webhook_is_taken_in_once_and_handled_once(engine: sa.Engine, settings: Any, hook: Webhook) -> None:
    ob = registry(hook)
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE hook_effects (order_id int PRIMARY KEY, runs int NOT NULL)")

    @ob.subscriber("order.placed", consumer="book", transactional=True)
    def book(job: Any, session: Any) -> None:
        session.execute(sa.text("INSERT INTO hook_effects VALUES (:o, 1) ON CONFLICT (order_id) "
                                "DO UPDATE SET runs = hook_effects.runs + 1"), {"o": job.payload["data"]["order_id"]})

    with serving(engine, ob) as base, httpx.Client(base_url=base) as http:
        first = http.post("/webhooks/billing", content=order(1), headers=signed(hook, "msg_1", order(1)))
        assert first.status_code == 200 and first.json()["status"] == "taken in"
        event_id = first.json()["event_id"]
        retry = http.post("/webhooks/billing", content=order(1), headers=signed(hook, "msg_1", order(1)))
        assert retry.status_code == 200 and retry.json() == {"status": "already taken in"}
        # the other secret signs too (rotation); a sender's traceparent travels with the event
        other = Webhook(OTHER)
        second = http.post("/webhooks/billing", content=order(2),
                           headers={**signed(other, "msg_2", order(2)), "traceparent": f"00-{'a' * 32}-{'b' * 16}-01"})
        assert second.status_code == 200
    with engine.connect() as conn:
        event = conn.execute(sa.text("SELECT topic, payload, headers FROM outbox_events WHERE id = :i"),
                             {"i": event_id}).one()
        traced = conn.execute(sa.text("SELECT headers FROM outbox_events WHERE id = :i"),
                              {"i": second.json()["event_id"]}).scalar_one()
    assert event.topic == "order.placed" and event.payload["data"] == {"order_id": 1}
    assert event.headers["webhook-id"] == "msg_1" and "webhook-signature" not in event.headers
    assert traced["traceparent"] == f"00-{'a' * 32}-{'b' * 16}-01"
    with running_relay(ob, settings(poll_interval=0.2)):
        assert wait_for(lambda: _hook_effects(engine) == {1: 1, 2: 1}, 30)


def _hook_effects(engine: sa.Engine) -> dict[int, int]:
    with engine.connect() as conn:
        return dict(conn.execute(sa.text("SELECT order_id, runs FROM hook_effects")).all())


@pytest.mark.parametrize("case", ["bad signature", "wrong secret", "no signature", "replay", "future", "too large",
                                  "not json", "too deep", "unknown type", "no id", "unknown intake"])
def test_refused_requests_write_nothing(engine: sa.Engine, hook: Webhook, case: str) -> None:
    body = order(3)
    headers = signed(hook, "msg_3", body)
    path = "/webhooks/billing"
    expected = 400
    if case == "bad signature":
        headers["webhook-signature"] = "v1," + base64.b64encode(b"x" * 32).decode()
        expected = 401
    elif case == "wrong secret":
        headers = signed(Webhook("whsec_" + base64.b64encode(b"a third secret, 32 bytes long!!!").decode()),
                         "msg_3", body)
        expected = 401
    elif case == "no signature":
        del headers["webhook-signature"]
        expected = 401
    elif case == "replay":
        headers = signed(hook, "msg_3", body, at=time.time() - 330)
    elif case == "future":
        headers = signed(hook, "msg_3", body, at=time.time() + 330)  # a margin: the server checks a moment later
    elif case == "too large":
        body = json.dumps({"type": "order.placed", "pad": "x" * 3000}).encode()
        headers = signed(hook, "msg_3", body)
        expected = 413
    elif case == "not json":
        body = b"order 3"
        headers = signed(hook, "msg_3", body)
    elif case == "too deep":  # deeper than the JSON parser goes, within the size limit (was a 500)
        hook = Webhook([OTHER, SECRET])
        body = b"[" * 5000 + b"]" * 5000
        headers = signed(hook, "msg_3", body)
    elif case == "unknown type":
        body = json.dumps({"type": "order.refunded"}).encode()
        headers = signed(hook, "msg_3", body)
    elif case == "no id":
        del headers["webhook-id"]
    elif case == "unknown intake":
        path = "/webhooks/nobody"
        expected = 404
    with serving(engine, registry(hook)) as base, httpx.Client(base_url=base) as http:
        answer = http.post(path, content=body, headers=headers)
    assert answer.status_code == expected, answer.text
    with engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM outbox_events").scalar_one() == 0
    assert intake_rows(engine, "billing") == []


def test_each_signature_header_line_counts(engine: sa.Engine, hook: Webhook) -> None:
    """A request with two webhook-signature lines, a stale one and a valid one, is taken in
    (every listed signature may match, as the scheme says)."""
    body = order(6)
    good = signed(hook, "msg_6", body)
    lines = [(k, v) for k, v in good.items() if k != "webhook-signature"]
    lines += [("webhook-signature", "v1," + base64.b64encode(b"x" * 32).decode()),
              ("webhook-signature", good["webhook-signature"])]
    with serving(engine, registry(hook)) as base, httpx.Client(base_url=base) as http:
        answer = http.post("/webhooks/billing", content=body, headers=lines)
    assert answer.status_code == 200 and answer.json()["status"] == "taken in", answer.text


def test_concurrent_duplicates_of_one_id_write_one_event(engine: sa.Engine, hook: Webhook) -> None:
    body = order(4)
    headers = signed(hook, "msg_4", body)
    answers: list[Any] = []
    with serving(engine, registry(hook)) as base:
        def post() -> None:
            with httpx.Client(base_url=base) as http:
                answers.append(http.post("/webhooks/billing", content=body, headers=headers))

        threads = [threading.Thread(target=post) for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    statuses = sorted(a.json()["status"] for a in answers)
    assert [a.status_code for a in answers] == [200] * 16
    assert statuses == ["already taken in"] * 15 + ["taken in"]
    with engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM outbox_events").scalar_one() == 1
    assert len(intake_rows(engine, "billing")) == 1


def test_the_command_serves_the_registrys_webhook_intakes(db_url: sa.URL, engine: sa.Engine,
                                                          tmp_path: Path) -> None:
    """docs/webhooks.md's module, written as billing/hooks.py, served by ``outbox-relay
    intake-http --app billing.hooks:ob`` as the page runs it: a signed request is taken in."""
    from tests import docs_pages

    block = next(b for b in docs_pages.blocks(docs_pages.DOCS / "webhooks.md") if b.language == "python")
    (tmp_path / "billing").mkdir()
    (tmp_path / "billing" / "__init__.py").write_text("")
    (tmp_path / "billing" / "hooks.py").write_text(block.text)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "OUTBOX_DATABASE_URL": db_url.render_as_string(hide_password=False),
           "PYTHONPATH": str(tmp_path), "PAYMENTS_WEBHOOK_SECRET": SECRET}
    process = subprocess.Popen([str(Path(sys.executable).parent / "outbox-relay"), "intake-http", "--app",
                                "billing.hooks:ob", "--port", str(port)], env=env, stderr=subprocess.PIPE, text=True)
    try:
        hook = Webhook(SECRET)
        body = json.dumps({"type": "payment.succeeded", "data": {"order_id": 5}}).encode()

        def up() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200
            except httpx.HTTPError:
                return False

        assert wait_for(up, 30)
        answer = httpx.post(f"http://127.0.0.1:{port}/webhooks/payments", content=body,
                            headers=signed(hook, "msg_5", body))
        assert answer.status_code == 200 and answer.json()["status"] == "taken in"
    finally:
        process.terminate()
        process.wait(20)
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT topic, payload->'data' FROM outbox_events")).one() == (
            "payment.received", {"order_id": 5})
