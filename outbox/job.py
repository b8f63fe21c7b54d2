"""Job: what a handler receives for one (event, consumer) pair on one attempt."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from .errors import LeaseLostError

_EVENT_LOCK = threading.Lock()


@dataclass(slots=True, eq=False)
class Job:
    """One claimed job.

    ``id`` is the job row, ``event_id``/``topic``/``key``/``payload``/``headers`` come from
    the event, ``consumer`` is the subscriber's name. ``attempt`` counts from 1 and reaches
    at most ``max_attempts``. ``fence`` is the fencing token of this claim: larger than any
    fence handed out before it, for any job; pass it to :func:`outbox.fenced_write`.
    ``idempotency_key`` is the same on every attempt of this job (``consumer:event_id``):
    give it to external systems that deduplicate (payment APIs, mailers, brokers).
    """

    id: int
    event_id: int
    consumer: str
    topic: str
    key: str | None
    payload: Any
    headers: dict[str, Any]
    attempt: int
    max_attempts: int
    fence: int
    lease_seconds: float
    event_created_at: datetime | None = None
    _lost: bool = field(default=False, init=False, repr=False)
    # Made on first use by wait_lease_lost: most jobs never wait, and a threading.Event per
    # claimed job was a measurable share of the relay's time (performance notes).
    _lost_event: threading.Event | None = field(default=None, init=False, repr=False)
    # time.monotonic() by which the lease has surely expired, if no heartbeat renewed it:
    # the relay's own conservative bound, used only to not start a buffered job whose lease
    # ran out while the process was paused; never to write anything.
    _lease_bound: float = field(default=float("inf"), init=False, repr=False)
    # (priority, run_at, id): where the claim found the job in the queue. The relay's buffer
    # keeps this order, so a job claimed late that sorts early (released by a relay that
    # stopped, reaped) starts before the buffered backlog, as it would have in the table.
    _claim_order: tuple[Any, ...] = field(default=(), init=False, repr=False)
    # The payload's JSON text as PostgreSQL stores it, when the job was claimed from it.
    _payload_json: str | None = field(default=None, init=False, repr=False)
    # Set by the heartbeat when an operator asked to cancel this job (``outbox-relay cancel``).
    _cancel_requested: bool = field(default=False, init=False, repr=False)

    @property
    def idempotency_key(self) -> str:
        """Stable across retries of this job: ``"<consumer>:<event_id>"``."""
        return f"{self.consumer}:{self.event_id}"

    @property
    def payload_json(self) -> str:
        """The payload as JSON text: for a claimed job, exactly the text PostgreSQL stores
        (``payload::text``, what a forwarder sends); for one built in a test
        (:func:`outbox.testing.make_job`), ``json.dumps`` of ``payload``."""
        if self._payload_json is None:
            return json.dumps(self.payload, ensure_ascii=False, separators=(", ", ": "))
        return self._payload_json

    @property
    def lease_lost(self) -> bool:
        """True once the relay learnt that this worker no longer owns the job (a heartbeat
        matched no row, or the relay released it on shutdown). Whatever the handler reports
        afterwards is dropped."""
        return self._lost

    @property
    def cancel_requested(self) -> bool:
        """True once an operator asked to cancel this job while it ran (``outbox-relay
        cancel``), as the relay's heartbeat (every lease/3) learnt it. A handler that sees it
        should stop early; however the attempt ends (returns, raises, snoozes), the job is
        recorded ``cancelled`` and not run again."""
        return self._cancel_requested

    def check_lease(self) -> None:
        """Raise :class:`~outbox.errors.LeaseLostError` if the lease is lost; call it between
        steps of a long handler to stop early."""
        if self._lost:
            raise LeaseLostError(f"job {self.id} ({self.consumer}) lost its lease at fence {self.fence}")

    def wait_lease_lost(self, timeout: float) -> bool:
        """Sleep up to ``timeout`` seconds, waking early if the lease is lost; returns
        :attr:`lease_lost`. Use instead of ``time.sleep`` in handlers that wait."""
        with _EVENT_LOCK:
            if self._lost_event is None:
                self._lost_event = threading.Event()
            event = self._lost_event
        # mark_lease_lost sets _lost before it looks for the event, and the event exists
        # before _lost is read here: whichever runs first, the wait cannot miss the loss.
        if self._lost:
            return True
        return event.wait(timeout)

    def mark_cancel_requested(self) -> None:
        """Record that an operator asked to cancel the job (used by the relay's heartbeat)."""
        self._cancel_requested = True

    def mark_lease_lost(self) -> None:
        """Record that the lease is gone (used by the relay)."""
        self._lost = True
        with _EVENT_LOCK:
            event = self._lost_event
        if event is not None:
            event.set()
