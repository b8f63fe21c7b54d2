"""The intake without a broker, on a real PostgreSQL: ``outbox-relay intake rejected`` and
``intake forget`` (rejected messages listed with their reason and first bytes, as text and
JSON, forgotten by identity or all of an intake, after which a redelivery is taken in
again), and the lease of an ordered intake's lock."""

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


def test_an_ordered_intakes_lock_is_leased_a_silent_holder_loses_it(engine: sa.Engine, settings: object) -> None:
    """The lock session of an ordered intake ends when its holder stops pinging it for a lease
    (idle_session_timeout): a standby takes the lock, and the old holder's next take-in finds
    the lock gone and commits nothing."""
    import threading
    import time

    from outbox.intake.taking import LockLostError
    from outbox.relay.intake import IntakeLoop
    from outbox.relay.reconnect import Reconnector

    intake = Outbox().intake("hooks", source=Webhook(SECRET), topic="t")
    loop = IntakeLoop(engine, [], settings(default_lease=1.0), stop=threading.Event(),  # type: ignore[operator]
                      reconnect=Reconnector(1.0))
    holder = loop._try_lock(intake)
    assert holder is not None and loop._try_lock(intake) is None  # held: a standby waits
    for _ in range(4):  # a live holder pings every lease/3 and keeps it
        time.sleep(0.33)
        assert holder.ping()
    assert loop._try_lock(intake) is None
    time.sleep(1.8)  # silent for more than the lease (a SIGSTOPped relay)
    standby = loop._try_lock(intake)
    assert standby is not None and not holder.ping()
    message = Received(body=b"{}", headers={}, subject="s", message_id="m1")
    with pytest.raises(LockLostError), engine.begin() as conn:
        take_in(conn, "hooks", [arrival(intake, message)], lock_pid=holder.pid)
    with engine.begin() as conn:
        assert take_in(conn, "hooks", [arrival(intake, message)], lock_pid=standby.pid).events
    holder.release()
    standby.release()


def test_rejections_of_hostile_messages_are_stored_and_listed_printably(db_url: sa.URL, engine: sa.Engine,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """NULs and lone surrogates in a rejected message's subject, headers and reason are
    stored escaped (PostgreSQL's text refuses them as they are); control characters in an
    identity are escaped in the listing, so a sender cannot forge a line of it."""
    intake = Outbox().intake("hooks", source=Webhook(SECRET), topic="t")
    hostile = Received(body=b'{"a": 1}', headers={"x-\x00": "v\x00", "y": "\udc80", "Outbox-Key": "k\x00"},
                       subject="s\x00", message_id="id\n2026-01-01  hooks  forged\x1b[2J")
    _take(engine, intake, hostile)
    with engine.connect() as conn:
        row = conn.execute(sa.text("SELECT subject, headers, problem FROM outbox_intake")).one()
    assert row.subject == "s\\u0000" and row.headers["x-\\u0000"] == "v\\u0000" and row.headers["y"] == "\\udc80"
    assert "not a valid event" in row.problem
    assert main(["intake", "rejected", *_url(db_url)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "id\\n2026-01-01  hooks  forged\\x1b[2J" in out
    assert len([line for line in out.splitlines() if "hooks" in line]) == 1
