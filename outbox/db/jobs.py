"""The job statements' wrappers: each runs one named statement of :mod:`outbox.db.queries` and
returns what the statement changed, as :class:`~outbox.job.Job` s or as the ids / fences of
the rows it touched.

* **Claims**: :func:`claim_jobs`, :func:`complete_and_claim_after` (the runner's round: the
  completions it carries, then the claim after a key of the claim order, two statements in
  one transaction and one round trip, the relay's buffered claims listed by the claim,
  :class:`BufferMark`; :func:`complete_and_claim_rows` for the rows themselves),
  :func:`claim_candidates`, :func:`first_ready_before` (the runner's look-out); the row -> job builder :func:`job_from_row` and the claim-order
  key of a claimed row, :func:`claim_order`.
* **Outcomes of claimed jobs**: :func:`heartbeat_jobs`, :func:`complete_jobs`,
  :func:`fail_jobs`, :func:`snooze_jobs`, :func:`release_jobs`, :func:`bury_job`. Every write
  that changes a claimed job names its fence and requires ``status='running'``; a row that
  does not come back means the report was stale and changed nothing (architecture notes,
  "Statements").
* **Ready jobs and keys**: :func:`bury_ready_job`, :func:`promote_keys`, :func:`notify_head`.
* **The relay registry** (``outbox_relays``): :func:`relay_seen`, :func:`relay_buffer_remove`,
  :func:`relay_delete`, with :class:`RelayInfo`.

Each function takes either a SQLAlchemy ``Connection`` (tests, tools, the heartbeat) or a
bare psycopg ``Connection`` (the runner's dispatcher, which skips SQLAlchemy's per-statement
work on its hot path); the SQL is the same named statement either way, for the tables of
``schema`` (None: the process default, ``outbox.settings.default_schema``). The caller owns
the transaction and commits. Rows are read by column name (``row.fence``): SQLAlchemy's rows
and psycopg's named tuples (:func:`psycopg.rows.namedtuple_row`) both have them.

Two statements in one round trip. :func:`complete_and_claim_after` sends the completion and
the claim together on a psycopg connection in pipeline mode (psycopg docs, "Pipeline mode
support"): both are queued and one Sync follows, so the server runs them one after the other
in one transaction (in autocommit, the implicit transaction that the Sync ends: one commit)
and the client waits once. An error in the first aborts the second and rolls both back, as
one statement would. Where pipeline mode is missing (libpq before 14,
:data:`PIPELINE`), the two run in ``conn.transaction()``, one round trip each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import psycopg
from psycopg.rows import namedtuple_row
from sqlalchemy import TextClause
from sqlalchemy.dialects.postgresql import psycopg as psycopg_dialect
from sqlalchemy.engine import Connection

from outbox.db import queries
from outbox.db.tables import JOBS_CHANNEL, notify_channel
from outbox.job import Job

#: A connection the wrappers run on: SQLAlchemy's, or a bare psycopg one (the runner's hot path).
Executor = Connection | psycopg.Connection[Any]

_PSYCOPG_DIALECT = psycopg_dialect.dialect()  # type: ignore[no-untyped-call]  # SQLAlchemy's dialects are untyped
_COMPILED: dict[int, str] = {}


def _psycopg_sql(statement: TextClause) -> str:
    """``statement`` compiled for psycopg's paramstyle (statements are module constants or
    members of a ``queries.Statements`` kept for the life of the process: each is compiled
    once, and its ``id`` never reused)."""
    sql = _COMPILED.get(id(statement))
    if sql is None:
        sql = _COMPILED[id(statement)] = str(statement.compile(dialect=_PSYCOPG_DIALECT))
    return sql


#: Whether this psycopg can send several statements in one round trip (pipeline mode, which
#: needs libpq 14 or later); without it :func:`complete_and_claim_after` pays one per statement.
PIPELINE = psycopg.Pipeline.is_supported()


def _rows(conn: Executor, statement: TextClause, params: dict[str, Any]) -> list[Any]:
    """Run ``statement`` on ``conn`` and return its rows, read by column name (``row.id``)."""
    if isinstance(conn, psycopg.Connection):
        return conn.cursor(row_factory=namedtuple_row).execute(_psycopg_sql(statement), params).fetchall()
    return list(conn.execute(statement, params).all())


#: One statement of :func:`_rows_together`: the statement, its parameters, and whether psycopg
#: may prepare it (None: psycopg's rule, prepared from its fifth run; False: never, so the
#: server plans it for the parameters of each run).
Step = tuple[TextClause, dict[str, Any], bool | None]


def _rows_together(conn: Executor, steps: list[Step]) -> list[list[Any]]:
    """Run ``steps`` in order, in one transaction, and return the rows of each (by column
    name). On a psycopg connection they are pipelined: one round trip (see the module
    notes), or one each inside ``conn.transaction()`` without pipeline mode. A SQLAlchemy
    connection runs them one after the other in its transaction. A database error in any
    step propagates, and nothing of the steps is kept when ``conn`` is in autocommit."""
    if isinstance(conn, psycopg.Connection):
        if len(steps) == 1:  # one statement is one round trip and, in autocommit, one transaction
            statement, params, prepare = steps[0]
            return [conn.cursor(row_factory=namedtuple_row).execute(_psycopg_sql(statement), params,
                                                                   prepare=prepare).fetchall()]
        if PIPELINE:  # pipeline mode costs client CPU (psycopg's loop): only where it saves a round trip
            with conn.pipeline():
                cursors = [conn.cursor(row_factory=namedtuple_row).execute(_psycopg_sql(statement), params,
                                                                          prepare=prepare)
                           for statement, params, prepare in steps]
            return [cursor.fetchall() for cursor in cursors]
        with conn.transaction():
            return [conn.cursor(row_factory=namedtuple_row).execute(_psycopg_sql(statement), params,
                                                                   prepare=prepare).fetchall()
                    for statement, params, prepare in steps]
    return [list(conn.execute(statement, params).all()) for statement, params, _ in steps]


def _execute(conn: Executor, statement: TextClause, params: dict[str, Any]) -> int:
    """Run ``statement`` (no result rows) on ``conn``; returns its row count."""
    if isinstance(conn, psycopg.Connection):
        return conn.execute(_psycopg_sql(statement), params).rowcount
    return conn.execute(statement, params).rowcount


def job_from_row(row: Any, lease_seconds: float) -> Job:
    """A :class:`Job` from a row of ``job_claim_many`` (read by column name; payload and
    headers come as their stored JSON texts, which the job decodes on first use)."""
    return Job.from_json(row.id, row.event_id, row.consumer, row.topic, row.key, row.payload, row.headers,
                         row.attempts, row.max_attempts, row.fence, lease_seconds, row.event_created_at)


def claim_order(row: Any) -> tuple[int, Any, int]:
    """The claim-order key ``(priority, run_at, id)`` of a claimed row that returned
    ``priority`` and ``run_at`` (``job_claim_after_many``, ``job_claim_limited_many``)."""
    return (row.priority, row.run_at, row.id)


def _claim_params(leases: dict[str, float], limit: int, worker_id: str) -> dict[str, Any]:
    consumers = list(leases)
    return {"consumers": consumers, "leases": [leases[c] for c in consumers], "limit": limit, "worker": worker_id}


def claim_jobs(conn: Executor, leases: dict[str, float], limit: int, worker_id: str, *,
               schema: str | None = None) -> list[Job]:
    """Claim up to ``limit`` due jobs of the consumers in ``leases`` (consumer -> lease
    seconds) in ``conn``'s transaction; the caller commits."""
    rows = _rows(conn, queries.in_schema(schema).job_claim_many, _claim_params(leases, limit, worker_id))
    return [job_from_row(r, leases[r.consumer]) for r in rows]


#: The lowest claim-order key (priority, run_at, id): a claim "after" it starts at the head.
HEAD_KEY: tuple[int, Any, int] = (-32768, "-infinity", 0)


def complete_and_claim_jobs(conn: Executor, done: list[Job], leases: dict[str, float], limit: int,
                            worker_id: str, *, keep_done: bool = True,
                            schema: str | None = None) -> tuple[set[int], list[Job]]:
    """Mark ``done`` completed (fenced; deleted instead when ``keep_done`` is false, see
    :func:`complete_jobs`), then claim up to ``limit`` due jobs, in one transaction and one
    round trip (``job_complete_many``, ``job_claim_after_many``: module notes); returns (ids
    completed, jobs claimed). A job of ``done`` missing from the ids was a stale report and
    changed nothing."""
    completed, claimed, _ = complete_and_claim_after(conn, done, leases, limit, worker_id, None,
                                                     keep_done=keep_done, schema=schema)
    return completed, claimed


def complete_and_claim_after(conn: Executor, done: list[Job], leases: dict[str, float], limit: int,
                             worker_id: str, after: tuple[int, Any, int] | None, *,
                             buffer: BufferMark | None = None, skip: list[int] | None = None,
                             only: list[int] | None = None, keep_done: bool = True, schema: str | None = None,
                             ) -> tuple[set[int], list[Job], tuple[int, Any, int] | None]:
    """:func:`complete_and_claim_jobs` whose claim starts after the claim-order key ``after``
    (``(priority, run_at, id)``, as returned before; None: at the head of the ready jobs);
    also returns the key of the last job it claimed (None when it claimed none). The jobs
    claimed come back in claim order.

    ``buffer``, when given, is written to the relay's row by the claim (see
    :class:`BufferMark`): the first ``buffer.start_now`` jobs claimed that are not of a
    forwarder in ``buffer.forwarding`` are taken as started, the rest as buffered. The claim
    leaves out the job ids in ``skip`` and, when ``only`` is given, takes only jobs among
    those ids (:mod:`outbox.db.poison`)."""
    completed, claimed, last = complete_and_claim_rows(conn, done, leases, limit, worker_id, after, buffer=buffer,
                                                       skip=skip, only=only, keep_done=keep_done, schema=schema)
    return completed, [job_from_row(r, leases[r.consumer]) for r in claimed], last


def complete_and_claim_rows(conn: Executor, done: list[Job], leases: dict[str, float], limit: int,
                            worker_id: str, after: tuple[int, Any, int] | None, *,
                            buffer: BufferMark | None = None, skip: list[int] | None = None,
                            only: list[int] | None = None, keep_done: bool = True, schema: str | None = None,
                            ) -> tuple[set[int], list[Any], tuple[int, Any, int] | None]:
    """:func:`complete_and_claim_after` that returns the claimed jobs' rows (in claim order,
    read by column name), for a caller that keeps what the claim returned beside the job:
    ``lease_until``, ``priority`` and ``run_at`` (with the id, the claim-order key,
    :func:`claim_order`).

    ``buffer``, when given, is written to the relay's row by the claim (see
    :class:`BufferMark`). With no job in ``done`` only the claim runs, with ``limit`` 0 only
    the completion (a claim of none would change nothing). A database error of either
    propagates; in autocommit neither is then kept."""
    statements = queries.in_schema(schema)
    steps: list[Step] = []
    if done:
        # Never prepared: the generic plan PostgreSQL would settle on rates the unnested
        # (id, fence) pairs at 10 rows and joins the lock step to them by a nested loop, a
        # rescan of every pair per job (a batch of 500: 165 ms against 6 ms planned for the
        # parameters). The one statement this round replaced was planned per run too.
        steps.append((statements.job_complete_many, {**_ids_fences(done), "keep_done": keep_done}, False))
    if limit > 0:
        key = after or HEAD_KEY
        mark = buffer or BufferMark(None, 0)
        steps.append((statements.job_claim_after_many, {
            **_claim_params(leases, limit, worker_id),
            "after_priority": key[0], "after_run_at": key[1], "after_id": key[2],
            "relay": mark.relay, "start_now": mark.start_now, "forwarding": list(mark.forwarding),
            "skip": skip or [], "only": only}, None))
    results = _rows_together(conn, steps) if steps else []
    completed = {r.id for r in results[0]} if done else set()
    claimed = sorted(results[-1], key=claim_order) if limit > 0 else []
    last = claim_order(claimed[-1]) if claimed else None
    return completed, claimed, last


class _HasConsumer(Protocol):
    consumer: str


_Claimed = TypeVar("_Claimed", bound=_HasConsumer)


@dataclass(frozen=True, slots=True)
class BufferMark:
    """What a dispatcher round adds to its relay's row of ``outbox_relays`` (``relay``;
    None changes nothing): the jobs the round claims that do not start at once join the
    list of buffered claims: every job of a consumer in ``forwarding`` (a forwarder's
    attempt starts when its message is handed to the broker, issue 26), and of the others
    all but the first ``start_now`` in claim order (those go to idle workers). The reaper
    gives the attempt back to an expired claim still listed (migration 0003)."""

    relay: str | None
    start_now: int
    forwarding: frozenset[str] = frozenset()

    def starts_now(self, claimed: list[_Claimed]) -> list[_Claimed]:
        """Of ``claimed`` (in claim order), the jobs this mark did not list: the first
        ``start_now`` that are not a forwarder's."""
        return [job for job in claimed if job.consumer not in self.forwarding][:self.start_now]


def claim_candidates(conn: Executor, consumers: list[str], limit: int, skip: list[int], *,
                     schema: str | None = None) -> list[int]:
    """Ids of up to ``limit`` due ready jobs of ``consumers`` in claim order, not locked."""
    return [r.id for r in _rows(conn, queries.in_schema(schema).job_claim_candidates,
                                {"consumers": consumers, "limit": limit, "skip": skip})]


def first_ready_before(conn: Executor, before: tuple[int, Any, int], consumers: list[str], skip: list[int], *,
                       schema: str | None = None) -> tuple[int, Any, int] | None:
    """The claim-order key ``(priority, run_at, id)`` of the first due ready job of
    ``consumers`` that sorts before ``before`` and is not in ``skip`` (``job_first_ready_before``:
    the main claims' consumers only), or None. Locks nothing."""
    rows = _rows(conn, queries.in_schema(schema).job_first_ready_before,
                 {"consumers": consumers, "before_priority": before[0], "before_run_at": before[1],
                  "before_id": before[2], "skip": skip})
    return claim_order(rows[0]) if rows else None


def bury_job(conn: Executor, job: Job, error: str, *, schema: str | None = None) -> bool:
    """Dead-letter claimed ``job`` (fenced) with ``last_error`` = ``error``; True if it changed."""
    return _execute(conn, queries.in_schema(schema).job_bury, {"id": job.id, "fence": job.fence, "error": error}) == 1


def bury_ready_job(conn: Executor, job_id: int, error: str, *, schema: str | None = None) -> bool:
    """Dead-letter ready job ``job_id`` with ``last_error`` = ``error``; True if it changed."""
    return _execute(conn, queries.in_schema(schema).job_bury_ready, {"id": job_id, "error": error}) == 1


@dataclass(frozen=True, slots=True)
class RelayInfo:
    """What a relay writes about itself in the registry (``outbox_relays``, shown by
    ``outbox-relay relays``): the outbox ``version`` it runs, the ``consumers`` it has
    handlers for and its ``concurrency`` (worker slots)."""

    version: str
    consumers: tuple[str, ...]
    concurrency: int


def package_version() -> str:
    """The installed outbox-relay distribution's version ("unknown" when not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("outbox-relay")
    except PackageNotFoundError:
        return "unknown"


def relay_seen(conn: Executor, worker_id: str, buffer: list[int], *, info: RelayInfo | None = None,
               schema: str | None = None) -> None:
    """Write (or refresh) the row of relay ``worker_id`` (``host:pid:suffix``) in
    ``outbox_relays``: seen now, listing ``buffer`` (the fences it holds unstarted) and
    nothing stale (``relay_seen``), with ``info`` (None keeps what the row holds)."""
    host, _, rest = worker_id.partition(":")
    pid = rest.partition(":")[0]
    _execute(conn, queries.in_schema(schema).relay_seen, {
        "relay": worker_id, "host": host, "pid": int(pid) if pid.isdigit() else 0, "buffer": buffer,
        "version": info.version if info else None, "consumers": list(info.consumers) if info else None,
        "concurrency": info.concurrency if info else None})


def relay_buffer_remove(conn: Executor, worker_id: str, fences: list[int], *, schema: str | None = None) -> None:
    """Unlist ``fences`` from relay ``worker_id``'s buffered claims (``relay_buffer_remove``):
    their handlers are about to start."""
    _execute(conn, queries.in_schema(schema).relay_buffer_remove, {"relay": worker_id, "removed": fences})


def relay_delete(conn: Executor, worker_id: str, *, schema: str | None = None) -> None:
    """Remove relay ``worker_id``'s row of ``outbox_relays`` (a clean stop)."""
    _execute(conn, queries.in_schema(schema).relay_delete, {"relay": worker_id})


def _ids_fences(jobs: list[Job]) -> dict[str, list[int]]:
    return {"ids": [j.id for j in jobs], "fences": [j.fence for j in jobs]}


def notify_head(conn: Executor, *, schema: str | None = None) -> None:
    """Tell every relay on ``schema`` that jobs were handed back with their early place in
    the queue (``queries.jobs_notify_head``), on commit of ``conn``'s transaction."""
    channel = notify_channel(JOBS_CHANNEL, schema or "public")
    _execute(conn, queries.in_schema(schema).jobs_notify_head, {"channel": channel})


def promote_keys(conn: Executor, params: dict[str, list[str]], *, schema: str | None = None) -> list[Any]:
    """Run ``job_promote_many`` with ``params`` (``consumers``, ``keys``: the ordered keys of
    finished jobs, :func:`outbox.relay.ordering.promotion_params`); returns the rows of the
    jobs promoted (``id``, ``consumer``, ``ordering_key``, ``priority``, ``run_at``)."""
    return _rows(conn, queries.in_schema(schema).job_promote_many, params)


def heartbeat_jobs(conn: Executor, jobs: list[Job], *, schema: str | None = None) -> set[int]:
    """Renew the leases of ``jobs``; returns the fences of the claims still owned (fence and
    status match). Fences, not ids: one process may hold a job's old claim (its worker
    paused past the lease) and its new claim at once, and only the new one is owned. A job
    an operator asked to cancel gets ``job.cancel_requested`` here."""
    if not jobs:
        return set()
    params = {**_ids_fences(jobs), "leases": [j.lease_seconds for j in jobs]}
    rows = _rows(conn, queries.in_schema(schema).job_heartbeat_many, params)
    cancelled = {r.fence for r in rows if r.cancel_requested}
    for job in jobs:
        if job.fence in cancelled:
            job.mark_cancel_requested()
    return {r.fence for r in rows}


def complete_jobs(conn: Executor, jobs: list[Job], *, keep_done: bool = True, schema: str | None = None) -> set[int]:
    """Mark ``jobs`` done (fenced); returns the ids that changed. With ``keep_done`` false a
    done job's row is deleted instead (``retention_done = 0``,
    :attr:`~outbox.settings.OutboxSettings.keep_done`); one an operator asked to cancel
    is still kept, ``cancelled``."""
    if not jobs:
        return set()
    return {r.id for r in _rows(conn, queries.in_schema(schema).job_complete_many,
                                {**_ids_fences(jobs), "keep_done": keep_done})}


def release_jobs(conn: Executor, jobs: list[Job], *, schema: str | None = None) -> set[int]:
    """Hand ``jobs`` back as ready now, attempt not counted (fenced); returns changed ids."""
    if not jobs:
        return set()
    return {r.id for r in _rows(conn, queries.in_schema(schema).job_release_many, _ids_fences(jobs))}


class FailedAttempt(Protocol):
    """What :func:`fail_jobs` records of a failed attempt (the runner's
    :class:`outbox.relay.outcomes.Failure`)."""

    @property
    def delay(self) -> float:
        """Seconds until the job is ready again (unless it goes to ``dead``)."""

    @property
    def permanent(self) -> bool:
        """True: ``dead`` at once, whatever attempts are left."""

    @property
    def error(self) -> str:
        """The ``last_error`` text."""

    @property
    def timed_out(self) -> bool:
        """True: the handler ran past its timeout (the attempt's history entry says ``timed
        out`` instead of ``failed``)."""


class SnoozedAttempt(Protocol):
    """What :func:`snooze_jobs` records of a snoozed attempt (the runner's
    :class:`outbox.relay.outcomes.Snoozed`)."""

    @property
    def seconds(self) -> float:
        """Seconds until the job is ready again."""


def snooze_jobs(conn: Executor, snoozed: list[tuple[Job, SnoozedAttempt]], *, schema: str | None = None) -> set[int]:
    """Put snoozed jobs back to ready after their delay, attempt given back, ``snoozes + 1``
    (fenced, ``job_snooze_many``); returns the ids that changed."""
    if not snoozed:
        return set()
    return {r.id for r in _rows(conn, queries.in_schema(schema).job_snooze_many, {
        "ids": [j.id for j, _ in snoozed], "fences": [j.fence for j, _ in snoozed],
        "delays": [s.seconds for _, s in snoozed]})}


def fail_jobs(conn: Executor, failures: list[tuple[Job, FailedAttempt]], *, schema: str | None = None) -> dict[int, str]:
    """Record failed attempts (fenced), each appended to its job's attempt history; returns
    ``{id: new status}`` for rows that changed."""
    if not failures:
        return {}
    rows = _rows(conn, queries.in_schema(schema).job_fail_many, {
        "ids": [j.id for j, _ in failures], "fences": [j.fence for j, _ in failures],
        "delays": [f.delay for _, f in failures], "permanent": [f.permanent for _, f in failures],
        "errors": [f.error for _, f in failures], "timed_out": [f.timed_out for _, f in failures],
    })
    return {r.id: r.status for r in rows}
