"""Fan-in: a follow-up event once every listed consumer has done its job of an event.

Declared with :meth:`outbox.Outbox.after`::

    ob.after("order.placed", consumers=["send_receipt", "create_invoice", "sync_crm"],
             publish="order.fulfilled")

When the jobs of ``send_receipt``, ``create_invoice`` and ``sync_crm`` of one
``order.placed`` event are all ``done``, one event is published on ``order.fulfilled``, in
the transaction that records the last of those completions: the original event's key and
payload, its trace context (``traceparent``, ``tracestate``, ``baggage``) and two headers,
``fan_in`` (the fan-in's name) and ``fan_in_event_id`` (the original event's id). A chain of
fan-ins (a follow-up topic whose consumers are listed by another fan-in) is a small workflow.

What each ending of a listed job does:

* ``done`` (and a done job deleted by its completion, ``retention_done = 0``): counts.
* ``dead``: holds the fan-in back; a redrive that later ends ``done`` lets it fire.
* ``cancelled``: the fan-in never fires for that event.
* ``superseded``: cannot happen, a coalescing consumer cannot be listed (its jobs may end
  superseded, never done).

Once per (fan-in, event), whatever the number of relays and crashes: the database decides it
(:mod:`outbox.db.fan_in`, where the trigger, its race and its record are described), in the
transaction of the completion, so a relay killed before that commit leaves the job to be run
again and the fan-in to fire with its completion, and one killed after it has fired already.
A replay of the event (``outbox-relay replay``) never fires it again.

The follow-up's payload is the original event's: a follow-up is published by the database
(every completion path: the relay's batches, a transactional handler's own transaction, an
operator's SQL), where no Python runs, so no function of the application can compute it there.
The follow-up's subscribers are where Python runs: they get the original payload and the
original event's id (``job.headers["fan_in_event_id"]``) to read whatever the listed
consumers wrote.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from outbox.errors import ConfigurationError, InvalidEventError
from outbox.publish import check_name

if TYPE_CHECKING:
    from outbox.registry import Subscriber

#: Most consumers one fan-in may list.
MAX_LISTED = 100


@dataclass(frozen=True, slots=True)
class FanIn:
    """One declared fan-in: when every consumer of ``consumers`` has done its job of an event
    on ``topic``, one event on ``follow_topic`` is published (module notes). ``name``
    identifies it in ``outbox_fanins`` and ``outbox_fanin_fired`` and in the follow-up's
    ``fan_in`` header: renaming a fan-in makes it a new one, which fires again for events
    whose jobs complete after the rename."""

    name: str
    topic: str
    consumers: tuple[str, ...]
    follow_topic: str


def make_fan_in(topic: Any, consumers: Any, publish: Any, name: Any) -> FanIn:
    """The :class:`FanIn` of :meth:`outbox.Outbox.after`'s arguments (``name`` None: the
    ``publish`` topic). Raises :class:`ConfigurationError` naming the argument: a topic or
    name that is not a valid name, ``consumers`` not a non-empty sequence of distinct
    consumer names (at most :data:`MAX_LISTED`; a single ``str`` is refused), or ``publish``
    equal to ``topic`` (each follow-up would fire the fan-in again)."""
    try:
        topic = check_name(topic, "topic")
        publish = check_name(publish, "publish")
        name = publish if name is None else check_name(name, "name")
    except InvalidEventError as exc:
        raise ConfigurationError(f"fan-in {name if isinstance(name, str) else publish!r}: {exc}") from None
    if isinstance(consumers, (str, bytes)) or not isinstance(consumers, Sequence) or not consumers:
        raise ConfigurationError(f"fan-in {name!r}: consumers must be a non-empty list of consumer names, "
                                 f"got {consumers!r}")
    if len(consumers) > MAX_LISTED:
        raise ConfigurationError(f"fan-in {name!r}: consumers lists {len(consumers)} consumers, at most "
                                 f"{MAX_LISTED}")
    try:
        listed = tuple(check_name(c, "consumers") for c in consumers)
    except InvalidEventError as exc:
        raise ConfigurationError(f"fan-in {name!r}: {exc}") from None
    if len(set(listed)) != len(listed):
        raise ConfigurationError(f"fan-in {name!r}: consumers lists a consumer twice: {list(listed)!r}")
    if publish == topic:
        raise ConfigurationError(f"fan-in {name!r}: publish must be another topic than {topic!r} (its follow-up "
                                 "would fire the fan-in again, for ever)")
    return FanIn(name, topic, listed, publish)


def loop_of(fan_in: FanIn, declared: Sequence[FanIn]) -> list[str] | None:
    """The topics of a loop that ``fan_in`` would close with the ``declared`` fan-ins (each
    publishes on its ``follow_topic`` after events on its ``topic``): ``[t1, t2, ..., t1]``,
    or None when there is none. A loop would publish follow-ups for ever."""
    after: dict[str, set[str]] = {}
    for f in (*declared, fan_in):
        after.setdefault(f.topic, set()).add(f.follow_topic)
    path = [fan_in.topic, fan_in.follow_topic]
    seen: set[str] = set()

    def walk(topic: str) -> list[str] | None:
        if topic == fan_in.topic:
            return path
        if topic in seen:
            return None
        seen.add(topic)
        for follow in sorted(after.get(topic, ())):
            path.append(follow)
            found = walk(follow)
            if found is not None:
                return found
            path.pop()
        return None

    return walk(fan_in.follow_topic)


def listing_problem(fan_in: FanIn, consumer: str, subscribers: Mapping[str, Subscriber]) -> str | None:
    """Why ``fan_in`` cannot list ``consumer`` given the declared ``subscribers`` (by
    consumer), or None: not declared, not a subscriber of the fan-in's topic, or coalescing
    (its jobs may end superseded, so the fan-in could wait for ever)."""
    sub = subscribers.get(consumer)
    if sub is None:
        return f"lists consumer {consumer!r}, which the registry does not declare"
    if fan_in.topic not in sub.topics:
        return (f"lists consumer {consumer!r}, which does not subscribe to {fan_in.topic!r} "
                f"(it subscribes to {list(sub.topics)!r})")
    if sub.coalesce:
        return (f"lists consumer {consumer!r}, which coalesces: its jobs may end superseded instead of done, "
                "so the fan-in would wait for ever; list another consumer")
    return None
