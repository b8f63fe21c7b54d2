"""Schedules: periodic events declared with :meth:`outbox.Outbox.periodic`, published by the relays.

A schedule is a cron expression in an explicit time zone, a topic and a payload. Its
*slots* are the instants the expression names (computed by croniter, an optional
dependency: ``pip install 'outbox-relay[cron]'``); at each slot one event is published on
the topic, and subscribers of the topic get their jobs as for any event.

Exactly once per slot, however many relays run: every relay whose registry declares the
schedule writes its row of ``outbox_schedules`` at start (``schedule_upsert_many``) and runs
a scheduler thread. The row's ``next_slot`` is the slot the schedulers wait for. When it is
due by the database clock, a scheduler computes the slots to publish and, in one
transaction, moves ``next_slot`` forward with a compare-and-set (``schedule_advance``:
``WHERE name = ... AND next_slot = <the value it read>``) and publishes their events. The
first relay's update locks the row; another relay's identical update waits for that commit,
then finds ``next_slot`` changed and updates nothing (row count 0): it publishes nothing. A
relay that dies between the two statements rolls both back, and another relay publishes
the slot. Each event also carries ``dedup_key = "periodic:<name>:<slot>"`` (the slot in UTC,
ISO 8601), so even a slot published twice through a hand-edited row writes one event while
the first is retained. The event's headers say ``{"schedule": name, "slot": iso}``.

Missed slots: slots that came due while no scheduler ran (all relays down, or one so late
that several slots passed). By default (``catch_up=False``) only the latest due slot is
published, once: a relay back after an hour of a five-minute schedule publishes one event,
for the slot a few minutes ago, not twelve. With ``catch_up=True`` every missed slot is
published, oldest first, at most ``CATCH_UP_LIMIT`` of them (the latest ones; older ones
are skipped with a warning).

Time: "now" is always the database's (``now()``, read with the schedules), never the
relay's clock; the scheduler sleeps for the database-clock distance to the next slot (at
most ``SCHEDULER_MAX_SLEEP`` seconds, so a schedule another relay advanced or changed is
seen again soon), and is woken early on stop. A new schedule starts at its first slot
after the moment it is first written; changing a schedule's cron expression or time zone
restarts it the same way, changing only its topic or ``catch_up`` keeps its next slot.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError

from .db import queries
from .errors import ConfigurationError, InvalidEventError
from .publish import check_name, make_event, publish_many
from .reconnect import Reconnector

log = logging.getLogger("outbox.schedule")

#: Most missed slots a ``catch_up=True`` schedule publishes in one go (the latest ones).
CATCH_UP_LIMIT = 1000
#: Longest sleep of the scheduler between two looks at the schedules, seconds.
SCHEDULER_MAX_SLEEP = 30.0
#: Longest schedule name, characters: keeps ``periodic:<name>:<slot>`` within a dedup key.
MAX_SCHEDULE_NAME_LENGTH = 200
#: Prefix of a scheduled event's dedup key.
DEDUP_PREFIX = "periodic:"


def _croniter() -> Any:
    try:
        from croniter import croniter  # type: ignore[import-untyped]  # croniter ships no type hints
    except ImportError:
        raise ConfigurationError("schedules need croniter, an optional dependency of outbox: "
                                 "pip install 'outbox-relay[cron]'") from None
    return croniter


@dataclass(frozen=True, slots=True)
class Schedule:
    """One declared schedule: at every slot of ``cron`` (in time zone ``timezone``, an IANA
    name), publish ``payload`` on ``topic``. ``name`` identifies it in ``outbox_schedules``
    and in its events' dedup keys; ``catch_up`` says whether missed slots are published."""

    name: str
    cron: str
    topic: str
    payload: Any
    timezone: str
    catch_up: bool

    def _zone(self) -> ZoneInfo:
        return ZoneInfo(self.timezone)

    def next_after(self, instant: datetime) -> datetime:
        """The first slot strictly after ``instant`` (aware), in UTC."""
        start = instant.astimezone(self._zone())
        slot: datetime = _croniter()(self.cron, start).get_next(datetime)
        return slot.astimezone(UTC)

    def latest_at(self, instant: datetime) -> datetime:
        """The last slot at or before ``instant`` (aware), in UTC."""
        start = (instant + timedelta(microseconds=1)).astimezone(self._zone())
        slot: datetime = _croniter()(self.cron, start).get_prev(datetime)
        return slot.astimezone(UTC)

    def due(self, next_slot: datetime, now: datetime) -> list[datetime]:
        """The slots to publish when ``next_slot`` is due at ``now``, oldest first: the latest
        slot at or before ``now`` only, or with ``catch_up`` every slot from ``next_slot`` to
        ``now`` (at most ``CATCH_UP_LIMIT``, the latest). Empty when ``next_slot`` is later."""
        if next_slot > now:
            return []
        latest = max(self.latest_at(now), next_slot)
        if not self.catch_up:
            return [latest]
        slots = [latest]
        iterator = _croniter()(self.cron, latest.astimezone(self._zone()))
        while len(slots) < CATCH_UP_LIMIT:
            earlier = iterator.get_prev(datetime).astimezone(UTC)
            if earlier < next_slot:
                break
            slots.append(earlier)
        else:
            if iterator.get_prev(datetime).astimezone(UTC) >= next_slot:
                log.warning("schedule %s: more than %d slots missed since %s; publishing the latest %d",
                            self.name, CATCH_UP_LIMIT, next_slot.isoformat(), CATCH_UP_LIMIT)
        slots.reverse()
        return slots

    def dedup_key(self, slot: datetime) -> str:
        """``periodic:<name>:<slot in UTC, ISO 8601>``: the dedup key of the slot's event."""
        return f"{DEDUP_PREFIX}{self.name}:{slot.astimezone(UTC).isoformat()}"


def make_schedule(cron: Any, *, topic: Any, payload: Any, name: Any, timezone: Any, catch_up: Any) -> Schedule:
    """A validated :class:`Schedule`. ``cron``: 5 fields (minute hour day month weekday) or
    6 (the 6th is seconds), croniter's syntax. ``timezone``: an IANA name (``"UTC"``,
    ``"Europe/Paris"``) or a ``zoneinfo.ZoneInfo``; slots are wall-clock times there.
    ``payload``: JSON, by the rules of :func:`outbox.publish`. ``name``: 1 to 200
    characters. Raises :class:`ConfigurationError` naming what is wrong, or when croniter
    is not installed."""
    croniter = _croniter()
    try:
        check_name(topic, "topic")
        check_name(name, "name", MAX_SCHEDULE_NAME_LENGTH)
        make_event(topic, payload)
    except InvalidEventError as exc:
        raise ConfigurationError(f"schedule {name!r}: {exc}") from None
    # croniter reads a 7th field as a year, which the docs do not promise: 5 or 6 only.
    if not isinstance(cron, str) or len(cron.split()) not in (5, 6) or not croniter.is_valid(cron):
        raise ConfigurationError(f"schedule {name!r}: {cron!r} is not a valid cron expression (5 fields: "
                                 "minute hour day-of-month month day-of-week, or a 6th for seconds)")
    if isinstance(timezone, ZoneInfo):
        zone_name = timezone.key
    elif isinstance(timezone, str):
        zone_name = timezone
    else:
        raise ConfigurationError(f"schedule {name!r}: timezone must be an IANA name such as 'UTC' or "
                                 f"'Europe/Paris', or a zoneinfo.ZoneInfo, got {type(timezone).__name__}")
    try:
        ZoneInfo(zone_name)
    except (ZoneInfoNotFoundError, ValueError):
        raise ConfigurationError(f"schedule {name!r}: unknown time zone {zone_name!r} (an IANA name such as "
                                 "'Europe/Paris')") from None
    if type(catch_up) is not bool:
        raise ConfigurationError(f"schedule {name!r}: catch_up must be True or False, got {catch_up!r}")
    schedule = Schedule(name, cron, topic, payload, zone_name, catch_up)
    try:
        schedule.next_after(datetime.now(ZoneInfo("UTC")))  # fails here, not in the relay
    except Exception as exc:  # noqa: BLE001 - croniter's errors for expressions that never fire
        raise ConfigurationError(f"schedule {name!r}: {cron!r} names no future time ({exc})") from None
    return schedule


def register_schedules(engine: Engine, schedules: Sequence[Schedule], schema: str | None = None) -> None:
    """Write ``schedules`` to ``outbox_schedules`` of ``schema`` (None: ``OUTBOX_SCHEMA`` or
    ``public``): a new one starts at its first slot after the database's now; an existing one
    keeps its next slot unless its cron expression or time zone changed (logged)."""
    if not schedules:
        return
    statements = queries.in_schema(schema)
    with engine.begin() as conn:
        now = conn.execute(statements.database_now).scalar_one()
        changed = conn.execute(statements.schedule_upsert_many, {
            "names": [s.name for s in schedules], "crons": [s.cron for s in schedules],
            "timezones": [s.timezone for s in schedules], "topics": [s.topic for s in schedules],
            "catch_ups": [s.catch_up for s in schedules], "next_slots": [s.next_after(now) for s in schedules],
        }).all()
    for row in changed:
        if row.updated:
            log.warning("schedule %s now has this registry's definition (cron %r, timezone %s, topic %s, "
                        "catch_up=%s; next slot %s); another registry declaring it differently would "
                        "overwrite it the same way", row.name, row.cron, row.timezone, row.topic, row.catch_up,
                        row.next_slot.isoformat())


class Scheduler:
    """Publishes the due slots of ``schedules`` (module notes): :meth:`run_due` is one pass,
    :meth:`run` the relay's loop until ``stop`` is set. Database errors in the loop are
    logged and retried through ``reconnect``; a slot is never published twice, and one
    missed while the database was unreachable is treated as any missed slot. ``schema``: the
    schema of outbox's tables (None: ``OUTBOX_SCHEMA`` or ``public``)."""

    def __init__(self, engine: Engine, schedules: Sequence[Schedule], stop: threading.Event,
                 reconnect: Reconnector | None = None, schema: str | None = None) -> None:
        self.engine = engine
        self.statements = queries.in_schema(schema)
        self.schedules = {s.name: s for s in schedules}
        self.stop = stop
        self.reconnect = reconnect or Reconnector(10.0)
        self.published = 0  # events published by this scheduler
        self._differs: set[tuple[str, str, str]] = set()  # (name, cron, timezone) of rows warned about

    def run_due(self) -> float:
        """Publish every due slot of this scheduler's schedules, one transaction per schedule;
        returns the seconds (database clock) until the next slot of any of them."""
        with self.engine.connect() as conn:
            rows = conn.execute(self.statements.schedule_due_list, {"names": list(self.schedules)}).all()
            conn.rollback()
        if not rows:
            return SCHEDULER_MAX_SLEEP
        now = rows[0].now
        upcoming: list[datetime] = []
        for row in rows:
            schedule = self.schedules[row.name]
            if (row.cron, row.timezone) != (schedule.cron, schedule.timezone):
                # Another registry (a rolling deploy's other version) declared it since: its
                # relays own it now; slots of this definition would interleave with theirs.
                if (row.name, row.cron, row.timezone) not in self._differs:
                    self._differs.add((row.name, row.cron, row.timezone))
                    log.warning("schedule %s: the database has cron %r (timezone %s) from another registry, this "
                                "relay declares %r (%s); it publishes nothing for it until they agree (restart it "
                                "with the new definition)", row.name, row.cron, row.timezone, schedule.cron,
                                schedule.timezone)
                continue
            slots = schedule.due(row.next_slot, now)
            if not slots:
                upcoming.append(row.next_slot)
                continue
            following = schedule.next_after(slots[-1])
            with self.engine.begin() as conn:
                owned = conn.execute(self.statements.schedule_advance, {
                    "name": schedule.name, "expected": row.next_slot, "last_slot": slots[-1],
                    "next_slot": following, "cron": schedule.cron, "timezone": schedule.timezone}).rowcount
                if owned == 1:
                    publish_many(conn, [{"topic": schedule.topic, "payload": schedule.payload,
                                         "headers": {"schedule": schedule.name, "slot": slot.isoformat()},
                                         "dedup_key": schedule.dedup_key(slot)} for slot in slots],
                                 schema=self.statements.schema)
            if owned == 1:
                self.published += len(slots)
                log.info("schedule %s: published slot%s %s", schedule.name, "s" if len(slots) > 1 else "",
                         ", ".join(s.isoformat() for s in slots[-3:]) + (" ..." if len(slots) > 3 else ""))
            upcoming.append(following)
        if not upcoming:  # every schedule here is another registry's now
            return SCHEDULER_MAX_SLEEP
        return max(0.0, float((min(upcoming) - now).total_seconds()))

    def run(self) -> None:
        """Loop until ``stop`` is set: run the due slots, then sleep until the next slot (at
        most ``SCHEDULER_MAX_SLEEP`` seconds)."""
        failures = 0
        while not self.stop.is_set():
            try:
                wait = self.run_due()
                failures = self.reconnect.recovered(failures, "scheduler")
            except DBAPIError as exc:
                failures = self.reconnect.backoff(failures, "scheduler", exc, self.stop)
                continue
            # A few milliseconds past the slot, so the database clock has reached it on waking.
            self.stop.wait(min(SCHEDULER_MAX_SLEEP, wait + 0.005))
