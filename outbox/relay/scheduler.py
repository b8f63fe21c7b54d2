"""The scheduler: the relay's part that publishes the due slots of the registry's schedules
(:mod:`outbox.schedule`).

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
from datetime import datetime

from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError

from outbox.db import queries
from outbox.publish import publish_many
from outbox.relay.reconnect import Reconnector
from outbox.schedule import Schedule

log = logging.getLogger(__name__)

#: Longest sleep of the scheduler between two looks at the schedules, seconds.
SCHEDULER_MAX_SLEEP = 30.0


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
