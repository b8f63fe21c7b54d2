"""The operator's API, the one place every operator action and query lives: what
``outbox-relay status``, ``relays``, ``jobs``, ``dead``, ``redrive``, ``blocked``, ``skip``,
``cancel``, ``retry``, ``replay``, ``purge``, ``prune``, ``subscriptions``, ``unsubscribe``,
``pause`` and ``resume`` do, as plain functions returning plain dataclasses (the command
line parses its arguments and prints them, ``--json`` dumps them, ``outbox-relay dashboard``
renders them); one job with its attempt history (``job_detail``: ``jobs show``); besides, for
the dashboard: a consumer's jobs in keyset pages (``jobs_page``: no OFFSET, nothing counted),
an event with its job for every consumer and their attempts (``event_trace``,
``events_by_key``) and jobs done per minute (``throughput``).

It builds on the db layer only (the statements, their wrappers and the rules the relay
shares: :mod:`outbox.db.retention`, :mod:`outbox.db.promotion`, :mod:`outbox.db.poison`)
and imports no module of the relay, so the dashboard does not load the job runner
(a test of the layout holds it).

Each function takes an ``Engine`` (when it commits in batches, or must commit before a
follow-up statement) or a ``Connection`` (one statement or a few, in the caller's
transaction), and works on the tables of ``schema`` (None: the process default). Every
statement is named in :mod:`outbox.db.queries`. Bad input (no such consumer, a consumer
still subscribed, events already pruned) raises :class:`~outbox.errors.AdminError` naming
what was wrong, before anything is written.

**Claimed jobs.** Nothing here overwrites a claim. ``cancel`` of a running job only sets
``cancel_requested``; the worker's own fenced statement that records the attempt (completion,
failure, snooze, release, or the reaper's) then records ``cancelled``, so a stale worker's
report afterwards matches no row (its fence or the status no longer match) and changes
nothing. A transactional handler's transaction is rolled back for it first, so a
``cancelled`` job committed nothing of its handler's; one whose transaction committed before
the cancel took its row is ``done``, and the cancel reports it so (``unchanged``). ``retry`` touches ready jobs that are not due (never claimed); ``purge`` skips
running ones.

**Cost with millions of rows** (``status``): ready, running, dead, pending and cancelled jobs
are counted exactly, each through its status's partial index, so the cost follows the
unfinished jobs, never the done ones. Done jobs, and superseded ones (a coalescing
consumer's, as many), are counted exactly only when asked
(``exact=True``) or when the jobs table holds fewer than :data:`DONE_EXACT_BELOW` rows by
the planner's estimate; otherwise ``status`` gives the table-wide estimate
(``pg_class.reltuples`` minus the exact unfinished counts) and no per-consumer figure. Events
on topics nobody subscribes to are looked for among the :data:`UNSUBSCRIBED_SCAN` most
recent retained events (a backward scan of the primary key), all of them with ``exact``.

**Replay** (:func:`replay`): the missing jobs of one consumer for retained, routed events of
its topics, in batches of ``batch`` events, each its own transaction; ``ON CONFLICT
(event_id, consumer) DO NOTHING`` makes each job exist once, whatever else runs (a second
replay, the router). An event whose job was done and already pruned gets a new job: replay
re-delivers it. It refuses, having written nothing: a consumer without a subscription; an
ordered subscription (replayed events are older than the jobs its keys hold, so they would
have to run before jobs already running or done; declare the consumer unordered to replay
it); a start before the oldest retained event (``from_event``), or a ``since`` older than
the retention window or than the oldest retained event when earlier ones existed: those
events were pruned, and a replay would silently skip them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime
from typing import Any

from sqlalchemy.engine import Connection, Engine

from outbox.db import queries, retention
from outbox.db.jobs import notify_head
from outbox.db.poison import Quarantine
from outbox.db.promotion import promote
from outbox.db.tables import RELAY_SEEN_INTERVAL
from outbox.errors import AdminError, NotBlockingError

#: Below this many rows in ``outbox_jobs`` (the planner's estimate), ``status`` counts done
#: jobs per consumer exactly (a scan of a small table).
DONE_EXACT_BELOW = 100_000
#: Most recent events ``status`` looks at for topics with no subscription (``exact``: all).
UNSUBSCRIBED_SCAN = 100_000
#: A relay not seen for this many seconds is shown as gone: three of its refresh intervals.
RELAY_SILENT_AFTER = 3 * RELAY_SEEN_INTERVAL
#: Events per replay transaction, jobs per cancel and purge transaction.
REPLAY_BATCH = 1000
CHANGE_BATCH = 5000
#: Statuses ``cancel`` acts on (a running job is asked to stop, the others are cancelled).
CANCELLABLE = ("ready", "pending", "running")


def age_text(seconds: float | None) -> str:
    """A duration for people, as ``status`` and the dashboard show lag and ages: ``4.2s``,
    ``3m05s``, ``2h10m``, ``3d04h``; ``-`` for None."""
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    if days:
        return f"{days}d{hours:02d}h"
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def as_dict(result: Any) -> dict[str, Any]:
    """A result dataclass of this module as JSON-ready data (datetimes as ISO 8601 text)."""
    def plain(value: Any) -> Any:
        if isinstance(value, datetime):
            return value.isoformat()
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value

    return {k: plain(v) for k, v in asdict(result).items()}


# --------------------------------------------------------------------------- status


@dataclass(frozen=True, slots=True)
class ConsumerStatus:
    """One consumer's jobs: counts per status (``done`` and ``superseded``: None unless
    counted exactly), ``blocked_keys`` (ordered keys held by a dead job), ``lag_seconds`` (how
    long its oldest due ready job has waited, database clock; None: none due), ``paused_at``
    and whether it still has a subscription."""

    consumer: str
    ready: int
    running: int
    dead: int
    pending: int
    cancelled: int
    done: int | None
    blocked_keys: int
    lag_seconds: float | None
    paused_at: datetime | None
    subscribed: bool
    superseded: int | None = None


@dataclass(frozen=True, slots=True)
class TopicCount:
    """Retained events on a topic no consumer subscribes to: how many, oldest and newest."""

    topic: str
    events: int
    oldest: datetime
    newest: datetime


@dataclass(frozen=True, slots=True)
class Status:
    """What ``outbox-relay status`` shows. ``done_exact``: whether the consumers' ``done``
    counts were taken; ``done_estimate``: the table-wide done jobs otherwise (an estimate
    from the planner's statistics). ``unsubscribed`` lists topics with no subscription among
    the ``unsubscribed_scanned`` most recent routed events (``unsubscribed_complete``: that
    was all of them)."""

    consumers: list[ConsumerStatus]
    unrouted: int
    unrouted_oldest_seconds: float | None
    unsubscribed: list[TopicCount]
    unsubscribed_scanned: int
    unsubscribed_complete: bool
    done_exact: bool
    done_estimate: int | None


def status(conn: Connection, *, exact: bool = False, schema: str | None = None) -> Status:
    """The outbox's state (see the module notes for what is exact and what it costs)."""
    statements = queries.in_schema(schema)
    table_rows = int(conn.execute(statements.job_table_reltuples).scalar_one() or 0)
    done_exact = exact or table_rows < DONE_EXACT_BELOW
    done: dict[str, int] = {}
    superseded: dict[str, int] = {}
    if done_exact:
        done = {r.consumer: r.n for r in conn.execute(statements.job_done_count_by_consumer)}
        superseded = {r.consumer: r.n for r in conn.execute(statements.job_superseded_count_by_consumer)}
    consumers = [replace(c, done=done.get(c.consumer, 0), superseded=superseded.get(c.consumer, 0)) if done_exact
                 else c for c in consumer_statuses(conn, schema=schema)]
    names = {c.consumer for c in consumers}
    consumers += [ConsumerStatus(c, 0, 0, 0, 0, 0, done.get(c, 0), 0, None, None, False,  # only finished jobs left
                                 superseded.get(c, 0))
                  for c in sorted(set(done) | set(superseded)) if c not in names]
    unfinished = sum(c.ready + c.running + c.dead + c.pending + c.cancelled for c in consumers)
    unrouted = conn.execute(statements.event_unrouted_stats).one()
    limit = None if exact else UNSUBSCRIBED_SCAN
    topics = conn.execute(statements.event_unsubscribed_by_topic_list, {"limit": limit}).all()
    scanned = topics[0].scanned if topics else _scanned(conn, statements, limit)
    return Status(
        consumers=consumers, unrouted=unrouted.n,
        unrouted_oldest_seconds=None if unrouted.oldest_seconds is None else float(unrouted.oldest_seconds),
        unsubscribed=[TopicCount(t.topic, t.n, t.oldest, t.newest) for t in topics],
        unsubscribed_scanned=scanned, unsubscribed_complete=limit is None or scanned < limit,
        done_exact=done_exact, done_estimate=None if done_exact else max(0, table_rows - unfinished))


def consumer_statuses(conn: Connection, *, schema: str | None = None) -> list[ConsumerStatus]:
    """Every consumer with a subscription, a flow-control row or an unfinished, dead or
    cancelled job, by name, with its exact counts but ``done`` (None: never counted here):
    the cheap part of :func:`status`, read through the partial indexes only."""
    rows = conn.execute(queries.in_schema(schema).consumer_status_list).all()
    return [ConsumerStatus(
        r.consumer, r.ready, r.running, r.dead, r.pending, r.cancelled, None, r.blocked_keys,
        None if r.lag_seconds is None else max(0.0, float(r.lag_seconds)), r.paused_at, r.subscribed)
        for r in rows]


def _scanned(conn: Connection, statements: Any, limit: int | None) -> int:
    """How many routed events the unsubscribed-topic scan looked at (when it found none)."""
    return int(conn.execute(statements.event_recent_routed_count, {"limit": limit}).scalar_one())


# --------------------------------------------------------------------------- relays


@dataclass(frozen=True, slots=True)
class RelayStatus:
    """One relay of the registry: its id (``host:pid:suffix``), host, pid, outbox version,
    consumers, concurrency (None: written by an older relay), when it started and was last
    seen, ``silent_seconds`` since then, its buffered claims and running jobs, and ``gone``:
    not seen for longer than the threshold (killed, or cut off from the database); the
    pruner forgets such a row once no job runs under it."""

    id: str
    host: str
    pid: int
    version: str | None
    consumers: list[str] | None
    concurrency: int | None
    started_at: datetime
    last_seen_at: datetime
    silent_seconds: float
    buffered: int
    running: int
    gone: bool


def relays(conn: Connection, *, gone_after: float = RELAY_SILENT_AFTER, schema: str | None = None,
           ) -> list[RelayStatus]:
    """The relay registry (``outbox_relays``), oldest first; a relay silent for more than
    ``gone_after`` seconds (default three refresh intervals) is marked ``gone``. Only relays
    that run job handlers register (``run`` with ``--app``)."""
    if not gone_after > 0 or math.isinf(gone_after):
        raise AdminError(f"gone_after must be a positive number of seconds, got {gone_after!r}")
    rows = conn.execute(queries.in_schema(schema).relay_list).all()
    return [RelayStatus(r.id, r.host, r.pid, r.version, list(r.consumers) if r.consumers is not None else None,
                        r.concurrency, r.started_at, r.last_seen_at, float(r.silent_seconds), r.buffered,
                        r.running, float(r.silent_seconds) > gone_after) for r in rows]


# --------------------------------------------------------------------------- cancel


@dataclass(frozen=True, slots=True)
class CancelResult:
    """``cancelled``: ids now ``cancelled`` (they were ready or pending); ``requested``: ids
    of running jobs asked to stop (recorded ``cancelled`` when their attempt ends);
    ``promoted``: ordered jobs that became ready because a cancelled job no longer holds
    their key back; ``unchanged``: of the ids asked for by id, those that exist and were
    left alone, with their status (``done``: the job finished first, e.g. its handler's
    transaction committed before the cancel could take its row; ``dead``; ``cancelled``; a
    status left out of ``statuses``; ``running`` when already asked to stop). An id in none
    of these is no job (never created, or pruned)."""

    cancelled: list[int] = field(default_factory=list)
    requested: list[int] = field(default_factory=list)
    promoted: list[int] = field(default_factory=list)
    unchanged: dict[int, str] = field(default_factory=dict)


def _one_target(ids: Sequence[int] | None, consumer: str | None, command: str) -> list[int] | None:
    if (ids is None or not list(ids)) and consumer is None:
        raise AdminError(f"{command} needs job ids or a consumer")
    if ids is not None and list(ids):
        bad = [i for i in ids if not 1 <= i <= 2**63 - 1]
        if bad:
            raise AdminError(f"{command}: not a job id: {bad[0]}")
        return list(ids)
    return None


def job_consumer(conn: Connection, job_id: int, *, schema: str | None = None) -> str | None:
    """The consumer job ``job_id`` belongs to; None when there is no such job (never
    created, or pruned)."""
    return conn.execute(queries.in_schema(schema).job_consumer_get, {"id": job_id}).scalar_one_or_none()


def cancel(engine: Engine, ids: Sequence[int] | None = None, consumer: str | None = None, *,
           statuses: Sequence[str] = CANCELLABLE, batch: int = CHANGE_BATCH,
           schema: str | None = None) -> CancelResult:
    """Cancel the jobs ``ids``, or those of ``consumer`` (both: only those of the ``ids`` that
    are jobs of ``consumer``, in the same statement), whose status is in ``statuses`` (of
    :data:`CANCELLABLE`): ready and pending ones become ``cancelled`` at once, running ones
    get ``cancel_requested`` (see the module notes). ``batch`` jobs per transaction; then the
    ordered keys the cancelled jobs held are promoted. Jobs in other statuses (done, dead,
    already cancelled) are left alone, and when given by id reported with their status
    (:attr:`CancelResult.unchanged`). Raises :class:`AdminError` for neither ``ids`` nor
    ``consumer``, or an unknown status."""
    target = _one_target(ids, consumer, "cancel")
    unknown = sorted(set(statuses) - set(CANCELLABLE))
    if unknown or not statuses:
        raise AdminError(f"cancel: status must be among {', '.join(CANCELLABLE)}, got {', '.join(unknown) or 'none'}")
    statements = queries.in_schema(schema)
    result = CancelResult()
    keys: list[tuple[str, str]] = []
    while True:
        with engine.begin() as conn:
            rows = conn.execute(statements.job_cancel_many, {
                "ids": target, "consumer": consumer, "statuses": list(statuses), "limit": batch}).all()
        for r in rows:
            (result.requested if r.status == "running" else result.cancelled).append(r.id)
            if r.status == "cancelled" and r.ordering_key is not None:
                keys.append((r.consumer, r.ordering_key))
        if len(rows) < batch:
            break
    if keys:
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            result.promoted.extend(promote(conn, keys, schema=schema))
            if result.promoted:
                notify_head(conn, schema=schema)
    left = sorted(set(target or ()) - set(result.cancelled) - set(result.requested))
    if left:
        with engine.connect() as conn:
            result.unchanged.update({r.id: r.status for r in conn.execute(statements.job_status_many, {"ids": left})})
    result.cancelled.sort()
    result.requested.sort()
    return result


# ---------------------------------------------------------------------------- retry


def retry(conn: Connection, ids: Sequence[int] | None = None, consumer: str | None = None, *,
          schema: str | None = None) -> list[int]:
    """Make ready jobs that wait to be due, due now: ``ids`` (waiting out a retry's backoff or a
    delayed publish), or every job of ``consumer`` waiting out a retry's backoff (both: only
    those of the ``ids`` that are jobs of ``consumer``, in the same statement). Attempts
    are not touched; relays are woken on commit. Returns the ids changed (sorted). Raises
    :class:`AdminError` for neither ``ids`` nor ``consumer``."""
    target = _one_target(ids, consumer, "retry")
    statements = queries.in_schema(schema)
    changed = sorted(conn.execute(statements.job_retry_due_many, {"ids": target, "consumer": consumer}).scalars())
    if changed:
        notify_head(conn, schema=schema)
    return changed


@dataclass(frozen=True, slots=True)
class RetryResult:
    """``retry``'s answer: the jobs made due (``ids``) and the ids asked for that were not
    (``unchanged``: no such job, or not a ready job waiting to be due)."""

    ids: list[int]
    unchanged: list[int]


# --------------------------------------------------------------------------- replay


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """A replay to ``consumer`` on ``topics``: ``created`` jobs (events that had one already
    were passed over), ``scanned`` events looked at, in ``batches`` transactions, over event ids
    ``first_id`` to ``last_id`` (the newest retained when it started)."""

    consumer: str
    topics: list[str]
    created: int
    scanned: int
    batches: int
    first_id: int
    last_id: int


def replay(engine: Engine, consumer: str, *, since: datetime | None = None, from_event: int | None = None,
           until: datetime | None = None, until_event: int | None = None, topic: str | None = None,
           retention_events: float | None = None, batch: int = REPLAY_BATCH,
           schema: str | None = None) -> ReplayResult:
    """Create the missing jobs of ``consumer`` for the retained, routed events of its topics
    (``topic``: only that one) from ``since`` (creation time, inclusive) or from event id
    ``from_event`` (inclusive), to ``until`` (exclusive) and/or ``until_event`` (inclusive),
    ``batch`` events per transaction (see the module notes). ``retention_events`` (seconds:
    the relays' events retention) bounds how far back ``since`` may go. Raises
    :class:`AdminError`, before writing, for a bad window, a consumer without subscription or
    with an ordered one, a topic it does not subscribe to, or events already pruned."""
    if (since is None) == (from_event is None):
        raise AdminError("replay needs a start: --since TIME or --from-event ID (one of them)")
    if from_event is not None and from_event < 1:
        raise AdminError(f"replay: --from-event must be an event id (1 or more), got {from_event}")
    if (since is not None and since.tzinfo is None) or (until is not None and until.tzinfo is None):
        raise AdminError("replay: times need a UTC offset (2026-01-31T12:00:00+00:00)")
    if since is not None and until is not None and until <= since:
        raise AdminError(f"replay: --until ({until.isoformat()}) is not after --since ({since.isoformat()})")
    if from_event is not None and until_event is not None and until_event < from_event:
        raise AdminError(f"replay: --until-event {until_event} is before --from-event {from_event}")
    if batch < 1:
        raise AdminError(f"replay: batch must be at least 1, got {batch}")
    statements = queries.in_schema(schema)
    with engine.begin() as conn:
        subscriptions = conn.execute(statements.subscription_topics_of, {"consumer": consumer}).all()
        if not subscriptions:
            raise AdminError(f"replay: consumer {consumer!r} has no subscription (a relay declaring it writes "
                             "them when it starts): nothing to replay to")
        topics = [s.topic for s in subscriptions]
        if topic is not None:
            if topic not in topics:
                raise AdminError(f"replay: consumer {consumer!r} does not subscribe to topic {topic!r} "
                                 f"(it subscribes to {', '.join(topics)})")
            topics = [topic]
        ordered = [s.topic for s in subscriptions if s.ordered and s.topic in topics]
        if ordered:
            raise AdminError(f"replay: consumer {consumer!r} is ordered on {', '.join(ordered)}: replayed events are "
                             "older than the jobs its keys hold and would run out of order; replay refused "
                             "(declare it unordered first, or replay another consumer)")
        bounds = conn.execute(statements.event_retained_bounds).one()
    if bounds.first_id is None:
        raise AdminError("replay: no event is retained (none published, or all pruned)")
    if from_event is not None:
        if from_event < bounds.first_id:
            raise AdminError(f"replay: events from {from_event} to {bounds.first_id - 1} are no longer retained "
                             f"(pruned); the oldest retained event is {bounds.first_id}, created "
                             f"{bounds.first_created_at.isoformat()}: replay --from-event {bounds.first_id} at the "
                             "earliest")
        if from_event > bounds.last_id:
            raise AdminError(f"replay: no event from {from_event} on (the newest is {bounds.last_id})")
    if since is not None:
        if retention_events is not None and (bounds.now - since).total_seconds() > retention_events:
            raise AdminError(f"replay: --since {since.isoformat()} is older than the events retention "
                             f"({retention_events:g} s, OUTBOX_RETENTION_EVENTS): events that old may have been "
                             "pruned; replay from a later time")
        if bounds.first_created_at > since and bounds.first_id > 1:
            raise AdminError(f"replay: the oldest retained event ({bounds.first_id}, created "
                             f"{bounds.first_created_at.isoformat()}) is newer than --since {since.isoformat()} and "
                             "earlier events existed: they were pruned; replay --from-event "
                             f"{bounds.first_id} to take what is retained")
    after = (from_event - 1) if from_event is not None else 0
    last = bounds.last_id if until_event is None else min(until_event, bounds.last_id)
    created = scanned = batches = 0
    while True:
        with engine.begin() as conn:
            row = conn.execute(statements.job_replay_many, {
                "after": after, "last": last, "topics": topics, "since": since, "until": until,
                "consumer": consumer, "limit": batch}).one()
        batches += 1
        created += row.created
        scanned += row.scanned
        if row.last_id is None or row.scanned < batch:
            break
        after = row.last_id
    first = from_event if from_event is not None else bounds.first_id
    return ReplayResult(consumer, topics, created, scanned, batches, first, last)


# ---------------------------------------------------------------------------- purge


@dataclass(frozen=True, slots=True)
class PurgeResult:
    """Jobs of ``consumer`` deleted, and how many running ones were left (a relay still runs
    them; purge again once they finished)."""

    consumer: str
    deleted: int
    running: int


def purge(engine: Engine, consumer: str, *, batch: int = CHANGE_BATCH, schema: str | None = None) -> PurgeResult:
    """Delete the jobs of ``consumer``, which must have no subscription left (what
    ``outbox-relay unsubscribe`` leaves behind), ``batch`` per transaction, every status but
    running. Raises :class:`AdminError`, having deleted nothing, while it still has a
    subscription."""
    statements = queries.in_schema(schema)
    with engine.begin() as conn:
        topics = [s.topic for s in conn.execute(statements.subscription_topics_of, {"consumer": consumer})]
    if topics:
        raise AdminError(f"purge: consumer {consumer!r} still subscribes to {', '.join(topics)}; run "
                         f"`outbox-relay unsubscribe {consumer}` first (and stop the relays that declare it)")
    deleted = 0
    while True:
        with engine.begin() as conn:
            n = len(conn.execute(statements.job_purge_many, {"consumer": consumer, "limit": batch}).all())
        deleted += n
        if n < batch:
            break
    with engine.begin() as conn:
        running = conn.execute(statements.job_running_count_of, {"consumer": consumer}).scalar_one()
    return PurgeResult(consumer, deleted, running)


# ---------------------------------------------------------------------------- prune


@dataclass(frozen=True, slots=True)
class PruneResult:
    """Rows pruned: done, cancelled and superseded ``jobs``, finished ``events``, forgotten ``relays``."""

    jobs: int
    events: int
    relays: int


def prune_now(engine: Engine, *, done_older_than: float, events_older_than: float,
              relays_older_than: float = retention.RELAY_GONE_AFTER, schema: str | None = None) -> PruneResult:
    """Prune now, by the relay's pruner's rules (:func:`outbox.db.retention.prune`, then
    :func:`outbox.db.retention.prune_relays`), in rounds of ``retention.PRUNE_BATCH`` rows
    each its own transaction, until a round finds nothing more to delete."""
    jobs = events = 0
    quarantine = Quarantine("row")
    while True:
        with engine.begin() as conn:
            j, e = retention.prune(conn, done_older_than, events_older_than, quarantine=quarantine, schema=schema)
        jobs, events = jobs + j, events + e
        if j < retention.PRUNE_BATCH and e < retention.PRUNE_BATCH:
            break
    with engine.begin() as conn:
        gone = retention.prune_relays(conn, relays_older_than, schema=schema)
    return PruneResult(jobs, events, gone)


# ---------------------------------------------------------------------- redrive, pause


def redrive(conn: Connection, ids: Sequence[int] | None = None, consumer: str | None = None, *,
            every: bool = False, schema: str | None = None) -> list[int]:
    """Put dead jobs back to ``ready`` with a fresh attempt budget (``outbox-relay redrive``):
    the ones in ``ids``, or every dead job of ``consumer`` (both: only those of the ``ids``
    that are jobs of ``consumer``, in the same statement), or with ``every`` and neither,
    every dead job (``--all``); relays are woken on commit. Returns the ids redriven
    (sorted); jobs that are not dead are left alone; ``last_error`` is kept until the next
    failure, and the attempt history is kept (the next attempt is numbered 1 again). Raises
    :class:`AdminError` for neither ``ids`` nor ``consumer`` without ``every``."""
    target = None if every and not ids and consumer is None else _one_target(ids, consumer, "redrive")
    changed = sorted(conn.execute(queries.in_schema(schema).job_redrive_many,
                                  {"ids": target, "consumer": consumer}).scalars())
    if changed:
        notify_head(conn, schema=schema)
    return changed


@dataclass(frozen=True, slots=True)
class DeadJob:
    """A dead job (``outbox-relay dead``): its event, consumer, attempts of ``max_attempts``,
    ``snoozes`` (not counted), when it died and its last error (type, message, bounded
    traceback)."""

    id: int
    event_id: int
    consumer: str
    attempts: int
    max_attempts: int
    snoozes: int
    finished_at: datetime | None
    last_error: str | None


def dead_jobs(conn: Connection, consumer: str | None = None, limit: int = 100, *,
              schema: str | None = None) -> list[DeadJob]:
    """Dead jobs, of ``consumer`` or of all, oldest first (by id), at most ``limit``; read
    through ``ix_outbox_jobs_dead``."""
    rows = conn.execute(queries.in_schema(schema).job_dead_list, {"consumer": consumer, "limit": limit})
    return [DeadJob(**r._asdict()) for r in rows]


@dataclass(frozen=True, slots=True)
class BlockedKey:
    """One blocked key: ``consumer``, ``key``, the dead job holding it (``job_id``), since when
    (``since``, its ``finished_at``) and how many ``pending`` jobs wait behind it."""

    consumer: str
    key: str
    job_id: int
    since: datetime | None
    pending: int


def blocked_keys(conn: Connection, consumer: str | None = None, limit: int = 100, *,
                 schema: str | None = None) -> list[BlockedKey]:
    """The ordered keys blocked by a dead job (``on_dead='block'``; ``outbox-relay
    blocked``), of ``consumer`` or of all, longest blocked first, at most ``limit``."""
    rows = conn.execute(queries.in_schema(schema).job_ordering_blocked_list,
                        {"consumer": consumer, "limit": limit}).all()
    return [BlockedKey(r.consumer, r.key, r.job_id, r.since, r.pending) for r in rows]


def skip_dead_job(engine: Engine, job_id: int, *, schema: str | None = None) -> list[int]:
    """Let the key blocked by dead job ``job_id`` go on (``outbox-relay skip``): the job drops
    its ordering key (it stays dead) and, once that committed, the key's next job is
    promoted (architecture notes, "Ordering"). Returns the ids promoted (empty when nothing
    waited). Raises :class:`~outbox.errors.NotBlockingError`, having written nothing, when
    ``job_id`` is not a dead job holding an ordered key (no such job, another status, already
    skipped or unordered)."""
    statements = queries.in_schema(schema)
    with engine.begin() as conn:
        row = conn.execute(statements.job_ordering_skip, {"id": job_id}).one_or_none()
        if row is None:
            found = conn.execute(statements.job_ordering_get, {"id": job_id}).one_or_none()
            if found is None:
                raise NotBlockingError(f"job {job_id}: no such job")
            if found.status != "dead":
                raise NotBlockingError(f"job {job_id} ({found.consumer}) is {found.status}, not dead: only a dead "
                                       "job blocks its key")
            raise NotBlockingError(f"job {job_id} ({found.consumer}) is dead but holds no ordering key (unordered, "
                                   "on_dead='skip', or already skipped): it blocks nothing")
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        return promote(conn, [(row.consumer, row.ordering_key)], schema=schema)


@dataclass(frozen=True, slots=True)
class PauseResult:
    """``pause`` or ``resume`` of ``consumer``: ``paused_at`` (when it is paused now; None:
    it runs), ``was_paused_at`` (when it had been paused before; None: it was not) and
    ``known`` (False: ``resume`` of a consumer nobody declared nor paused; nothing changed),
    ``created`` (``pause`` of a consumer no relay declared yet: its row was made now)."""

    consumer: str
    paused_at: datetime | None
    was_paused_at: datetime | None
    known: bool = True
    created: bool = False


def pause(conn: Connection, consumer: str, *, schema: str | None = None) -> PauseResult:
    """Pause ``consumer`` on every relay (``outbox-relay pause``; architecture notes, "Flow
    control"): once this commits no claim takes its jobs; routing goes on, jobs already
    claimed finish. A consumer no relay declared yet gets its row, so it starts paused."""
    row = conn.execute(queries.in_schema(schema).consumer_pause, {"consumer": consumer}).one()
    return PauseResult(consumer, row.paused_at, row.was_paused_at, created=row.created)


def resume(conn: Connection, consumer: str, *, schema: str | None = None) -> PauseResult:
    """Resume a paused ``consumer`` (``outbox-relay resume``): relays claim its jobs again,
    woken on commit."""
    row = conn.execute(queries.in_schema(schema).consumer_resume, {"consumer": consumer}).one_or_none()
    if row is None:
        return PauseResult(consumer, None, None, known=False)
    if row.was_paused_at is not None:
        notify_head(conn, schema=schema)
    return PauseResult(consumer, None, row.was_paused_at)


# ------------------------------------------- flow control, subscriptions, schedules


@dataclass(frozen=True, slots=True)
class FlowControl:
    """A consumer's row of flow control: paused since (None: not paused), its cap on running
    jobs across relays (``concurrency``; None: none), its rate limit in claims per second
    (None: none) and its jobs running now."""

    consumer: str
    paused_at: datetime | None
    concurrency: int | None
    rate_limit: float | None
    running: int


def flow_controls(conn: Connection, *, schema: str | None = None) -> list[FlowControl]:
    """Every consumer's flow control (the rows relays declare and ``pause`` writes), by
    name, as ``outbox-relay status`` shows them."""
    rows = conn.execute(queries.in_schema(schema).consumer_list)
    return [FlowControl(r.consumer, r.paused_at, r.concurrency, r.rate_limit, r.running) for r in rows]


@dataclass(frozen=True, slots=True)
class Subscription:
    """A (topic, consumer) pair routing uses, with the consumer's options as its relay
    declared them: ``max_attempts``, ``lease_seconds``, ``priority``, ``transactional``."""

    topic: str
    consumer: str
    max_attempts: int
    lease_seconds: float
    priority: int
    transactional: bool


def subscriptions(conn: Connection, *, schema: str | None = None) -> list[Subscription]:
    """Every subscription (``outbox-relay subscriptions``), by topic then consumer."""
    return [Subscription(**r._asdict()) for r in conn.execute(queries.in_schema(schema).subscription_list)]


def unsubscribe(conn: Connection, consumer: str, *, schema: str | None = None) -> list[str]:
    """Remove ``consumer``'s subscriptions (``outbox-relay unsubscribe``): new events stop
    producing its jobs; its existing jobs stay (``purge`` deletes them). Returns the topics
    it was subscribed to (empty: it had none). A relay still declaring it writes them again
    when it starts."""
    return list(conn.execute(queries.in_schema(schema).subscription_delete, {"consumer": consumer}).scalars())


@dataclass(frozen=True, slots=True)
class RejectedMessage:
    """A message an intake rejected (:mod:`outbox.intake`): the intake (``source``), its
    dedup ``identity``, when, why (``problem``), where it was addressed (``subject``), its
    ``headers``, its first bytes (``body``) and its full size in bytes (``body_size``)."""

    source: str
    identity: str
    taken_at: datetime
    problem: str
    subject: str | None
    headers: dict[str, Any] | None
    body: bytes | None
    body_size: int | None


def rejected_messages(conn: Connection, source: str | None = None, limit: int = 100, *,
                      schema: str | None = None) -> list[RejectedMessage]:
    """The latest ``limit`` messages intakes rejected (``outbox-relay intake rejected``), of
    intake ``source`` (None: of every intake), newest first."""
    rows = conn.execute(queries.in_schema(schema).intake_rejected_list, {"source": source, "limit": limit})
    return [RejectedMessage(**{**r._asdict(), "body": None if r.body is None else bytes(r.body)}) for r in rows]


def forget_rejected(conn: Connection, source: str, identities: Sequence[str] | None = None, *,
                    schema: str | None = None) -> list[str]:
    """Forget rejected messages of intake ``source`` (``outbox-relay intake forget``): those of
    ``identities`` (None: all). Returns the identities forgotten. A forgotten message is taken
    in again if its broker or sender delivers it again (after a fix of the intake's rules)."""
    return list(conn.execute(queries.in_schema(schema).intake_forget_rejected,
                             {"source": source, "identities": None if identities is None else list(identities)})
                .scalars())


@dataclass(frozen=True, slots=True)
class ScheduleState:
    """A schedule's row: its ``name``, ``cron`` expression and ``timezone``, the ``topic`` it
    publishes on, ``catch_up`` (missed slots published after a gap), the last slot published
    (None: none yet) and the next one."""

    name: str
    cron: str
    timezone: str
    topic: str
    catch_up: bool
    last_slot: datetime | None
    next_slot: datetime


def schedules(conn: Connection, *, schema: str | None = None) -> list[ScheduleState]:
    """Every schedule relays publish (``outbox-relay status``), by name."""
    return [ScheduleState(**r._asdict()) for r in conn.execute(queries.in_schema(schema).schedule_list)]


def database_now(conn: Connection, *, schema: str | None = None) -> datetime:
    """The database clock (``now()``: the start of ``conn``'s transaction), against which
    operator commands measure ages (``replay --since 2h``)."""
    value: datetime = conn.execute(queries.in_schema(schema).database_now).scalar_one()
    return value


# ------------------------------------------------------------------ jobs and events

#: What the dashboard pages through, per consumer.
JOB_STATUSES = ("ready", "running", "pending", "dead", "done", "cancelled", "superseded")
#: Most jobs on one page, and the most recent events a look-up by key reads.
PAGE_LIMIT = 200
KEY_SCAN = 100_000


@dataclass(frozen=True, slots=True)
class JobRow:
    """One job as the tables keep it: its event, consumer, status, priority, when it is due
    (``run_at``), attempts of ``max_attempts`` (and ``snoozes``, not counted), the fence of
    its latest claim (0: never claimed), the lease and the relay holding it (running
    jobs), the last error (type, message, bounded traceback), ``ordering_key`` (ordered
    consumers), ``cancel_requested``, created / updated / finished times."""

    id: int
    event_id: int
    consumer: str
    status: str
    priority: int
    run_at: datetime
    attempts: int
    max_attempts: int
    lease_until: datetime | None
    fence: int
    locked_by: str | None
    last_error: str | None
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None
    ordering_key: str | None
    snoozes: int
    cancel_requested: bool


@dataclass(frozen=True, slots=True)
class JobPage:
    """One keyset page of a consumer's jobs in one status, newest first; ``next_before``:
    the ``before`` of the next (older) page, None when this one is the last."""

    consumer: str
    status: str
    jobs: list[JobRow]
    next_before: int | None


def jobs_page(conn: Connection, consumer: str, status: str, *, before: int | None = None, limit: int = 50,
              schema: str | None = None) -> JobPage:
    """The jobs of ``consumer`` in ``status`` (one of :data:`JOB_STATUSES`) with ids below
    ``before`` (None: from the newest), at most ``limit`` (1 to :data:`PAGE_LIMIT`), newest
    first: keyset pagination, so a page costs the same on the millionth job as on the first
    (no OFFSET, nothing counted). Raises :class:`AdminError` for an unknown status or a
    limit out of range."""
    if status not in JOB_STATUSES:
        raise AdminError(f"jobs: status must be one of {', '.join(JOB_STATUSES)}, got {status!r}")
    if not 1 <= limit <= PAGE_LIMIT:
        raise AdminError(f"jobs: limit must be between 1 and {PAGE_LIMIT}, got {limit}")
    if before is not None and not 1 <= before <= 2**63 - 1:
        raise AdminError(f"jobs: not a job id: {before}")
    statement = getattr(queries.in_schema(schema), f"job_page_{status}")
    rows = conn.execute(statement, {"consumer": consumer, "before": 2**63 - 1 if before is None else before,
                                    "limit": limit + 1}).all()
    jobs = [JobRow(**r._asdict()) for r in rows[:limit]]
    return JobPage(consumer, status, jobs, jobs[-1].id if len(rows) > limit else None)


#: Most jobs on one page of :func:`list_jobs` (``outbox-relay jobs --limit``).
LIST_LIMIT = 1000
#: The largest job or event id (the id columns are bigint).
MAX_ID = 2**63 - 1
#: The oldest age :func:`list_jobs` takes, seconds (1,000 years: far older, the database's
#: timestamps end).
MAX_AGE = 1000 * 365 * 86400


@dataclass(frozen=True, slots=True)
class ListedJob(JobRow):
    """A job of :func:`list_jobs`: its row (:class:`JobRow`) with its event's ``topic`` and
    ``key`` (both None when the event is gone)."""

    topic: str | None
    key: str | None


@dataclass(frozen=True, slots=True)
class JobList:
    """One keyset page of :func:`list_jobs`, in ascending id order; ``next_after``: the
    ``after`` of the next page (the last id shown), None when this page is the last."""

    jobs: list[ListedJob]
    next_after: int | None


#: Seconds per unit of an age (``90s``, ``30m``, ``2h``, ``7d``).
AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def age_seconds(text: str, what: str) -> float:
    """An age as operators write it, in seconds: a number of seconds (``90``), or a number
    with ``s``, ``m``, ``h`` or ``d`` (``10m``, ``2h``). Raises :class:`AdminError`, its
    message starting with ``what`` (the flag or field), for anything else or an age over
    :data:`MAX_AGE`."""
    number, unit = (text[:-1], text[-1]) if text and text[-1] in AGE_UNITS else (text, "s")
    if not number.replace(".", "", 1).isdigit():
        raise AdminError(f"{what}: not an age: {text[:40]!r} (seconds, or a number with s, m, h or d: 10m, 2h)")
    seconds = float(number) * AGE_UNITS[unit]
    if not seconds <= MAX_AGE:
        raise AdminError(f"{what}: {text[:40]!r} is more than {MAX_AGE // (365 * 86400)} years")
    return seconds


def _check_text(value: str | None, argument: str) -> None:
    if value is not None and (not value or "\x00" in value):
        raise AdminError(f"jobs: {argument} must be a non-empty text without NUL characters, got {value!r}")


def _check_age(value: float | None, argument: str) -> None:
    if value is not None and not 0 <= value <= MAX_AGE:
        raise AdminError(f"jobs: {argument} must be a number of seconds from 0 to {MAX_AGE}, got {value!r}")


def list_jobs(conn: Connection, *, consumer: str | None = None, statuses: Sequence[str] | None = None,
              key: str | None = None, event_id: int | None = None, older_than: float | None = None,
              newer_than: float | None = None, after: int | None = None, limit: int = 50,
              schema: str | None = None) -> JobList:
    """Jobs matching every filter given (``outbox-relay jobs``), in ascending id order, one
    keyset page at a time: ``after`` (a job id; None: from the first job) starts the page
    above that id, and :attr:`JobList.next_after` is the ``after`` of the next page. Jobs
    created while an operator pages land on later pages; none is shown twice.

    Filters (None: any): ``consumer`` (a name), ``statuses`` (any of
    :data:`JOB_STATUSES`), ``key`` (the event's key), ``event_id``, and the job's age by when
    routing created it (database clock): ``older_than`` seconds or more ago, ``newer_than``
    seconds or less ago. ``limit``: jobs per page, 1 to :data:`LIST_LIMIT` (default 50).
    Cost: the statement walks jobs in id order from ``after`` until it has ``limit``
    matches (:data:`outbox.db.queries.job_list`): a filter that matches few of many jobs
    reads more rows per page.

    Raises :class:`AdminError` naming the argument, before any statement runs, for an
    unknown or empty ``statuses``, an empty name or one holding a NUL character, an id out
    of the bigint range, an age below 0 or above :data:`MAX_AGE` (or NaN), an empty age window (``newer_than``
    not above ``older_than``), or ``limit`` out of range."""
    if statuses is not None:
        unknown = [s for s in statuses if s not in JOB_STATUSES]
        if unknown or not statuses:
            raise AdminError(f"jobs: status must be among {', '.join(JOB_STATUSES)}, got "
                             f"{', '.join(map(repr, unknown)) or 'none'}")
    _check_text(consumer, "consumer")
    _check_text(key, "key")
    for argument, value in (("event_id", event_id), ("after", after)):
        if value is not None and not 1 <= value <= MAX_ID:
            raise AdminError(f"jobs: {argument} must be an id between 1 and {MAX_ID}, got {value}")
    _check_age(older_than, "older_than")
    _check_age(newer_than, "newer_than")
    if older_than is not None and newer_than is not None and newer_than <= older_than:
        raise AdminError(f"jobs: no job is both older than {older_than:g} s and newer than {newer_than:g} s")
    if not 1 <= limit <= LIST_LIMIT:
        raise AdminError(f"jobs: limit must be between 1 and {LIST_LIMIT}, got {limit}")
    rows = conn.execute(queries.in_schema(schema).job_list, {
        "after": after or 0, "consumer": consumer, "statuses": None if statuses is None else list(statuses),
        "key": key, "event_id": event_id, "older_than": older_than, "newer_than": newer_than,
        "limit": limit + 1}).all()
    jobs = [ListedJob(**r._asdict()) for r in rows[:limit]]
    return JobList(jobs, jobs[-1].id if len(rows) > limit else None)


# ------------------------------------------------------------------ attempt history

#: How an attempt may end in a job's history, each named by the status it left the job in:
#: ``failed``, ``timed out``, ``lease expired``, ``snoozed``, ``released`` (back to ready;
#: a snooze and a release are not counted), ``dead``, ``cancelled``; ``done`` and ``running``
#: are the row's own current attempt (:func:`history_of`).
ATTEMPT_OUTCOMES = ("done", "running", "failed", "timed out", "lease expired", "snoozed", "released", "dead",
                    "cancelled")
#: Most ended attempts a job's history keeps, the newest (:data:`outbox.db.queries.HISTORY_KEPT`).
HISTORY_KEPT = queries.HISTORY_KEPT


@dataclass(frozen=True, slots=True)
class Attempt:
    """One attempt of a job (architecture notes, "Attempt history"): its number
    (``attempt``, the claim's count: a snoozed or released attempt was not counted, so the next
    claim runs under the same number, and a redrive starts again from 1); when it began
    (``started_at``, when the claim took the job, database clock; None for a claim made before
    migration 0013, or for a ready job dead-lettered because its claim failed, which never
    started) and ended (``ended_at``; None while it runs); the relay that ran it (``relay``,
    its worker id ``host:pid:suffix``); how it ended (``outcome``, one of
    :data:`ATTEMPT_OUTCOMES`) and its error (``error``, as ``last_error`` keeps it: type,
    message, bounded traceback; None when it did not fail)."""

    attempt: int
    started_at: datetime | None
    ended_at: datetime | None
    relay: str | None
    outcome: str
    error: str | None


def history_of(row: Any) -> list[Attempt]:
    """The attempts of a job row (read by column name: ``history``, ``status``, ``attempts``,
    ``started_at``, ``finished_at``, ``locked_by``), oldest first: the entries ``history``
    keeps (the newest :data:`outbox.db.queries.HISTORY_KEPT`), then the row's own attempt
    when it is ``done`` (a done attempt writes no entry: the row is its record) or
    ``running`` (no end yet)."""
    attempts = [Attempt(e["attempt"], _moment(e.get("started_at")), _moment(e.get("ended_at")), e.get("relay"),
                        e["outcome"], e.get("error")) for e in row.history or ()]
    if row.status in ("done", "running"):
        attempts.append(Attempt(row.attempts, row.started_at, row.finished_at if row.status == "done" else None,
                                row.locked_by, row.status, None))
    return attempts


def _moment(text: str | None) -> datetime | None:
    """A timestamp of a history entry (``to_json`` of a ``timestamptz``: ISO 8601 with offset)."""
    return None if text is None else datetime.fromisoformat(text)


@dataclass(frozen=True, slots=True)
class JobDetail(ListedJob):
    """One job (``outbox-relay jobs show``): its row and its event's ``topic`` and ``key`` as
    :func:`list_jobs` gives them, when its current or last attempt began (``started_at``) and
    its attempts (``history``, oldest first: :func:`history_of`). ``superseded_by``: for a
    coalescing consumer, the newer event of its key that superseded the job (status
    ``superseded``), or that arrived while it ran (then it ended as its attempt did); None
    otherwise."""

    started_at: datetime | None
    superseded_by: int | None
    history: list[Attempt]


def job_detail(conn: Connection, job_id: int, *, schema: str | None = None) -> JobDetail | None:
    """Job ``job_id`` with its attempt history (:class:`JobDetail`), one statement by primary
    key; None when there is no such job (never routed, or pruned: a job's history goes with
    its row). Raises :class:`AdminError` for an id out of the bigint range."""
    if not 1 <= job_id <= MAX_ID:
        raise AdminError(f"jobs show: not a job id: {job_id}")
    row = conn.execute(queries.in_schema(schema).job_get, {"id": job_id}).one_or_none()
    if row is None:
        return None
    fields = row._asdict()
    del fields["history"]  # the JSON column: history_of reads it
    return JobDetail(**fields, history=history_of(row))


@dataclass(frozen=True, slots=True)
class EventTrace:
    """One event and where it went: topic, key, payload, headers, created and routed times
    (``routed_at`` None: not routed yet), publish options (``run_at``, ``priority``,
    ``dedup_key``); ``jobs``: its job for every consumer it was routed to, by consumer, each
    with its attempts (:class:`TracedJob`);
    ``unrouted_consumers``: consumers subscribed to its topic now that have no job of it
    (subscribed after it was routed, their job pruned, or the event not routed yet)."""

    id: int
    topic: str
    key: str | None
    payload: Any
    headers: Any
    created_at: datetime
    routed_at: datetime | None
    run_at: datetime | None
    priority: int | None
    dedup_key: str | None
    jobs: list[TracedJob]
    unrouted_consumers: list[str]


@dataclass(frozen=True, slots=True)
class TracedJob(JobRow):
    """A job of :class:`EventTrace`: its row, when its current or last attempt began
    (``started_at``) and its attempts (``history``, oldest first: :func:`history_of`)."""

    started_at: datetime | None
    history: list[Attempt]


def _traced(row: Any) -> TracedJob:
    fields = row._asdict()
    del fields["history"]
    return TracedJob(**fields, history=history_of(row))


def _trace(conn: Connection, statements: Any, row: Any) -> EventTrace:
    jobs = [_traced(r) for r in conn.execute(statements.job_list_of_event, {"event_id": row.id})]
    have = {j.consumer for j in jobs}
    subscribed = conn.execute(statements.subscription_consumers_of, {"topic": row.topic}).scalars()
    return EventTrace(**row._asdict(), jobs=jobs, unrouted_consumers=[c for c in subscribed if c not in have])


def event_trace(conn: Connection, event_id: int, *, schema: str | None = None) -> EventTrace | None:
    """Event ``event_id`` with its jobs (see :class:`EventTrace`); None when there is no such
    event (never published, or pruned). Raises :class:`AdminError` for an id out of range."""
    if not 1 <= event_id <= 2**63 - 1:
        raise AdminError(f"not an event id: {event_id}")
    statements = queries.in_schema(schema)
    row = conn.execute(statements.event_get, {"id": event_id}).one_or_none()
    return None if row is None else _trace(conn, statements, row)


def events_by_key(conn: Connection, key: str, *, limit: int = 20, scan: int = KEY_SCAN,
                  schema: str | None = None) -> list[EventTrace]:
    """The events of ``key`` with their jobs, newest first, at most ``limit``, among the
    ``scan`` most recent retained events (events are not indexed by key: the look-up stays
    bounded; an older event is found by its id)."""
    statements = queries.in_schema(schema)
    rows = conn.execute(statements.event_list_by_key, {"key": key, "limit": limit, "scan": scan}).all()
    return [_trace(conn, statements, r) for r in rows]


def throughput(conn: Connection, *, minutes: int = 10, schema: str | None = None) -> dict[str, list[int]]:
    """Jobs done per minute for each consumer that finished any over the last ``minutes``
    minutes (database clock): a list of ``minutes`` counts, oldest minute first, the current
    (partial) minute last. Reads only the jobs done in the window (``ix_outbox_jobs_finished``)."""
    if not 1 <= minutes <= 24 * 60:
        raise AdminError(f"throughput: minutes must be between 1 and {24 * 60}, got {minutes}")
    counts: dict[str, list[int]] = {}
    for r in conn.execute(queries.in_schema(schema).job_done_per_minute_list, {"minutes": minutes}):
        if 0 <= r.minutes_ago < minutes:
            counts.setdefault(r.consumer, [0] * minutes)[minutes - 1 - r.minutes_ago] += r.n
    return counts
