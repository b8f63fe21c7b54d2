"""Schedules: periodic events declared with :meth:`outbox.Outbox.periodic`, published by the relays.

A schedule is a cron expression in an explicit time zone, a topic and a payload. Its
*slots* are the instants the expression names (computed by croniter, an optional
dependency: ``pip install 'outbox-relay[cron]'``); at each slot one event is published on
the topic, and subscribers of the topic get their jobs as for any event.

Missed slots: slots that came due while no scheduler ran (all relays down, or one so late
that several slots passed). By default (``catch_up=False``) only the latest due slot is
published, once: a relay back after an hour of a five-minute schedule publishes one event,
for the slot a few minutes ago, not twelve. With ``catch_up=True`` every missed slot is
published, oldest first, at most ``CATCH_UP_LIMIT`` of them (the latest ones; older ones
are skipped with a warning).

The relay's scheduler (:mod:`outbox.relay.scheduler`) publishes the slots, exactly once
per slot however many relays run.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from outbox.errors import ConfigurationError, InvalidEventError
from outbox.publish import check_name, make_event

log = logging.getLogger(__name__)

#: Most missed slots a ``catch_up=True`` schedule publishes in one go (the latest ones).
CATCH_UP_LIMIT = 1000
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
