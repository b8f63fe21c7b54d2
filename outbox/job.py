"""Job: what a handler receives for one (event, consumer) pair on one attempt."""

from __future__ import annotations

import copy as _copy
import json
import threading
from datetime import datetime
from typing import Any, Generic

from pydantic import BaseModel
from typing_extensions import TypeVar

from outbox.errors import LeaseLostError

#: The payload's type: ``Any`` (what ``json.loads`` gives) unless a subscriber declares a
#: pydantic model (``Job[OrderPlaced]``, :mod:`outbox.typed_events`).
PayloadT = TypeVar("PayloadT", default=Any)

_EVENT_LOCK = threading.Lock()


class Job(Generic[PayloadT]):
    """One claimed job, as its handler sees it (the relay's bookkeeping of the claim is its
    own: :class:`outbox.relay.claim.Claim`).

    ``id`` is the job row, ``event_id``/``topic``/``key``/``payload``/``headers`` come from
    the event, ``consumer`` is the subscriber's name. ``attempt`` counts from 1 and reaches
    at most ``max_attempts``. ``fence`` is the fencing token of this claim: larger than any
    fence handed out before it, for any job; pass it to :func:`outbox.fenced_write`.
    ``idempotency_key`` is the same on every attempt of this job (``consumer:event_id``):
    give it to external systems that deduplicate (payment APIs, mailers, brokers).

    A job the relay claimed decodes ``payload`` and ``headers`` from the JSON text the claim
    returned on first use (``json.loads``, in the handler's thread): a handler or forwarder
    that never reads them (a forwarder sends ``payload_json``) does not pay for decoding,
    which was a fifth of the dispatcher's time at 250 jobs a claim (performance notes, lever
    17). Two threads reading an undecoded payload at once may each decode it; both get
    equal values.

    ``Job[Model]`` (``Model`` a pydantic model) is the job of a subscriber that declared that
    payload type: ``payload`` is then a ``Model`` instance, validated from the stored JSON
    before the handler runs (:mod:`outbox.typed_events`); a bare ``Job`` is ``Job[Any]``.
    """

    __slots__ = ("id", "event_id", "consumer", "topic", "key", "_payload", "_headers", "attempt", "max_attempts",
                 "fence", "lease_seconds", "event_created_at", "_lost", "_lost_event", "_payload_json",
                 "_headers_json", "_payload_undecoded", "_headers_undecoded", "_cancel_requested")

    def __init__(self, id: int, event_id: int, consumer: str, topic: str, key: str | None, payload: Any,
                 headers: dict[str, Any], attempt: int, max_attempts: int, fence: int, lease_seconds: float,
                 event_created_at: datetime | None = None) -> None:
        self.id = id
        self.event_id = event_id
        self.consumer = consumer
        self.topic = topic
        self.key = key
        self._payload = payload
        self._headers = headers
        self.attempt = attempt
        self.max_attempts = max_attempts
        self.fence = fence
        self.lease_seconds = lease_seconds
        self.event_created_at = event_created_at
        self._lost = False
        # Made on first use by wait_lease_lost: most jobs never wait, and a threading.Event
        # per claimed job was a measurable share of the relay's time (performance notes).
        self._lost_event: threading.Event | None = None
        # The payload's and the headers' JSON text as PostgreSQL stores them, when the job
        # was claimed from them (None: built from Python values); the flags say whether
        # _payload and _headers still wait to be decoded from them (flags rather than a
        # sentinel value, so that a copied or pickled job keeps its meaning).
        self._payload_json: str | None = None
        self._headers_json: str | None = None
        self._payload_undecoded = False
        self._headers_undecoded = False
        # Set by the heartbeat when an operator asked to cancel this job (``outbox-relay cancel``).
        self._cancel_requested = False

    @classmethod
    def from_json(cls, id: int, event_id: int, consumer: str, topic: str, key: str | None, payload_json: str,
                  headers_json: str | None, attempt: int, max_attempts: int, fence: int, lease_seconds: float,
                  event_created_at: datetime | None = None) -> Job:
        """A job whose payload and headers are the JSON texts PostgreSQL returned for the
        event's ``jsonb`` columns (``headers_json`` None: no headers, read as ``{}``),
        decoded on first use. The texts are not checked here: they must be what the server
        wrote for a ``jsonb`` value, which always decodes."""
        job = cls(id, event_id, consumer, topic, key, None, {}, attempt, max_attempts, fence, lease_seconds,
                  event_created_at)
        job._payload_json = payload_json
        job._headers_json = headers_json
        job.restore_input()
        return job

    #: What :meth:`replace` may change: the constructor's arguments.
    FIELDS = ("id", "event_id", "consumer", "topic", "key", "payload", "headers", "attempt", "max_attempts", "fence",
              "lease_seconds", "event_created_at")

    def replace(self, **changes: Any) -> Job:
        """A copy of this job with the constructor arguments ``changes`` names set (what
        ``dataclasses.replace`` was used for when ``Job`` was a dataclass). The copy keeps the
        stored JSON texts it was claimed from; its lease-lost and cancel-requested marks start
        clear. Raises ``TypeError`` for a name
        that is not one of :attr:`FIELDS`."""
        unknown = sorted(set(changes) - set(self.FIELDS))
        if unknown:
            raise TypeError(f"Job.replace: unknown field(s) {', '.join(unknown)}; known: {', '.join(self.FIELDS)}")
        copy = _copy.copy(self)
        copy._lost, copy._lost_event, copy._cancel_requested = False, None, False
        for name, value in changes.items():
            setattr(copy, name, value)
        return copy

    def restore_input(self) -> None:
        """Forget the decoded payload and headers, so that the next read decodes the claim's
        stored texts afresh: a transactional handler run again in place (after a
        serialization failure or deadlock) sees the input its first run saw, whatever that
        run changed in ``job.payload`` or ``job.headers``. A job built from Python values
        (:func:`outbox.testing.make_job`, or after assigning ``payload``) has no stored text
        for what was assigned, and keeps it."""
        if self._payload_json is not None:
            self._payload_undecoded = True
        if self._headers_json is not None:
            self._headers_undecoded = self._headers_json != "{}"
            if not self._headers_undecoded:
                self._headers = {}

    def __repr__(self) -> str:
        return (f"Job(id={self.id!r}, event_id={self.event_id!r}, consumer={self.consumer!r}, topic={self.topic!r},"
                f" key={self.key!r}, attempt={self.attempt!r}, max_attempts={self.max_attempts!r},"
                f" fence={self.fence!r})")

    @property
    def payload(self) -> PayloadT:
        """The event's payload, as ``json.loads`` gives it (dict, list, str, number, bool or
        None), or the subscriber's payload model (:meth:`use_payload`)."""
        if self._payload_undecoded:
            self._payload = json.loads(self._payload_json)  # type: ignore[arg-type]
            self._payload_undecoded = False
        return self._payload  # type: ignore[no-any-return]

    @payload.setter
    def payload(self, value: Any) -> None:
        self._payload = value
        self._payload_undecoded = False
        self._payload_json = None  # payload_json follows the new value

    def use_payload(self, value: Any) -> None:
        """Let ``payload`` be ``value``: the stored payload decoded otherwise (as the
        subscriber's pydantic model). Unlike assigning ``payload``, ``payload_json`` stays
        the stored text and :meth:`restore_input` forgets ``value``."""
        self._payload = value
        self._payload_undecoded = False

    @property
    def headers(self) -> dict[str, Any]:
        """The event's headers (``{}`` when it has none: a column that SQL set to JSON
        ``null`` or another empty value reads as ``{}`` too, as it did before decoding moved here)."""
        if self._headers_undecoded:
            self._headers = json.loads(self._headers_json) or {}  # type: ignore[arg-type]
            self._headers_undecoded = False
        return self._headers

    @headers.setter
    def headers(self, value: dict[str, Any]) -> None:
        self._headers = value
        self._headers_undecoded = False

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
            if isinstance(self._payload, BaseModel):
                return self._payload.model_dump_json()
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
