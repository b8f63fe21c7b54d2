"""``outbox-relay intake rejected`` and ``intake forget`` on a real PostgreSQL: rejected
messages listed with their reason and first bytes (text and JSON), forgotten by identity or
all of an intake, after which a redelivery is taken in again."""

from __future__ import annotations

import base64
import json

import pytest
import sqlalchemy as sa

from outbox import Outbox
from outbox.intake import Received, arrival
from outbox.intake.taking import take_in
from outbox.intake.webhooks import Webhook
from outbox.ops.cli import main

SECRET = "whsec_" + base64.b64encode(b"k" * 24).decode()


def _url(db_url: sa.URL) -> list[str]:
    return ["--database-url", db_url.render_as_string(hide_password=False)]


def _take(engine: sa.Engine, intake: object, *messages: Received) -> None:
    with engine.begin() as conn:
        take_in(conn, "hooks", [arrival(intake, m) for m in messages])  # type: ignore[arg-type]


def test_rejected_messages_are_listed_and_forgotten(db_url: sa.URL, engine: sa.Engine,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    intake = Outbox().intake("hooks", source=Webhook(SECRET), topic="t")
    poison = [Received(body=b"\xffbad " + bytes([i]), headers={"h": "v"}, subject="s", message_id=f"p{i}")
              for i in range(3)]
    _take(engine, intake, *poison, Received(body=b"{}", headers={}, subject="s", message_id="good"))
    assert main(["intake", "rejected", *_url(db_url)]) == 0
    out = capsys.readouterr().out
    assert out.count("not UTF-8 JSON") == 3 and "hooks  p1" in out and "good" not in out
    assert main(["intake", "rejected", "hooks", "--json", "--limit", "1", *_url(db_url)]) == 0
    line = json.loads(capsys.readouterr().out)
    assert base64.b64decode(line["body_base64"]).startswith(b"\xffbad") and line["headers"] == {"h": "v"}
    assert main(["intake", "forget", "hooks", "p0", *_url(db_url)]) == 0
    assert "forgot 1 rejected message of hooks" in capsys.readouterr().out
    assert main(["intake", "forget", "hooks", "p0", *_url(db_url)]) == 1  # nothing matched
    assert main(["intake", "forget", "hooks", *_url(db_url)]) == 0
    assert "forgot 2 rejected messages" in capsys.readouterr().out
    assert main(["intake", "rejected", *_url(db_url)]) == 0
    assert "no rejected messages" in capsys.readouterr().out
    # forgotten: delivered again (fixed by the sender), it is taken in
    _take(engine, intake, Received(body=b'{"fixed": 1}', headers={}, subject="s", message_id="p0"))
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM outbox_intake WHERE identity = 'p0' AND event_id IS NOT NULL")
                            ).scalar_one() == 1


def test_forget_needs_the_intakes_name(db_url: sa.URL, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["intake", "forget", *_url(db_url)]) == 2
    assert "name the intake" in capsys.readouterr().err
