"""Schedule declarations (``Outbox.periodic``) and slot arithmetic, without a database:
bad declarations are refused when made, naming the problem; which slots are due after a
gap, with and without ``catch_up``."""

from __future__ import annotations

import sys
from datetime import UTC, datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest

from outbox import ConfigurationError, Outbox
from outbox.schedule import CATCH_UP_LIMIT, make_schedule

UTC = UTC


def test_periodic_declares_and_may_subscribe_a_handler():
    ob = Outbox()
    ob.periodic("*/5 * * * *", topic="report.due", payload={"kind": "hourly"}, name="reports")

    @ob.periodic("0 2 * * *", topic="nightly", timezone="Europe/Paris", catch_up=True, max_attempts=3)
    def nightly(job) -> None: ...

    assert nightly.__name__ == "nightly"  # returned unchanged
    assert [(s.name, s.cron, s.topic, s.payload, s.timezone, s.catch_up) for s in ob.schedules] == [
        ("reports", "*/5 * * * *", "report.due", {"kind": "hourly"}, "UTC", False),
        ("nightly", "0 2 * * *", "nightly", {}, "Europe/Paris", True)]
    assert ob.consumers == ["nightly"]  # only the decorated one subscribes, named after the schedule
    assert ob["nightly"].topics == ("nightly",) and ob["nightly"].max_attempts == 3


def test_periodic_takes_a_zoneinfo_and_a_seconds_field():
    ob = Outbox()
    ob.periodic("*/2 * * * * *", topic="tick", timezone=ZoneInfo("Asia/Tokyo"))
    assert ob.schedules[0].timezone == "Asia/Tokyo"


@pytest.mark.parametrize("cron, options, problem", [
    ("61 * * * *", {}, "not a valid cron expression"),
    ("every day", {}, "not a valid cron expression"),
    ("* * * * * * 2027", {}, "not a valid cron expression"),  # croniter would read a year
    (5, {}, "not a valid cron expression"),
    ("* * * * *", {"timezone": "Mars/Olympus"}, "unknown time zone 'Mars/Olympus'"),
    ("* * * * *", {"timezone": "../etc/passwd"}, "unknown time zone"),
    ("* * * * *", {"timezone": timezone(timedelta(hours=2))}, "timezone must be an IANA name"),
    ("* * * * *", {"payload": {1, 2}}, "payload: set is not JSON-serialisable"),
    ("* * * * *", {"name": ""}, "name: must not be empty"),
    ("* * * * *", {"name": "n" * 201}, "the limit is 200"),
    ("* * * * *", {"topic": ""}, "topic: must not be empty"),
    ("* * * * *", {"catch_up": 1}, "catch_up must be True or False"),
    ("* * * * *", {"consumers": "x"}, "unknown options"),
])
def test_bad_declarations_are_refused(cron, options, problem):
    ob = Outbox()
    with pytest.raises(ConfigurationError, match=problem):
        ob.periodic(cron, **{"topic": "t", **options})
    assert ob.schedules == []


def test_a_name_is_declared_once():
    ob = Outbox()
    ob.periodic("* * * * *", topic="t")
    with pytest.raises(ConfigurationError, match="declared twice; pass name="):
        ob.periodic("*/2 * * * *", topic="t")
    ob.periodic("*/2 * * * *", topic="t", name="t2")
    assert [s.name for s in ob.schedules] == ["t", "t2"]


def test_without_croniter_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "croniter", None)  # import croniter raises ImportError
    with pytest.raises(ConfigurationError, match=r"pip install 'outbox-relay\[cron\]'"):
        Outbox().periodic("* * * * *", topic="t")


def schedule(cron: str, catch_up: bool = False, tz: str = "UTC"):
    return make_schedule(cron, topic="t", payload={}, name="s", timezone=tz, catch_up=catch_up)


def at(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


def test_due_slots_after_a_gap():
    five = schedule("*/5 * * * *")
    assert five.due(at("2026-01-01 12:05"), at("2026-01-01 12:04:59")) == []
    assert five.due(at("2026-01-01 12:05"), at("2026-01-01 12:05")) == [at("2026-01-01 12:05")]
    # three hours without a relay: the latest slot only, by default
    assert five.due(at("2026-01-01 09:00"), at("2026-01-01 12:07:30")) == [at("2026-01-01 12:05")]
    caught = schedule("*/5 * * * *", catch_up=True).due(at("2026-01-01 11:50"), at("2026-01-01 12:07:30"))
    assert caught == [at("2026-01-01 11:50"), at("2026-01-01 11:55"), at("2026-01-01 12:00"), at("2026-01-01 12:05")]
    assert five.next_after(at("2026-01-01 12:05")) == at("2026-01-01 12:10")


def test_catch_up_is_bounded_to_the_latest_slots():
    every_second = schedule("* * * * * *", catch_up=True)
    slots = every_second.due(at("2026-01-01 00:00"), at("2026-01-02 00:00"))
    assert len(slots) == CATCH_UP_LIMIT
    assert slots[-1] == at("2026-01-02 00:00") and slots[0] == at("2026-01-02 00:00") - timedelta(seconds=999)


def test_slots_are_wall_clock_times_of_the_time_zone():
    paris = schedule("0 9 * * *", tz="Europe/Paris")
    assert paris.next_after(at("2026-01-15 00:00")) == at("2026-01-15 08:00")  # UTC+1 in winter
    assert paris.next_after(at("2026-07-15 00:00")) == at("2026-07-15 07:00")  # UTC+2 in summer
    assert paris.dedup_key(at("2026-07-15 07:00")) == "periodic:s:2026-07-15T07:00:00+00:00"
