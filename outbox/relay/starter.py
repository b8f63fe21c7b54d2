"""The starter: hands a runner's buffered claims to its workers as they come free.

State: a claim waits in the buffer (:class:`outbox.relay.claims.HeldClaims`), listed in the
relay's row of ``outbox_relays`` by the statement that claimed it. When a worker slot (or,
for a forwarder's job, a place in the forwarding window) is free, the starter takes as many
claims from the head of the buffer as there is room for, unlists them all in one small
statement on a connection of its own (``relay_buffer_remove``), and only once that has
committed hands them to the workers (or the forwarder). So a job whose handler may have
started is never listed, and an attempt is charged only to a job whose handler started
(architecture notes, "Attempts and crashes").

A buffered claim whose lease ran out while it waited (the process was paused, or starved)
is not started: it is posted for release (fenced, attempt not counted).

On failure: claims whose unlisting failed go back to the head of the buffer, still
listed, their places given back; a broken connection is thrown away and a new one made,
with the relay's reconnect backoff.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import psycopg
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError

from outbox.db.engine import is_disconnect
from outbox.db.jobs import relay_buffer_remove
from outbox.relay.claim import Claim, jobs_of
from outbox.relay.claims import HeldClaims, Signals
from outbox.relay.outcomes import Outcome
from outbox.relay.reconnect import Reconnector
from outbox.settings import OutboxSettings
from outbox.telemetry.logs import job_summary

log = logging.getLogger(__name__)


class Starter:
    """Hands buffered jobs of ``claims`` to idle workers (``start``: the workers' queue, or
    the forwarder for a forwarder's jobs), on a connection of
    its own from ``engine``; a buffered claim whose lease ran out is posted for release
    through ``release(claim, Outcome.RELEASE)``. Runs in its own thread (:meth:`run`) until ``signals.stopped``."""

    def __init__(self, engine: Engine, settings: OutboxSettings, claims: HeldClaims, worker_id: str,
                 start: Callable[[list[Claim]], None], release: Callable[[Claim, Outcome], None], signals: Signals,
                 reconnect: Reconnector) -> None:
        self.engine = engine
        self.settings = settings
        self.claims = claims
        self.worker_id = worker_id
        self.start = start
        self.release = release
        self.signals = signals
        self.reconnect = reconnect

    def run(self) -> None:
        """Take as many jobs from the head of the buffer as workers are idle, unlist them in
        the relay's row (``relay_buffer_remove``, one small statement for all of them), and
        only once that has committed give them to the workers. So a job whose handler may
        have started is never listed, and a worker that finishes waits one short round trip,
        shared by every worker that came free meanwhile, not for the dispatcher's claim. A
        buffered job whose lease ran out while it waited (the process was paused, or
        starved) is released instead (fenced: a no-op if it was reaped or re-claimed); the
        ones found together are logged in one WARNING line, each at DEBUG."""
        claims, signals = self.claims, self.signals
        failures = 0
        conn: Any = None
        while True:
            with claims.changed:
                while not signals.stopped.is_set() and (signals.draining.is_set() or not claims.can_start()):
                    claims.changed.wait(0.5)
                if signals.stopped.is_set():
                    break
                jobs, forwards, expired = claims.take_startable(time.monotonic())
                jobs += forwards
            for claim in expired:
                log.debug("job %s (%s) fence %s not started: its lease ran out while it waited in the buffer",
                          claim.id, claim.consumer, claim.fence, extra=claim.fields(outcome="released"))
            first = claims.first_reports(expired)
            if first:
                text, fields = job_summary(jobs_of(first), "released")
                log.warning("%s not started: the claims' leases ran out while they waited in the buffer (a pause, "
                            "or a starved process); handing them back", text, extra=fields)
            for claim in expired:
                claims.mark_finishing(claim.fence)
                self.release(claim, Outcome.RELEASE)
            if not jobs:
                continue
            try:
                if conn is None:
                    conn = self.engine.raw_connection()
                    conn.driver_connection.autocommit = True
                relay_buffer_remove(conn.driver_connection, self.worker_id, [j.fence for j in jobs],
                                    schema=self.settings.schema_name)
                failures = self.reconnect.recovered(failures, "starting buffered jobs")
            except (DBAPIError, psycopg.Error) as exc:
                claims.put_back(jobs)
                if conn is not None and (is_disconnect(exc) or conn.driver_connection is None
                                         or conn.driver_connection.closed or conn.driver_connection.broken):
                    try:
                        conn.invalidate()
                    except Exception:  # noqa: BLE001 - it is being thrown away
                        pass
                    conn = None
                failures = self.reconnect.backoff(failures, "starting buffered jobs", exc, signals.stopped)
                continue
            claims.unlisted(jobs)
            self.start(jobs)
        if conn is not None:
            try:
                conn.close()
            except Exception:  # noqa: BLE001
                pass
