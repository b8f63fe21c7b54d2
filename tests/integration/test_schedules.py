"""Schedules on a real PostgreSQL, with in-process relays: every slot published exactly once
by three relays; after an outage of three slots, one event (no burst) by default and every
missed slot with ``catch_up=True``; the schedules in ``outbox-relay status``; a changed cron
expression restarts the schedule."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import pytest
import sqlalchemy as sa

from outbox import Outbox
from outbox.ops.cli import main
from outbox.relay.relay import Relay
from outbox.relay.scheduler import register_schedules
from outbox.settings import OutboxSettings
from outbox.testing import wait_for

from .helpers import running_relays

EVERY_SECOND = "* * * * * *"  # croniter: a 6th field is seconds


def scheduled(engine: sa.Engine) -> list[dict[str, Any]]:
    """The scheduled events, oldest slot first: slot, dedup key, created_at (its transaction's start)."""
    with engine.connect() as c:
        rows = c.execute(sa.text(
            "SELECT headers->>'slot' AS slot, dedup_key, created_at, payload FROM outbox_events"
            " WHERE headers ? 'schedule' ORDER BY headers->>'slot'")).mappings().all()
    return [{**r, "slot": datetime.fromisoformat(r["slot"])} for r in rows]


def db_now(engine: sa.Engine) -> datetime:
    with engine.connect() as c:
        return c.execute(sa.text("SELECT now()")).scalar_one()


@contextmanager
def relays(ob: Outbox, settings: Callable[..., OutboxSettings], n: int) -> Iterator[list[Relay]]:
    """``n`` relays running only their schedulers (no routing, workers or maintenance)."""
    with running_relays(n, ob, settings(listen=False), route=False, work=False, maintain=False) as running:
        yield running


def test_three_relays_publish_each_slot_exactly_once(engine, settings):
    ob = Outbox()
    ob.periodic(EVERY_SECOND, topic="tick", payload={"k": "v"}, name="ticks", catch_up=True)
    with relays(ob, settings, 3) as running:
        wait_for(lambda: len(scheduled(engine)) >= 5, timeout=30, what="five slots")
    events = scheduled(engine)
    slots = [e["slot"] for e in events]
    assert len(set(slots)) == len(slots)  # each slot once
    assert slots == [slots[0] + timedelta(seconds=i) for i in range(len(slots))]  # and none skipped
    assert [e["dedup_key"] for e in events] == [f"periodic:ticks:{s.isoformat()}" for s in slots]
    assert all(e["payload"] == {"k": "v"} for e in events)
    # Each slot was published by one relay's compare-and-set, not written twice and deduplicated.
    assert sum(r.scheduler.published for r in running) == len(events)
    assert sum(1 for r in running if r.scheduler.published) >= 1
    with engine.connect() as c:
        last_slot = c.execute(sa.text("SELECT last_slot FROM outbox_schedules WHERE name = 'ticks'")).scalar_one()
    assert last_slot == slots[-1]


@pytest.mark.parametrize("catch_up", [False, True])
def test_after_a_three_slot_outage(engine, settings, catch_up):
    ob = Outbox()
    ob.periodic(EVERY_SECOND, topic="tick", name="ticks", catch_up=catch_up)
    with relays(ob, settings, 1):
        wait_for(lambda: len(scheduled(engine)) >= 2, timeout=30, what="two slots")
    before = scheduled(engine)
    last_before = before[-1]["slot"]
    # No relay runs for more than three slots, by the database clock.
    wait_for(lambda: db_now(engine) >= last_before + timedelta(seconds=4.2), timeout=30, what="three missed slots")
    with relays(ob, settings, 1):
        wait_for(lambda: len(scheduled(engine)) >= len(before) + (4 if catch_up else 2), timeout=30,
                 what="slots after the outage")
    after = scheduled(engine)[len(before):]
    first_pass = [e for e in after if e["created_at"] == after[0]["created_at"]]  # one transaction
    missed = [e for e in after if e["slot"] < after[0]["created_at"] - timedelta(seconds=1)]
    if catch_up:
        slots = [e["slot"] for e in scheduled(engine)]
        assert slots == [slots[0] + timedelta(seconds=i) for i in range(len(slots))]  # nothing skipped
        assert len(first_pass) >= 4 and len(missed) >= 3  # the missed slots, at once, oldest first
    else:
        assert len(first_pass) == 1  # no burst
        assert after[0]["slot"] - last_before >= timedelta(seconds=4)  # the missed ones skipped
        assert missed == []


def test_status_lists_the_schedules(engine, settings, db_url, capsys):
    ob = Outbox()
    ob.periodic(EVERY_SECOND, topic="tick", name="ticks")
    ob.periodic("0 9 * * 1", topic="weekly", name="weekly", timezone="Europe/Paris", catch_up=True)
    with relays(ob, settings, 1):
        wait_for(lambda: len(scheduled(engine)) >= 1, timeout=30, what="a slot")
    assert main(["status", "--database-url", db_url.render_as_string(hide_password=False)]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith(("ticks", "weekly"))}
    last = scheduled(engine)[-1]["slot"]
    assert "* * * * * *" in lines["ticks"] and last.isoformat() in lines["ticks"]
    weekly = lines["weekly"].split()  # name, the cron's 5 fields, timezone, last slot, next slot, (catch_up)
    assert weekly[6:8] == ["Europe/Paris", "-"] and weekly[9] == "(catch_up)"
    next_slot = datetime.fromisoformat(weekly[8]).astimezone(ZoneInfo("Europe/Paris"))
    assert (next_slot.weekday(), next_slot.hour, next_slot.minute) == (0, 9, 0)  # a Monday, 09:00 in Paris


def test_a_changed_cron_expression_restarts_the_schedule(engine):
    ob = Outbox()
    ob.periodic("0 0 1 1 *", topic="t", name="s")
    register_schedules(engine, ob.schedules)
    with engine.connect() as c:
        first = c.execute(sa.text("SELECT next_slot FROM outbox_schedules")).scalar_one()
    register_schedules(engine, ob.schedules)  # unchanged: kept
    changed = Outbox()
    changed.periodic("*/5 * * * *", topic="t", name="s")
    with engine.connect() as c:
        assert c.execute(sa.text("SELECT next_slot FROM outbox_schedules")).scalar_one() == first
    register_schedules(engine, changed.schedules)
    with engine.connect() as c:
        restarted = c.execute(sa.text("SELECT next_slot, now() AS now FROM outbox_schedules")).one()
    assert restarted.next_slot != first and restarted.next_slot - restarted.now <= timedelta(minutes=5)


def test_relays_of_an_older_definition_publish_nothing_once_a_newer_one_is_registered(engine, settings, caplog):
    """A rolling deploy: relays with the old cron keep running while one with the new cron
    starts. The row then has the new definition; the old relays publish nothing for it (and
    say so once) instead of interleaving slots of both expressions."""
    old, new = Outbox(), Outbox()
    old.periodic(EVERY_SECOND, topic="tick", name="tick", payload={"cron": "old"})
    new.periodic("* * * * * */2", topic="tick", name="tick", payload={"cron": "new"})
    with relays(old, settings, 2) as running:
        wait_for(lambda: len(scheduled(engine)) >= 2, 20, what="the old relays publish")
        with relays(new, settings, 1):
            started = db_now(engine)
            wait_for(lambda: sum(e["slot"] > started + timedelta(seconds=1) for e in scheduled(engine)) >= 3, 30,
                     what="the new relay publishes three slots")
        assert sum(r.scheduler.published for r in running) >= 2
    later = [e for e in scheduled(engine) if e["slot"] > started + timedelta(seconds=1)]
    assert [e["payload"]["cron"] for e in later] == ["new"] * len(later)
    assert all(e["slot"].second % 2 == 0 for e in later), [e["slot"] for e in later]
    assert "from another registry" in caplog.text
