"""publish(): write events in the caller's transaction.

The event is an ordinary row, inserted through the caller's own ``Session``,
``AsyncSession``, ``Connection`` or ``AsyncConnection``; outbox never commits. So the event
exists exactly when the caller's transaction (or SAVEPOINT) commits: rolled back means
never delivered, committed means delivered at least once to every subscribed consumer
(architecture notes; seed article 002, "Enqueue with your data").

A statement-level trigger sends ``NOTIFY outbox_events`` (``<schema>.outbox_events`` for a
schema other than ``public``), which PostgreSQL delivers only on commit, so relays wake at
once without an extra round trip here. The schema is ``publish``'s ``schema`` argument, else
``OUTBOX_SCHEMA``, else ``public``.

Publish options (``run_at``, ``delay``, ``dedup_key``, ``priority``; see :func:`publish`)
are columns of the event, NULL when not given; the router copies them into the
jobs. An event without options takes the same statement and path as before they existed;
one with options takes ``event_insert_options`` (``_many``), an ``INSERT ... ON CONFLICT DO
NOTHING`` on the partial unique index of (topic, dedup_key), followed, only when the key was
taken, by a lookup of the event holding it. The statements to run are planned by one
generator for sync and async sessions alike (architecture notes, "Deduplication and
schedules").

Everything is validated before the first byte is sent; a bad event raises
:class:`~outbox.errors.InvalidEventError` naming the field and the problem, and the
caller's transaction is untouched and still usable. The rules, their limits and their words
are those of the SQL functions ``outbox_publish`` / ``outbox_publish_many``
(:mod:`outbox.db.event_rules`): the same input gives the same event or the same error
through either.

Payload encoding: JSON objects with string keys, arrays (``list`` or ``tuple``; a tuple
comes back as a list), strings, finite numbers, booleans and null. Anything else (sets,
bytes, datetimes, custom objects, non-string keys, NaN) is refused rather than converted,
so what a handler receives is what was published (numbers: see below).

Numbers: ``jsonb`` keeps every number as ``numeric``, the exact decimal digits written,
including those after a decimal point but not the notation, and psycopg reads a number back
as a ``float`` when it has a decimal point and as an ``int`` otherwise. So:

* an ``int`` (up to ``MAX_INT_DIGITS`` digits, 2**63 and beyond) arrives as an ``int`` of the
  same value;
* a finite ``float`` arrives as a ``float`` of the same value. Python writes floats of
  magnitude 1e16 and above with an exponent (``1e+16``), which ``numeric`` would keep as the
  integer 10000000000000000, read back as an ``int``; publish writes them in positional
  notation with one fraction digit instead (``10000000000000000.0``: the digits of the
  float's shortest ``repr``, so it reads back as the same float). Such a float takes up to
  312 characters (sign included) of the encoded size the limits count. Negative exponents
  (``1e-07``, ``5e-324``) are written positionally too (``0.0000001``), as ``jsonb`` prints
  them back: the size counted is that of what the table holds (up to 326 characters for
  ``5e-324``), which is what the SQL functions count;
* ``-0.0`` arrives, and is written, as ``0.0`` (a ``float``, equal under ``==``; ``numeric``
  has no negative zero); it is the only float whose sign does not survive.

How validation stays cheap: most payloads are built only of ``dict``, ``list``, ``tuple``
and exact ``str``/``int``/``float``/``bool``/``None``. For those a quick walk looks at
types, key types, integer sizes and depth only; one ``json.dumps`` pass then does the rest,
and the rules on strings are checked on its output (NUL is the only character JSON writes
as ``\\u0000``; an unpaired surrogate fails the UTF-8 encoding that measures the size;
``allow_nan=False`` refuses NaN and infinities). Anything else, or any doubt (a literal
backslash before ``u0000`` in a string, say), goes through the full walk of every value,
which accepts and refuses exactly the same events and names the exact place of the
problem. Either way nothing has been sent yet. Both rewrite floats with an exponent and
negative zero the same way, on the encoded text, and only when it contains ``e+``, ``e-``
or ``-0.0`` (a float's ``repr`` holds one exactly when it has an exponent or is negative
zero; a string holding one costs a scan that changes nothing), so payloads without such
floats pay three substring searches.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from collections.abc import Coroutine, Generator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, overload

import psycopg
from psycopg.rows import namedtuple_row
from pydantic import BaseModel
from sqlalchemy import TextClause
from sqlalchemy.dialects.postgresql.psycopg import PGDialect_psycopg
from sqlalchemy.engine import Connection
from sqlalchemy.exc import ProgrammingError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.orm import Session

from outbox import typed_events
from outbox.db import event_rules as rules
from outbox.db import queries
from outbox.db.event_rules import (  # the limits, public names of this module too
    DEFAULT_MAX_PAYLOAD_BYTES,
    MAX_DEDUP_KEY_LENGTH,
    MAX_DELAY_SECONDS,
    MAX_DEPTH,
    MAX_EVENT_PRIORITY,
    MAX_HEADERS_BYTES,
    MAX_INT_DIGITS,
    MAX_KEY_LENGTH,
    MAX_NAME_LENGTH,
)
from outbox.errors import InvalidEventError, OutboxError, SchemaNotReadyError
from outbox.telemetry import tracing

#: Ints of at most this many bits have at most ``MAX_INT_DIGITS`` digits for sure (2**3321 <
#: 10**1000 < 2**3322); one bit more may or may not, and is checked exactly by the full walk.
_MAX_INT_BITS: int = (10**MAX_INT_DIGITS).bit_length() - 1
_INT_LIMIT: int = 10**MAX_INT_DIGITS


#: The default of publish()'s ``payload``: none given (the topic is then a pydantic model
#: naming its topic: :mod:`outbox.typed_events`).
NO_PAYLOAD: Any = object()

#: (topic, key, payload JSON, headers JSON) of one validated event.
_Row = tuple[str, str | None, str, str]


@dataclass(frozen=True, slots=True)
class EventDraft:
    """One validated event, ready to insert: JSON text for payload and headers."""

    topic: str
    key: str | None
    payload: str
    headers: str


def check_name(value: Any, field: str, limit: int = MAX_NAME_LENGTH) -> str:
    """Validate a topic or consumer name: a non-empty ``str`` of at most ``limit``
    characters without NUL or unpaired surrogates. Any other character is allowed (names
    are always bound as parameters, never spliced into SQL). Raises InvalidEventError."""
    if type(value) is str and 0 < len(value) <= limit and value.isascii() and "\x00" not in value \
            and not value.isspace():
        return value  # the usual case, decided without the checks below (ASCII has no surrogates)
    if value is None:
        raise InvalidEventError(field, rules.REQUIRED)
    if not isinstance(value, str):
        raise InvalidEventError(field, rules.NOT_A_STR % type(value).__name__)
    if not value.strip():
        raise InvalidEventError(field, rules.EMPTY)
    if len(value) > limit:
        raise InvalidEventError(field, rules.TOO_LONG % (len(value), limit))
    _check_text(value, field)
    return value


def _check_text(value: str, where: str) -> None:
    if "\x00" in value:
        raise InvalidEventError(where, "contains a NUL character (\\u0000), which PostgreSQL cannot store")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidEventError(where, "contains an unpaired surrogate, which is not valid Unicode") from None


def _check_json(value: Any, where: str, depth: int = 0) -> None:
    if depth > MAX_DEPTH:
        raise InvalidEventError(where, rules.TOO_DEEP)
    if value is None or value is True or value is False:
        return
    kind = type(value)
    if kind is str:
        _check_text(value, where)
    elif kind is int:
        if value.bit_length() > _MAX_INT_BITS and abs(value) >= _INT_LIMIT:
            raise InvalidEventError(where, rules.INT_TOO_LONG)
    elif kind is float:
        if not math.isfinite(value):
            raise InvalidEventError(where, f"{value!r} is not a JSON number")
    elif isinstance(value, Mapping):
        for k, v in value.items():
            if not isinstance(k, str):
                raise InvalidEventError(where, f"has a key of type {type(k).__name__}; JSON keys must be str")
            _check_text(k, f"{where} key {k[:40]!r}")
            _check_json(v, f"{where}[{k[:40]!r}]", depth + 1)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_json(v, f"{where}[{i}]", depth + 1)
    elif isinstance(value, (str, int, float)):  # subclasses such as IntEnum or str enums
        _check_json(_plain(value), where, depth)
    else:
        raise InvalidEventError(where, f"{type(value).__name__} is not JSON-serialisable")


def _plain(value: str | int | float) -> str | int | float:
    for base in (int, float, str):
        if isinstance(value, base):
            return base(value)
    raise AssertionError(type(value))


def _mapping_as_dict(value: Any) -> dict[str, Any]:
    # _check_json accepts any Mapping as a JSON object; json.dumps knows only dict.
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError(f"{type(value).__name__} is not JSON-serialisable")


#: In JSON text written by ``json``: a whole string (skipped), or a number with an exponent,
#: or a negative zero (group 1). Numbers occur only outside strings, and a scan that consumes
#: every string whole from its opening quote never starts inside one.
_STRING_OR_NUMBER_TO_REWRITE = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|(-?[0-9]+(?:\.[0-9]+)?e[+-][0-9]+|-0\.0(?![0-9]))',
                                          re.DOTALL)


def _positional(match: re.Match[str]) -> str:
    number = match[1]
    if number is None:
        return match[0]  # a string: unchanged
    if number == "-0.0":
        return "0.0"  # numeric has no negative zero
    # A float's repr with an exponent is its exact decimal value (Decimal keeps every digit):
    # with a positive exponent an integer (at most 16 fraction digits, exponent 16 or more),
    # with a negative one the same digits after the point.
    digits = format(Decimal(number), "f")
    return digits if "." in digits else digits + ".0"


def _jsonb_numbers(text: str) -> str:
    """``text`` (JSON written by ``json``) with its numbers as ``jsonb`` prints them back:
    every float written with an exponent (``1.5e+300``, ``1e-07``) in positional notation,
    with one fraction digit when it is whole (``15000...0.0``, so ``jsonb`` keeps it a
    float), and ``-0.0`` as ``0.0``. What is measured against the limits is then what the
    table holds, as the SQL functions measure it (module notes). Costs three substring
    searches when there is nothing to rewrite."""
    if "e+" in text or "e-" in text or "-0.0" in text:
        return _STRING_OR_NUMBER_TO_REWRITE.sub(_positional, text)
    return text


def _encode_checked(value: Any, field: str, limit: int) -> str:
    """The full walk, then the encoding: the reference for what is accepted and refused."""
    _check_json(value, field)
    text = _jsonb_numbers(json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False,
                                     default=_mapping_as_dict))
    size = len(text.encode("utf-8"))
    if size > limit:
        raise InvalidEventError(field, rules.TOO_LARGE % (size, limit))
    return text


#: Exact types a plain value may hold besides containers and ints (ints are checked for size).
_PLAIN_LEAVES = frozenset({str, float, bool, type(None)})


def _is_plain(value: Any, depth: int = 0) -> bool:
    """True when ``value`` holds only ``dict`` with ``str`` keys, ``list``, ``tuple``, exact
    ``str``/``float``/``bool``/``None`` and ints of at most ``MAX_INT_DIGITS`` digits, no
    deeper than ``MAX_DEPTH``. Subclasses (enums, other mappings) answer False: the full walk
    takes them. A circular value answers False once it passes ``MAX_DEPTH``."""
    kind = type(value)
    if kind is dict:
        for key in value:
            if type(key) is not str:
                return False
        items: Any = value.values()
    elif kind is list or kind is tuple:
        items = value
    elif kind is int:
        bits: int = value.bit_length()
        return bits <= _MAX_INT_BITS
    else:
        return kind in _PLAIN_LEAVES
    if items and depth >= MAX_DEPTH:
        return False
    for item in items:
        kind = type(item)
        if kind in _PLAIN_LEAVES or (kind is int and item.bit_length() <= _MAX_INT_BITS):
            continue
        if not _is_plain(item, depth + 1):
            return False
    return True


def _refuse(value: Any) -> Any:
    raise TypeError(f"{type(value).__name__} is not JSON-serialisable")


#: The encoder of plain values, built once (``json.dumps`` with options builds a
#: ``JSONEncoder`` per call). ``encode`` is the public entry to CPython's C encoder (the
#: ``_json`` accelerator, used whenever ``indent`` is None); no circular check, since it
#: only ever sees plain values, whose depth ``_is_plain`` bounded. For a ``str`` it returns
#: the quoted JSON string, which ``_encode_many`` uses for topics and keys.
_dumps_plain = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False,
                                check_circular=False, default=_refuse).encode


def _encode(value: Any, field: str, limit: int) -> str:
    """Validate ``value`` and return its JSON text (compact, non-ASCII kept), at most
    ``limit`` UTF-8 bytes. Raises InvalidEventError naming ``field`` and the problem."""
    if _is_plain(value):
        try:
            text = _dumps_plain(value)
        except ValueError:  # NaN or an infinity: the full walk names where
            return _encode_checked(value, field, limit)
        text = _jsonb_numbers(text)
        if "\\u0000" not in text:  # else a NUL, or a literal backslash before "u0000"
            if text.isascii():
                size = len(text)
            else:
                try:
                    size = len(text.encode("utf-8"))
                except UnicodeEncodeError:  # an unpaired surrogate
                    return _encode_checked(value, field, limit)
            if size > limit:
                raise InvalidEventError(field, rules.TOO_LARGE % (size, limit))
            return text
    return _encode_checked(value, field, limit)


def make_event(
    topic: str | BaseModel,
    payload: Any = NO_PAYLOAD,
    key: str | None = None,
    headers: Mapping[str, Any] | None = None,
    *,
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
) -> EventDraft:
    """Validate one event and encode it; see :func:`publish` for the rules.

    Raises :class:`InvalidEventError` naming ``topic``, ``key``, ``payload`` or ``headers``.
    """
    return EventDraft(*_validate(topic, payload, key, headers, max_payload_bytes))


def _validate(topic: Any, payload: Any, key: Any, headers: Any, max_payload_bytes: int,
              trace: tracing.TraceHeaders | None = None) -> _Row:
    """(topic, key, payload JSON, headers JSON) of a valid event; raises InvalidEventError
    for the first problem, checking topic, key, headers' type, payload, headers in turn.
    ``trace``: the current trace context, added to the headers (:func:`_with_trace`)."""
    check_name(topic, "topic")
    if key is not None:
        check_name(key, "key", MAX_KEY_LENGTH)
    if isinstance(payload, BaseModel):
        payload = typed_events.dump(payload)
    if headers is None:
        return topic, key, _encode(payload, "payload", max_payload_bytes), \
            "{}" if trace is None else "{" + trace.members + "}"
    if type(headers) is not dict:
        if not isinstance(headers, Mapping):
            raise InvalidEventError("headers", rules.NOT_A_MAPPING % type(headers).__name__)
        headers = dict(headers)
    payload_json = _encode(payload, "payload", max_payload_bytes)  # first: problems are named in this order
    encoded = _encode(headers, "headers", MAX_HEADERS_BYTES)
    if trace is not None:
        encoded = _with_trace(encoded, headers, trace)
    return topic, key, payload_json, encoded


def _with_trace(encoded: str, headers: dict[str, Any], trace: tracing.TraceHeaders) -> str:
    """``encoded`` (the caller's valid ``headers``, JSON text) with the trace context's
    members added; unchanged when the caller set one of its keys or the result would pass
    ``MAX_HEADERS_BYTES`` (:mod:`outbox.telemetry.tracing`)."""
    if trace.taken_by(headers):
        return encoded
    if encoded == "{}":
        return "{" + trace.members + "}"
    size = len(encoded) if encoded.isascii() else len(encoded.encode("utf-8"))
    if size + len(trace.members) + 1 > MAX_HEADERS_BYTES:
        return encoded
    return encoded[:-1] + "," + trace.members + "}"


@dataclass(frozen=True, slots=True)
class PublishOptions:
    """Validated publish options of one event (each None when not given): ``run_at`` in UTC,
    ``delay`` in seconds, ``priority``, ``dedup_key``."""

    run_at: datetime | None
    delay: float | None
    priority: int | None
    dedup_key: str | None


def check_options(run_at: Any = None, delay: Any = None, dedup_key: Any = None,
                  priority: Any = None) -> PublishOptions | None:
    """Validate the publish options of :func:`publish`; None when none is given.

    Raises :class:`InvalidEventError` naming ``run_at`` (not a ``datetime``, or naive),
    ``delay`` (not a number of seconds in 0..``MAX_DELAY_SECONDS``, or given with
    ``run_at``), ``dedup_key`` (not a non-empty ``str`` of at most ``MAX_DEDUP_KEY_LENGTH``
    characters without NUL) or ``priority`` (not an ``int`` in -1000..1000)."""
    if run_at is None and delay is None and dedup_key is None and priority is None:
        return None
    if run_at is not None:
        if not isinstance(run_at, datetime):
            raise InvalidEventError("run_at", rules.NOT_A_DATETIME % type(run_at).__name__)
        if run_at.tzinfo is None or run_at.utcoffset() is None:
            raise InvalidEventError("run_at", rules.NAIVE_DATETIME)
        if delay is not None:
            raise InvalidEventError("delay", rules.DELAY_WITH_RUN_AT)
        try:
            run_at = run_at.astimezone(UTC)
        except OverflowError:  # within a day of datetime's year 1 or 9999, past them in UTC
            raise InvalidEventError("run_at", rules.RUN_AT_RANGE) from None
    if delay is not None:
        if isinstance(delay, bool) or not isinstance(delay, (int, float)):
            raise InvalidEventError("delay", rules.NOT_SECONDS % type(delay).__name__)
        if not (0 <= delay <= MAX_DELAY_SECONDS and math.isfinite(delay)):  # range first: 10**400 has no float
            raise InvalidEventError("delay", rules.DELAY_RANGE)
        delay = float(delay)
    if dedup_key is not None:
        check_name(dedup_key, "dedup_key", MAX_DEDUP_KEY_LENGTH)
    if priority is not None:
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidEventError("priority", rules.NOT_AN_INT % type(priority).__name__)
        if not -MAX_EVENT_PRIORITY <= priority <= MAX_EVENT_PRIORITY:
            raise InvalidEventError("priority", rules.PRIORITY_RANGE % priority)
        priority = int(priority)
    return PublishOptions(run_at, delay, priority, dedup_key)


# The type checker's view: a sync session gets the id, an async one an awaitable of it.
@overload
def publish(
    session: Session | Connection | psycopg.Connection[Any],
    topic: str | BaseModel,
    payload: Any = NO_PAYLOAD,
    key: str | None = None,
    headers: Mapping[str, Any] | None = None,
    *,
    run_at: datetime | None = None,
    delay: float | None = None,
    dedup_key: str | None = None,
    priority: int | None = None,
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
    schema: str | None = None,
) -> int: ...


@overload
def publish(
    session: AsyncSession | AsyncConnection | psycopg.AsyncConnection[Any],
    topic: str | BaseModel,
    payload: Any = NO_PAYLOAD,
    key: str | None = None,
    headers: Mapping[str, Any] | None = None,
    *,
    run_at: datetime | None = None,
    delay: float | None = None,
    dedup_key: str | None = None,
    priority: int | None = None,
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
    schema: str | None = None,
) -> Coroutine[Any, Any, int]: ...


def publish(
    session: Session | Connection | AsyncSession | AsyncConnection | psycopg.Connection[Any]
    | psycopg.AsyncConnection[Any],
    topic: str | BaseModel,
    payload: Any = NO_PAYLOAD,
    key: str | None = None,
    headers: Mapping[str, Any] | None = None,
    *,
    run_at: datetime | None = None,
    delay: float | None = None,
    dedup_key: str | None = None,
    priority: int | None = None,
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
    schema: str | None = None,
) -> Any:
    """Write one event in ``session``'s current transaction; never commits.

    ``session`` is a SQLAlchemy ``Session`` or Core ``Connection`` or a psycopg
    ``Connection`` (returns the new event id, an ``int``), or an ``AsyncSession`` /
    ``AsyncConnection`` (SQLAlchemy's, on psycopg or asyncpg) or a psycopg
    ``AsyncConnection`` (returns an awaitable of the id: ``await publish(...)``). On a
    psycopg connection the event is written in its current transaction (psycopg opens one
    at the first statement unless the connection is in autocommit mode, where each call
    commits by itself: use ``with conn.transaction():``); rows are read with a row factory
    of publish's own, whatever the connection's. ``topic`` is a non-empty ``str`` of at most 255
    characters; ``key`` (optional, at most 1,024 characters) names the aggregate the event
    is about; ``payload`` is JSON (see the module notes) of at most ``max_payload_bytes``
    encoded bytes (default 1 MiB); ``headers`` an optional JSON object of at most 64 KiB.
    No string anywhere may contain ``\\u0000`` (PostgreSQL's ``jsonb`` and ``text`` refuse it).

    ``payload`` may be a pydantic model, dumped in JSON mode and checked against its model;
    a model that names its topic (``__topic__ = "order.placed"``) may stand for both:
    ``publish(session, OrderPlaced(order_id=4), key="order:4")`` (:mod:`outbox.typed_events`).

    Options, all None by default:

    * ``run_at``: an aware ``datetime``; the event's jobs are not claimable before it.
      ``delay``: seconds (0..100 years) after ``now()`` of the database, i.e. after the start
      of the publishing transaction. At most one of the two.
    * ``dedup_key``: at most 255 characters. While a retained event (not yet pruned) of the
      same ``topic`` has this key, nothing is written and that event's id is returned. A
      concurrent transaction that wrote the key and has not committed makes this call wait
      for it (READ COMMITTED: its id once it commits, a new event if it rolls back; under
      REPEATABLE READ or SERIALIZABLE PostgreSQL raises a serialization failure, SQLSTATE
      40001, when that transaction committed after this one's snapshot).
    * ``priority``: an ``int`` in -1000..1000 added to each subscription's priority in the
      event's jobs (lower runs first).

    A handler receives what was published, with one exception: ints arrive as ints and
    finite floats as floats of the same value (a float of magnitude 1e16 or more is written
    as ``10000000000000000.0``, not ``1e+16``, so ``jsonb`` does not turn it into an int; it
    counts towards ``max_payload_bytes`` at that length, up to 312 bytes), but ``-0.0``
    arrives as ``0.0``: ``jsonb`` numbers have no negative zero (module notes).

    With OpenTelemetry's API installed and a span current, the headers also carry the
    current trace context (W3C ``traceparent`` / ``tracestate``, by the global propagator)
    unless they already hold it; the job's span is then its child (:mod:`outbox.telemetry.tracing`).

    ``schema`` names the schema of outbox's tables; None (the default) means the process
    default: ``OUTBOX_SCHEMA`` from the environment, else ``public``, read on the first
    publish and remembered (:func:`outbox.settings.default_schema`). Pass it to publish into
    another schema (several outboxes in one database: one per tenant, say).

    Raises :class:`~outbox.errors.InvalidEventError` before anything is written; the
    transaction stays usable. Raises :class:`~outbox.errors.ConfigurationError` for an
    invalid schema name, also before anything is written. Raises
    :class:`~outbox.errors.SchemaNotReadyError` when outbox's tables do not exist in the
    schema (the transaction is then aborted, as after any failed statement). Other
    database errors propagate as SQLAlchemy raises them.
    """
    if isinstance(topic, BaseModel) or payload is NO_PAYLOAD:
        topic, payload = typed_events.topic_and_payload(topic, payload, NO_PAYLOAD)
    topic, key, payload_json, headers_json = _validate(topic, payload, key, headers, max_payload_bytes,
                                                       tracing.current_headers() if tracing.ENABLED else None)
    statements = queries.in_schema(schema)
    if isinstance(session, (psycopg.Connection, psycopg.AsyncConnection)):
        options = check_options(run_at, delay, dedup_key, priority)
        plan = _publish_one_plan(topic, key, payload_json, headers_json, options, statements)
        return _run_on_psycopg(session, plan, statements)
    if run_at is None and delay is None and dedup_key is None and priority is None:
        params = {"topic": topic, "key": key, "payload": payload_json, "headers": headers_json}
        if isinstance(session, (AsyncSession, AsyncConnection)):
            return _publish_async(session, params, statements)
        _check_session(session)
        with _schema_hint(statements):
            return session.execute(statements.event_insert, params).scalar_one()
    options = check_options(run_at, delay, dedup_key, priority)
    assert options is not None
    plan = _publish_one_plan(topic, key, payload_json, headers_json, options, statements)
    if isinstance(session, (AsyncSession, AsyncConnection)):
        return _run_plan_async(session, plan, statements)
    _check_session(session)
    return _run_plan(session, plan, statements)


async def _publish_async(session: AsyncSession | AsyncConnection, params: dict[str, Any],
                         statements: queries.Statements) -> int:
    with _schema_hint(statements):
        result = await session.execute(statements.event_insert, params)
    event_id: int = result.scalar_one()
    return event_id


@contextlib.contextmanager
def _schema_hint(statements: queries.Statements) -> Iterator[None]:
    """Say "run outbox-relay migrate" when the events table (or its schema) does not exist."""
    try:
        yield
    except (ProgrammingError, psycopg.errors.UndefinedTable, psycopg.errors.InvalidSchemaName) as exc:
        cause = exc.orig if isinstance(exc, ProgrammingError) else exc
        # psycopg's errors and SQLAlchemy's asyncpg adapter's carry the SQLSTATE
        if getattr(cause, "sqlstate", None) in _MISSING_TABLE_OR_SCHEMA:
            from outbox.db.migrate import migrate_command

            raise SchemaNotReadyError(f"table {statements.schema}.outbox_events does not exist; "
                                      f"run `{migrate_command(statements.schema)}`") from exc
        raise


#: SQLSTATEs of undefined_table and invalid_schema_name.
_MISSING_TABLE_OR_SCHEMA = frozenset({"42P01", "3F000"})


# A plan is a generator that yields the statements to run (statement, parameters), receives
# each one's rows and returns the result: one body for sync and async sessions.
_Plan = Generator[tuple[TextClause, dict[str, Any]], Sequence[Any], Any]  # rows: Row or psycopg's named tuples

#: Tries of a dedup publish whose conflicting event is pruned before it is looked up.
_DEDUP_TRIES = 3


#: The statements' text for psycopg's own connections: SQLAlchemy's ``:name`` placeholders
#: compiled to psycopg's ``%(name)s`` (and a literal ``%`` doubled) once per statement, by
#: the dialect SQLAlchemy's own psycopg sessions use; keyed by the statement's identity
#: (statements live as long as the process, :func:`outbox.db.queries.in_schema`).
_PSYCOPG_TEXT: dict[int, tuple[TextClause, str]] = {}
_PSYCOPG_DIALECT = PGDialect_psycopg()  # type: ignore[no-untyped-call]  # SQLAlchemy's own is untyped


def _psycopg_text(statement: TextClause) -> str:
    known = _PSYCOPG_TEXT.get(id(statement))
    if known is None or known[0] is not statement:
        known = (statement, str(statement.compile(dialect=_PSYCOPG_DIALECT)))
        _PSYCOPG_TEXT[id(statement)] = known
    return known[1]


def _run_on_psycopg(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any], plan: _Plan,
                    statements: queries.Statements) -> Any:
    """Run ``plan`` on a psycopg connection, in its current transaction (or, in autocommit
    mode, statement by statement); rows are read as named tuples whatever the connection's
    row factory."""
    if isinstance(conn, psycopg.AsyncConnection):
        return _run_on_psycopg_async(conn, plan, statements)
    with _schema_hint(statements), conn.cursor(row_factory=namedtuple_row) as cursor:
        statement, params = next(plan)
        while True:
            rows = cursor.execute(_psycopg_text(statement), params).fetchall()
            try:
                statement, params = plan.send(rows)
            except StopIteration as done:
                return done.value


async def _run_on_psycopg_async(conn: psycopg.AsyncConnection[Any], plan: _Plan,
                                statements: queries.Statements) -> Any:
    with _schema_hint(statements):
        async with conn.cursor(row_factory=namedtuple_row) as cursor:
            statement, params = next(plan)
            while True:
                await cursor.execute(_psycopg_text(statement), params)
                rows = await cursor.fetchall()
                try:
                    statement, params = plan.send(rows)
                except StopIteration as done:
                    return done.value


def _run_plan(session: Session | Connection, plan: _Plan, statements: queries.Statements) -> Any:
    with _schema_hint(statements):
        statement, params = next(plan)
        while True:
            rows = session.execute(statement, params).all()
            try:
                statement, params = plan.send(rows)
            except StopIteration as done:
                return done.value


async def _run_plan_async(session: AsyncSession | AsyncConnection, plan: _Plan,
                          statements: queries.Statements) -> Any:
    with _schema_hint(statements):
        statement, params = next(plan)
        while True:
            rows = (await session.execute(statement, params)).all()
            try:
                statement, params = plan.send(rows)
            except StopIteration as done:
                return done.value


def _publish_one_plan(topic: str, key: str | None, payload: str, headers: str, options: PublishOptions | None,
                      statements: queries.Statements) -> _Plan:
    if options is None:
        rows = yield statements.event_insert, {"topic": topic, "key": key, "payload": payload, "headers": headers}
        return rows[0].id
    params = {"topic": topic, "key": key, "payload": payload, "headers": headers, "run_at": options.run_at,
              "delay": options.delay, "priority": options.priority, "dedup_key": options.dedup_key}
    for _ in range(_DEDUP_TRIES):
        rows = yield statements.event_insert_options, params
        if rows:
            return rows[0].id
        # A retained event has the key (ON CONFLICT waited for its transaction to commit);
        # this statement's fresh snapshot sees it, unless it was pruned meanwhile.
        found = yield statements.event_dedup_lookup_many, {"topics": [topic], "dedup_keys": [options.dedup_key]}
        if found:
            return found[0].id
    raise OutboxError(f"publish with dedup_key {options.dedup_key!r}: the event holding the key was deleted "
                      f"between the insert and its lookup {_DEDUP_TRIES} times in a row")


@overload
def publish_many(
    session: Session | Connection | psycopg.Connection[Any],
    events: Iterable[Mapping[str, Any] | tuple[Any, ...] | BaseModel],
    *,
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
    schema: str | None = None,
) -> list[int]: ...


@overload
def publish_many(
    session: AsyncSession | AsyncConnection | psycopg.AsyncConnection[Any],
    events: Iterable[Mapping[str, Any] | tuple[Any, ...] | BaseModel],
    *,
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
    schema: str | None = None,
) -> Coroutine[Any, Any, list[int]]: ...


def publish_many(
    session: Session | Connection | AsyncSession | AsyncConnection | psycopg.Connection[Any]
    | psycopg.AsyncConnection[Any],
    events: Iterable[Mapping[str, Any] | tuple[Any, ...] | BaseModel],
    *,
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
    schema: str | None = None,
) -> Any:
    """Write many events in ``session``'s transaction: one statement (one round trip) for up
    to 16 Mi characters of encoded events, one more for each further 16 Mi.

    ``events`` yields mappings with keys ``topic``, ``payload`` and optionally ``key``,
    ``headers``, ``run_at``, ``delay``, ``dedup_key`` and ``priority`` (the options of
    :func:`publish`), or tuples (or lists) ``(topic, payload[, key[, headers]])``, or
    pydantic models that name their topic (a payload may be a model too, as in :func:`publish`). An item
    with any other key, a tuple of another length, or an item of any other type raises
    :class:`~outbox.errors.InvalidEventError`. Every event is validated first, by the rules
    of :func:`publish`: one bad event raises InvalidEventError (its index in the message,
    ``events[3].payload``) and none is written.

    Returns the ids in the order of ``events`` (a ``list[int]``, or an awaitable of it for
    async sessions); ascending when no event has a ``dedup_key``. An event whose
    (topic, dedup_key) a retained event already has, or an earlier event of the same call,
    gets that event's id and writes nothing (one more statement looks the retained ones
    up). Numbers are written as :func:`publish` writes them, the trace context added to each
    event's headers as :func:`publish` adds it; ``schema`` is chosen as for :func:`publish`.
    """
    batches, plan = _encode_many(events, max_payload_bytes)
    statements = queries.in_schema(schema)
    if isinstance(session, (psycopg.Connection, psycopg.AsyncConnection)):
        steps = _publish_many_plan(batches, plan, statements) if plan is not None \
            else _publish_many_plain_plan(batches, statements)
        return _run_on_psycopg(session, steps, statements)
    if plan is not None:
        steps = _publish_many_plan(batches, plan, statements)
        if isinstance(session, (AsyncSession, AsyncConnection)):
            return _run_plan_async(session, steps, statements)
        _check_session(session)
        return _run_plan(session, steps, statements)
    if isinstance(session, (AsyncSession, AsyncConnection)):
        return _publish_many_async(session, batches, statements)
    _check_session(session)
    ids: list[int] = []
    with _schema_hint(statements):
        for batch in batches:
            ids.extend(session.execute(statements.event_insert_many, {"events": batch}).scalars())
    return sorted(ids)  # ids are drawn in the order of events; RETURNING promises no order


def publish_drafts(session: Session | Connection, drafts: Sequence[EventDraft], *,
                   schema: str | None = None) -> list[int]:
    """Write events already validated by :func:`make_event` in ``session``'s transaction, as
    :func:`publish_many` writes events without options; returns their ids in the order of
    ``drafts``. For writers that validate each event on its own first (the intake: a bad
    message is rejected alone, not with its batch)."""
    _check_session(session)
    statements = queries.in_schema(schema)
    ids: list[int] = []
    rows = [f'[{_dumps_plain(d.topic)},{"null" if d.key is None else _dumps_plain(d.key)},{d.payload},{d.headers}]'
            for d in drafts]
    with _schema_hint(statements):
        start = 0
        while start < len(rows):
            size, end = 1, start
            while end < len(rows) and (end == start or size + len(rows[end]) + 1 <= MANY_BATCH_CHARS):
                size += len(rows[end]) + 1
                end += 1
            batch = f"[{','.join(rows[start:end])}]"
            ids.extend(sorted(session.execute(statements.event_insert_many, {"events": batch}).scalars()))
            start = end
    return ids


def _publish_many_plain_plan(batches: list[str], statements: queries.Statements) -> _Plan:
    """``event_insert_many`` per batch; the ids sorted (drawn in the order of events)."""
    ids: list[int] = []
    for batch in batches:
        rows = yield statements.event_insert_many, {"events": batch}
        ids.extend(row.id for row in rows)
    return sorted(ids)


async def _publish_many_async(session: AsyncSession | AsyncConnection, batches: list[str],
                              statements: queries.Statements) -> list[int]:
    ids: list[int] = []
    with _schema_hint(statements):
        for batch in batches:
            ids.extend((await session.execute(statements.event_insert_many, {"events": batch})).scalars())
    return sorted(ids)


#: Most characters of encoded events in one ``event_insert_many`` statement (an event larger
#: than this goes alone). Keeps each statement's JSON document well below PostgreSQL's
#: limits (256 MiB for a jsonb value, 1 GiB for a parameter).
MANY_BATCH_CHARS = 16 * 1024 * 1024


@dataclass(slots=True)
class _ManyPlan:
    """How the rows of a ``publish_many`` with options map back to its events.

    ``rows[b]``: the positions (indexes in ``events``) of batch ``b``'s rows, in order;
    ``dedup``: (topic, dedup_key) of each sent position that has a key, and ``first`` the
    reverse; ``same``: position -> the earlier position of the same call with the same
    (topic, dedup_key), whose id it gets (not sent); ``text``: the row of each sent position
    with a key, to send again (see ``_publish_many_plan``)."""

    count: int = 0
    rows: list[list[int]] = field(default_factory=list)
    dedup: dict[int, tuple[str, str]] = field(default_factory=dict)
    first: dict[tuple[str, str], int] = field(default_factory=dict)
    same: dict[int, int] = field(default_factory=dict)
    text: dict[int, str] = field(default_factory=dict)


def _encode_many(events: Iterable[Any], max_payload_bytes: int) -> tuple[list[str], _ManyPlan | None]:
    """Validate every event, then return the ``:events`` documents of ``event_insert_many``:
    JSON arrays of ``[topic, key, payload, headers]`` (events with options get
    ``event_insert_options_many``'s 8-element rows), each of at most ``MANY_BATCH_CHARS``
    characters unless one event alone is longer; and, when any event has options, the plan
    that maps rows back to events (else None: the plain statement and path). Raises
    InvalidEventError for the first bad event, naming ``events[index]``."""
    batches: list[str] = []
    sizes: list[int] = []  # rows per batch
    rows: list[str] = []
    size = 1  # of the document so far: "[" and each row with its "," or "]"
    plan: _ManyPlan | None = None
    positions: list[int] = []  # of the current batch's rows, once there is a plan
    index = -1
    trace = tracing.current_headers() if tracing.ENABLED else None  # one context for every event
    for index, item in enumerate(events):
        # The usual items, without options, decided inline; _fields reads (or refuses) the rest.
        kind = type(item)
        if kind is tuple and 2 <= len(item) <= 4:
            fields, options = item + (None,) * (4 - len(item)), None
        elif kind is dict and item.keys() <= _FIELDS and "topic" in item and "payload" in item:
            fields, options = (item["topic"], item["payload"], item.get("key"), item.get("headers")), None
        else:
            fields, options = _fields(item, index)
        try:
            topic, key, payload, headers = _validate(fields[0], fields[1], fields[2], fields[3], max_payload_bytes,
                                                     trace)
            checked = None if options is None else check_options(**options)
        except InvalidEventError as exc:
            raise InvalidEventError(f"events[{index}].{exc.field}", exc.problem) from None
        if checked is None:
            row = f'[{_dumps_plain(topic)},{"null" if key is None else _dumps_plain(key)},{payload},{headers}]'
        else:
            if plan is None:  # the first event with options: every earlier event was sent, in order
                plan = _ManyPlan()
                start = 0
                for n in sizes:
                    plan.rows.append(list(range(start, start + n)))
                    start += n
                positions = list(range(start, index))
            if checked.dedup_key is not None:
                pair = (topic, checked.dedup_key)
                if pair in plan.first:
                    plan.same[index] = plan.first[pair]
                    continue
                plan.first[pair] = index
                plan.dedup[index] = pair
            run_at = "null" if checked.run_at is None else f'"{checked.run_at.isoformat()}"'
            row = (f'[{_dumps_plain(topic)},{"null" if key is None else _dumps_plain(key)},{payload},'
                   f'{headers},{run_at},{"null" if checked.delay is None else repr(checked.delay)},'
                   f'{"null" if checked.priority is None else checked.priority},'
                   f'{"null" if checked.dedup_key is None else _dumps_plain(checked.dedup_key)}]')
        if rows and size + len(row) + 1 > MANY_BATCH_CHARS:
            batches.append(f"[{','.join(rows)}]")
            sizes.append(len(rows))
            if plan is not None:
                plan.rows.append(positions)
                positions = []
            rows, size = [], 1
        rows.append(row)
        size += len(row) + 1
        if plan is not None:
            positions.append(index)
            if checked is not None and checked.dedup_key is not None:
                plan.text[index] = row
    if rows:
        batches.append(f"[{','.join(rows)}]")
        if plan is not None:
            plan.rows.append(positions)
    if plan is not None:
        plan.count = index + 1
    return batches, plan


def _publish_many_plan(batches: list[str], plan: _ManyPlan, statements: queries.Statements) -> _Plan:
    """Run ``event_insert_options_many`` per batch and map the rows written back to the
    events: rows come back in no promised order, but ids are drawn in array order, so sorted
    by id they are the batch's rows in order, less those skipped for their dedup key. Those
    are looked up (``event_dedup_lookup_many``); one whose event was pruned between the two
    statements is sent again (at most ``_DEDUP_TRIES`` rounds)."""
    ids: list[int | None] = [None] * plan.count
    pending: list[int] = []  # positions whose key a retained event holds
    for batch, positions in zip(batches, plan.rows):
        written = sorted((yield statements.event_insert_options_many, {"events": batch}), key=lambda r: r.id)
        next_row = 0
        for position in positions:
            pair = plan.dedup.get(position)
            if next_row < len(written) and (pair is None or (written[next_row].topic, written[next_row].dedup_key) == pair):
                ids[position] = written[next_row].id
                next_row += 1
            else:
                pending.append(position)
    for _ in range(_DEDUP_TRIES):
        if not pending:
            break
        pairs = [plan.dedup[p] for p in pending]
        found = yield statements.event_dedup_lookup_many, {"topics": [t for t, _ in pairs],
                                                        "dedup_keys": [k for _, k in pairs]}
        held = {(r.topic, r.dedup_key): r.id for r in found}
        missing = []
        for position in pending:
            event_id = held.get(plan.dedup[position])
            if event_id is None:
                missing.append(position)
            else:
                ids[position] = event_id
        pending = []
        if missing:  # pruned between the insert and the lookup: write them after all
            document = f"[{','.join(plan.text[p] for p in missing)}]"
            rewritten = yield statements.event_insert_options_many, {"events": document}
            by_pair = {(r.topic, r.dedup_key): r.id for r in rewritten}
            for position in missing:
                event_id = by_pair.get(plan.dedup[position])
                if event_id is None:
                    pending.append(position)
                else:
                    ids[position] = event_id
    if pending:
        raise OutboxError(f"publish_many: the events holding the dedup keys of events{pending[:5]} were deleted "
                          f"between the insert and their lookup {_DEDUP_TRIES} times in a row")
    for position, first in plan.same.items():
        ids[position] = ids[first]
    return ids


_FIELDS = frozenset(("topic", "payload", "key", "headers"))
_OPTIONS = frozenset(("run_at", "delay", "dedup_key", "priority"))
_ALL_FIELDS = _FIELDS | _OPTIONS


def _fields(item: Any, index: int) -> tuple[tuple[Any, Any, Any, Any], dict[str, Any] | None]:
    """((topic, payload, key, headers), options or None) of one ``publish_many`` item; a
    missing key or headers is None, options are the mapping's option keys. Raises
    InvalidEventError naming ``events[index]`` for an item it does not understand: not a
    mapping, tuple or list; a tuple or list not of 2 to 4 items; a mapping without topic or
    payload, or with any other key."""
    kind = type(item)
    if isinstance(item, BaseModel):
        try:
            topic, payload = typed_events.topic_and_payload(item, NO_PAYLOAD, NO_PAYLOAD)
        except InvalidEventError as exc:
            raise InvalidEventError(f"events[{index}].{exc.field}", exc.problem) from None
        return (topic, payload, None, None), None
    if kind is tuple or kind is list:
        if 2 <= len(item) <= 4:
            return (*item, *(None,) * (4 - len(item))), None
        raise InvalidEventError(f"events[{index}]", f"is a {kind.__name__} of {len(item)} items; {rules.ITEM_SHAPE} "
                                                    "(use a mapping for the options)")
    if kind is dict:
        fields = item
    elif isinstance(item, Mapping):
        fields = dict(item)
    else:
        raise InvalidEventError(f"events[{index}]", f"is a {kind.__name__}; {rules.ITEM_SHAPE}")
    keys = fields.keys()
    if not keys <= _FIELDS:
        unknown = [k for k in keys if k not in _ALL_FIELDS]
        if unknown:
            raise InvalidEventError(f"events[{index}]", f"has unknown keys {', '.join(map(repr, unknown))}; {rules.ITEM_SHAPE}")
    if "topic" not in fields or "payload" not in fields:
        missing = " and ".join(k for k in ("topic", "payload") if k not in fields)
        raise InvalidEventError(f"events[{index}]", f"has no {missing}; {rules.ITEM_SHAPE}")
    base = (fields["topic"], fields["payload"], fields.get("key"), fields.get("headers"))
    if keys <= _FIELDS:
        return base, None
    return base, {k: fields[k] for k in _OPTIONS if k in fields}


def _check_session(session: Any) -> None:
    if not isinstance(session, (Session, Connection)):
        raise TypeError(
            "publish() needs a SQLAlchemy Session, AsyncSession, Connection or AsyncConnection, or a psycopg "
            f"Connection or AsyncConnection, got {type(session).__name__}")
