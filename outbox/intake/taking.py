"""Taking a batch of messages in: the one transaction of an intake round (module notes of
:mod:`outbox.intake`). Shared by the relay's intake loop and the webhook server."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy.engine import Connection

from outbox.db import queries
from outbox.intake import KEPT_BODY_BYTES, Arrival, Received, clean_text
from outbox.publish import publish_drafts


class LockLostError(Exception):
    """An ordered intake's relay no longer holds the intake's lock (its lock session ended):
    nothing of the batch is committed; the relay stops taking in until it holds it again."""


class RacedError(Exception):
    """Another transaction recorded one of the batch's identities after this one looked them
    up (two relays took the same message in at once): roll back and run the batch again."""


@dataclass(frozen=True, slots=True)
class Taken:
    """What one round did: ``events`` (identity -> id of the event each new message became),
    ``duplicates`` (identities taken in before, or twice in the batch: dropped),
    ``rejected`` (identities recorded as rejected)."""

    events: dict[str, int]
    duplicates: frozenset[str]
    rejected: frozenset[str]


def take_in(conn: Connection, source: str, arrivals: Sequence[Arrival], *, schema: str | None = None,
            lock_pid: int | None = None) -> Taken:
    """In ``conn``'s transaction (which the caller commits): drop the arrivals whose identity
    intake ``source`` has recorded (or that repeat an earlier one of the batch), write an
    event for each new one with an event and record every new one in ``outbox_intake``.
    Raises :class:`RacedError` when another transaction recorded one of the identities
    meanwhile (the caller rolls back and calls again), :class:`LockLostError` when
    ``lock_pid`` (the session holding an ordered intake's lock) holds it no more, and the
    database's errors."""
    statements = queries.in_schema(schema)
    if lock_pid is not None and not conn.execute(statements.intake_lock_held,
                                                 {"source": source, "pid": lock_pid}).scalar_one():
        raise LockLostError(f"intake {source}: this relay's lock session ended")
    wanted = list(dict.fromkeys(a.identity for a in arrivals))
    known = set(conn.execute(statements.intake_known_many, {"source": source, "identities": wanted}).scalars())
    fresh: dict[str, Arrival] = {}
    duplicates = set(known)
    for item in arrivals:
        if item.identity in known or item.identity in fresh:
            duplicates.add(item.identity)
        else:
            fresh[item.identity] = item
    if not fresh:
        return Taken({}, frozenset(duplicates), frozenset())
    taking = [a for a in fresh.values() if a.event is not None]
    ids = publish_drafts(conn, [a.event for a in taking if a.event is not None], schema=schema)
    events = dict(zip((a.identity for a in taking), ids, strict=True))
    rows = list(fresh.values())
    rejected = [a for a in rows if a.event is None]
    recorded = conn.execute(statements.intake_record_many, {
        "source": source,
        "identities": [a.identity for a in rows],
        "event_ids": [events.get(a.identity) for a in rows],
        "problems": [None if a.problem is None else clean_text(a.problem) for a in rows],
        "subjects": [None if a.event else clean_text(a.message.subject) for a in rows],
        "headers": [None if a.event else json.dumps({clean_text(k): clean_text(v) for k, v in a.message.headers.items()})
                    for a in rows],
        "bodies": [None if a.event else a.message.body[:KEPT_BODY_BYTES] for a in rows],
        "body_sizes": [None if a.event else len(a.message.body) for a in rows],
    }).scalars().all()
    if len(recorded) != len(rows):
        raise RacedError(f"{len(rows) - len(recorded)} of the batch's messages were taken in by another "
                         "transaction meanwhile")
    return Taken(events, frozenset(duplicates), frozenset(a.identity for a in rejected))


def refused(item: Arrival, error: str) -> Arrival:
    """``item`` rejected because the database refused to write it (``error``), with no more
    of the message than surely fits: its first bytes, no subject, no headers."""
    bare = Received(body=item.message.body, headers={}, subject="", message_id=item.message.message_id)
    return Arrival(item.identity, bare, problem=clean_text(f"the database refused it: {error}"))
