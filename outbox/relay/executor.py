"""Running one claimed job's handler: the **executor** (:class:`JobExecutor`) runs it and
says how it ended (an outcome of :mod:`outbox.relay.outcomes`), for the relay's worker
threads (:mod:`outbox.relay.runner`) and :func:`outbox.testing.drain` alike; the statement
that records the outcome is the caller's.

Lease mode: the handler runs outside any transaction. When a heartbeat finds the job gone
(reaped after a pause, or released), ``job.lease_lost`` becomes true, ``job.check_lease()``
raises, and the handler's result is dropped.

Transactional mode: the handler runs as ``handler(job, session)`` inside a transaction that
ends with the fenced completion; if the fence no longer matches, the whole transaction,
handler writes included, rolls back; if an operator cancelled the job meanwhile, it rolls
back too and the job is then recorded ``cancelled`` in a transaction of its own
(:attr:`Outcome.CANCELLED`). Its connection is checked out first, its isolation is
READ COMMITTED, and a serialization failure or deadlock is retried in place
(:mod:`outbox.relay.transaction`). An ``async def`` transactional handler gets an
``AsyncSession`` on a connection of its worker thread's own async engine (made on first
use, one connection) and the same steps.

Failures: an exception becomes a :class:`~outbox.relay.outcomes.Failure`: the job goes back
to ``ready`` after its subscriber's retry delay (:class:`outbox.retry.RetryPolicy`) or, once
attempts reach ``max_attempts``, to ``dead``; :class:`~outbox.PermanentError`, and what the
subscriber's ``dead_on`` / ``retry_on`` declare dead, go to ``dead`` at once.
``last_error`` holds the type, message and a bounded traceback
(:func:`outbox.relay.outcomes.format_error`).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

from outbox.db.engine import describe
from outbox.errors import (
    HandlerMisuseError,
    HandlerTimeoutError,
    LeaseLostError,
    PermanentError,
    Snooze,
)
from outbox.job import Job
from outbox.registry import Subscriber
from outbox.relay import transaction
from outbox.relay.counters import Counters
from outbox.relay.outcomes import MAX_ERROR_CHARS, Failure, Outcome, Snoozed, format_error
from outbox.relay.watchdog import ASYNC_BACKSTOP_SECONDS, Watchdog
from outbox.retry import RetryPolicy, policy_of
from outbox.settings import OutboxSettings
from outbox.telemetry import tracing
from outbox.telemetry.logs import job_fields

log = logging.getLogger(__name__)

#: SQLSTATE of "terminating connection due to idle-in-transaction timeout".
IDLE_IN_TRANSACTION_TIMEOUT = "25P03"


_DONE = Outcome.DONE
_COMMITTED = Outcome.COMMITTED
_STALE = Outcome.STALE
_RELEASE = Outcome.RELEASE
_CANCELLED = Outcome.CANCELLED
#: What a transaction rolled back for an operator's cancel returns, the cancel still to record.
_CancelRequested = Literal[transaction.Completion.CANCEL_REQUESTED]
#: ``outbox.job.outcome`` of a span whose run ended with an Outcome (:mod:`outbox.telemetry.tracing`).
_SPAN_OUTCOMES = {Outcome.DONE: "done", Outcome.COMMITTED: "committed", Outcome.STALE: "stale",
                  Outcome.RELEASE: "released", Outcome.TIMED_OUT: "timed_out", Outcome.CANCELLED: "cancelled"}


@dataclass(frozen=True, slots=True)
class _RetryInPlace:
    """A transactional handler's transaction failed with a serialization failure or a
    deadlock (``sqlstate``); it runs again in place, the attempt not counted again."""

    exc: BaseException
    sqlstate: str


class HandlerSession(Session):
    """The ``Session`` given to transactional handlers. The relay owns the transaction:
    ``commit()`` raises, since the job's completion must commit with the handler's writes.
    Use ``flush()`` to send writes early, or a SAVEPOINT (``begin_nested()``). An
    ``async def`` handler gets an ``AsyncSession`` around one of these, so the same holds."""

    def commit(self) -> None:
        """Refused inside a handler (:class:`~outbox.errors.HandlerMisuseError`: the job is
        dead at once); outbox commits."""
        raise HandlerMisuseError(
            "a transactional handler must not commit: outbox commits its writes together with the job's completion")


def check_returned(sub: Subscriber, result: Any) -> None:
    """Raise :class:`~outbox.errors.HandlerMisuseError` when a handler returned an awaitable
    (a ``def`` handler that returns a coroutine, or an ``async def`` one that returns
    another): the work it stands for never ran, and retrying cannot change that. A
    coroutine is closed first, so Python does not warn it was never awaited."""
    if inspect.isawaitable(result):
        close = getattr(result, "close", None)
        if callable(close):
            close()
        raise HandlerMisuseError(
            f"the handler of {sub.consumer!r} returned {type(result).__name__} {getattr(result, '__qualname__', '')!s} "
            "instead of running it: declare it `async def` (outbox awaits it) or await the call inside it")


class WorkerContext:
    """What one worker thread keeps for the handlers it runs, each made on first use: an
    event loop for ``async def`` handlers, and for async transactional handlers an
    :class:`~sqlalchemy.ext.asyncio.AsyncEngine` of one connection made by
    ``async_engine`` (an async engine's pool must stay on one event loop). A thread that
    never runs an ``async def`` handler makes neither. Not thread-safe: one per thread;
    :meth:`close` at the end."""

    def __init__(self, async_engine: Callable[[], AsyncEngine]) -> None:
        self._make_async_engine = async_engine
        self._loop: asyncio.AbstractEventLoop | None = None
        self._async_engine: AsyncEngine | None = None
        self._transaction_engine: AsyncEngine | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """This thread's event loop."""
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        return self._loop

    def connect_async(self) -> AsyncConnection:
        """A started ``AsyncConnection`` of this thread's async engine, its transactions at
        :data:`outbox.relay.transaction.ISOLATION_LEVEL`; raises what connecting raises."""
        if self._transaction_engine is None:
            self._async_engine = self._make_async_engine()
            self._transaction_engine = self._async_engine.execution_options(
                isolation_level=transaction.ISOLATION_LEVEL)
        return self.loop.run_until_complete(self._transaction_engine.connect().start())

    def close(self) -> None:
        """Dispose of the async engine and close the event loop (if made)."""
        if self._async_engine is not None:
            try:
                self.loop.run_until_complete(self._async_engine.dispose())
            except Exception:  # noqa: BLE001 - closing down
                pass
            self._async_engine = self._transaction_engine = None
        if self._loop is not None:
            self._loop.close()
            self._loop = None


async def bounded(awaitable: Any, seconds: float | None) -> Any:
    """Await ``awaitable`` for at most ``seconds`` (None: no bound); past it, the awaitable
    is cancelled and :class:`~outbox.HandlerTimeoutError` raised (a ``TimeoutError`` of the
    handler's own propagates as it is)."""
    if seconds is None:
        return await awaitable
    scope = asyncio.timeout(seconds)
    try:
        async with scope:
            return await awaitable
    except TimeoutError:
        if scope.expired():
            raise HandlerTimeoutError(seconds) from None
        raise


class JobExecutor:
    """Runs one claimed job's handler and says how it ended: an :class:`Outcome` or a
    :class:`Failure` (the statement that records it is the caller's). Shared by the
    relay's worker threads (:class:`JobRunner`) and :func:`outbox.testing.drain`.

    Lease mode: ``handler(job)`` outside any transaction. Transactional mode: a connection
    first (:meth:`outbox.relay.transaction.HandlerConnections.acquire`), then
    ``handler(job, session)`` between :func:`outbox.relay.transaction.begin` and
    :func:`outbox.relay.transaction.complete` in one READ COMMITTED transaction, run again in
    place after a serialization failure or deadlock (at most
    :data:`outbox.relay.transaction.IN_PLACE_RETRIES` times, while the claim is held). An
    ``async def`` handler runs on the thread's event loop (:class:`WorkerContext`); an
    async transactional one gets an ``AsyncSession`` and the same steps.

    ``held(job)`` says whether the caller still holds the claim; ``stopping`` (the relay
    draining) cuts waits short; ``completing(job)`` is called as the fenced completion of
    a transactional handler is about to run, ``abandoned(job)`` when that transaction
    failed instead. ``stats["retried_in_place"]`` counts in-place retries. ``policies``:
    each consumer's retry policy (:func:`outbox.retry.policy_of`; a consumer not in it gets
    the settings' backoff and every failure retried).
    ``reraise_interrupts=True`` (for :func:`outbox.testing.drain`, which runs handlers in the
    caller's thread) lets a ``KeyboardInterrupt`` or ``SystemExit`` out of a handler, after
    its transaction rolled back, instead of recording it as the attempt's failure; the
    caller still holds the claim then and hands it back.

    Timeouts (a subscriber's ``timeout``, seconds): an ``async def`` handler is cancelled
    (``asyncio.timeout``) and its attempt fails with :class:`~outbox.HandlerTimeoutError`.
    A ``def`` handler is watched by ``watchdog`` (:mod:`outbox.relay.watchdog`), armed once the
    handler's connection (if any) is had: if it fires, the run ends as
    :attr:`Outcome.TIMED_OUT` whenever the handler returns, and a transactional handler's
    transaction rolls back instead of completing. Without a watchdog, a ``def`` handler is
    not bounded. ``raise Snooze(seconds)`` ends the run as :class:`Snoozed`."""

    def __init__(self, settings: OutboxSettings, connections: transaction.HandlerConnections, *,
                 held: Callable[[Job], bool], stopping: threading.Event,
                 completing: Callable[[Job], None] = lambda job: None,
                 abandoned: Callable[[Job], None] = lambda job: None,
                 stats: Counters | None = None, reraise_interrupts: bool = False,
                 watchdog: Watchdog | None = None, policies: Mapping[str, RetryPolicy] | None = None) -> None:
        self.reraise_interrupts = reraise_interrupts
        # Each consumer's retry policy (outbox.retry); a consumer not in it: the settings' backoff, every failure retried.
        self.policies = dict(policies or {})
        self._default_policy = policy_of(settings)
        self.watchdog = watchdog
        self.settings = settings
        self.connections = connections
        self.held = held
        self.stopping = stopping
        self.completing = completing
        self.abandoned = abandoned
        self.stats = stats if stats is not None else Counters(("retried_in_place",))
        self._warned_return: set[str] = set()  # consumers whose handler returned a value (warned once)

    def run(self, job: Job, sub: Subscriber, context: WorkerContext) -> Outcome | Failure | Snoozed:
        """Run ``sub``'s handler for ``job`` once (a transactional one perhaps again in
        place); never raises for the handler's failures. With OpenTelemetry installed, the
        run is a CONSUMER span, child of the publisher's context (:mod:`outbox.telemetry.tracing`)."""
        if not tracing.active():
            return self._run(job, sub, context)
        with tracing.process_span(job) as span:
            outcome = self._run(job, sub, context)
            if isinstance(outcome, Failure):
                tracing.set_outcome(span, "failed")
            elif isinstance(outcome, Snoozed):
                tracing.set_outcome(span, "snoozed")
            elif outcome is Outcome.TIMED_OUT:
                tracing.set_outcome(span, "timed_out", error=f"the handler ran past its timeout of {sub.timeout}s")
            else:
                tracing.set_outcome(span, _SPAN_OUTCOMES[outcome])
        return outcome

    def _run(self, job: Job, sub: Subscriber, context: WorkerContext) -> Outcome | Failure | Snoozed:
        try:
            if sub.transactional:
                outcome = self._run_transactional(job, sub, context)
            else:
                self._arm(job, sub)
                try:
                    if sub.is_async:
                        result = context.loop.run_until_complete(bounded(sub.handler(job), sub.timeout))
                    else:
                        result = sub.handler(job)
                    check_returned(sub, result)
                except BaseException as exc:  # noqa: BLE001 - any failure of a handler is the job's
                    outcome = self.failure(job, exc)
                else:
                    self._warn_return(sub, result)
                    outcome = _DONE
        finally:
            timed_out = self.watchdog is not None and self.watchdog.end(job)
        if timed_out:
            log.info("result of job %s (%s) dropped: its handler ran past its timeout and the job was handed back",
                     job.id, job.consumer, extra=job_fields(job, outcome="timed_out"))
            return Outcome.TIMED_OUT
        return outcome

    def _arm(self, job: Job, sub: Subscriber) -> None:
        """Start the watchdog on ``job``'s handler, if it has a timeout (an ``async def``
        one past its own cancellation, as a backstop)."""
        if self.watchdog is not None and sub.timeout is not None:
            self.watchdog.arm(job, sub.timeout + (ASYNC_BACKSTOP_SECONDS if sub.is_async else 0.0))

    def _completing(self, job: Job) -> None:
        """A transactional handler returned and its completion is about to run: refused
        (the transaction rolls back) if the watchdog already failed the attempt."""
        if self.watchdog is not None and self.watchdog.disarm(job):
            raise LeaseLostError(f"job {job.id}: the handler ran past its timeout; its attempt was failed and "
                                 "the job handed back")
        self.completing(job)

    def _run_transactional(self, job: Job, sub: Subscriber, context: WorkerContext) -> Outcome | Failure | Snoozed:
        """Get a connection first (waiting while the claim is held; released, attempt not
        counted, without one), then run the handler and the fenced completion in one
        transaction, retried in place after a serialization failure or deadlock while the
        claim is held."""
        conn = self.connections.acquire(lambda: self.held(job) and not self.stopping.is_set(),
                                        job.lease_seconds, self.stopping,
                                        context.connect_async if sub.is_async else None)
        if conn is None:
            if job.lease_lost:
                return _STALE
            log.info("job %s (%s) released: no database connection for its transaction", job.id, job.consumer,
                     extra=job_fields(job, outcome="released"))
            return _RELEASE
        self._arm(job, sub)
        try:
            retries = 0
            while True:
                if sub.is_async:
                    outcome = context.loop.run_until_complete(self._async_transaction_once(job, sub, conn))
                else:
                    outcome = self._transaction_once(job, sub, conn)
                if outcome is transaction.Completion.CANCEL_REQUESTED:
                    return self._record_cancel(job, sub, conn, context)
                if not isinstance(outcome, _RetryInPlace):
                    return outcome
                if retries >= transaction.IN_PLACE_RETRIES or not self.held(job):
                    return self.failure(job, outcome.exc)
                retries += 1
                self.stats.add("retried_in_place")
                log.info("job %s (%s): %s in its transaction (%s); running it again in place (%d/%d, attempt %s "
                         "not counted again)", job.id, job.consumer, transaction.RETRY_SQLSTATES[outcome.sqlstate],
                         describe(outcome.exc), retries, transaction.IN_PLACE_RETRIES, job.attempt,
                         extra=job_fields(job, outcome="retried_in_place", sqlstate=outcome.sqlstate))
                self.stopping.wait(transaction.retry_pause(retries))
                job.restore_input()  # the rerun sees the payload the first run saw, not what it changed
        finally:
            try:
                if sub.is_async:
                    context.loop.run_until_complete(conn.close())
                else:
                    conn.close()
            except Exception as exc:  # noqa: BLE001 - a broken connection; the pool replaces it
                log.debug("closing job %s's transaction connection failed: %s", job.id, describe(exc))

    def _record_cancel(self, job: Job, sub: Subscriber, conn: Any, context: WorkerContext) -> Outcome:
        """The handler's transaction was rolled back because an operator cancelled the job:
        record ``cancelled`` (fenced) in a transaction of its own on ``conn``. If that
        statement fails (the connection broke), the job is released instead, whose fenced
        statement records ``cancelled`` too (``job_release_many``)."""
        try:
            if sub.is_async:
                recorded = context.loop.run_until_complete(conn.run_sync(
                    transaction.record_cancel, job.id, job.fence, schema=self.settings.schema_name))
            else:
                recorded = transaction.record_cancel(conn, job.id, job.fence, schema=self.settings.schema_name)
        except DBAPIError as exc:
            log.warning("job %s (%s): its handler's transaction was rolled back for a cancel, but recording the "
                        "cancel failed (%s); releasing it, which records cancelled", job.id, job.consumer,
                        describe(exc), extra=job_fields(job, outcome="released"))
            return _RELEASE
        return _CANCELLED if recorded else _STALE

    def _transaction_once(self, job: Job, sub: Subscriber, conn: Connection,
                          ) -> Outcome | Failure | Snoozed | _RetryInPlace | _CancelRequested:
        """One transaction on ``conn``: begin (limits), handler, complete (fenced), commit;
        :attr:`~outbox.relay.transaction.Completion.CANCEL_REQUESTED` when it was rolled back
        because an operator cancelled the job (the cancel is still to record)."""
        session = HandlerSession(bind=conn)
        try:
            with session:
                transaction.begin(session, job.lease_seconds, job.fence)
                result = sub.handler(job, session)
                check_returned(sub, result)  # before the completion: a misuse rolls the writes back
                completion = transaction.complete(session, job.id, job.fence, lambda: self._completing(job),
                                                  keep_done=self.settings.keep_done, schema=self.settings.schema_name)
        except BaseException as exc:  # noqa: BLE001
            return self._transaction_failed(job, exc)
        return self._transaction_ended(job, sub, completion, result)

    async def _async_transaction_once(self, job: Job, sub: Subscriber, conn: AsyncConnection,
                                      ) -> Outcome | Failure | Snoozed | _RetryInPlace | _CancelRequested:
        """:meth:`_transaction_once` for an ``async def`` handler: the same steps on an
        ``AsyncSession`` (its sync session runs :func:`outbox.relay.transaction.begin` and
        :func:`outbox.relay.transaction.complete` through ``run_sync``)."""
        session = AsyncSession(bind=conn, sync_session_class=HandlerSession)
        try:
            async with session:
                await session.run_sync(transaction.begin, job.lease_seconds, job.fence)
                result = await bounded(sub.handler(job, session), sub.timeout)
                check_returned(sub, result)
                completion = await session.run_sync(transaction.complete, job.id, job.fence,
                                                    lambda: self._completing(job), keep_done=self.settings.keep_done,
                                                    schema=self.settings.schema_name)
        except BaseException as exc:  # noqa: BLE001
            return self._transaction_failed(job, exc)
        return self._transaction_ended(job, sub, completion, result)

    def _transaction_ended(self, job: Job, sub: Subscriber, completion: transaction.Completion,
                           result: Any) -> Outcome | _CancelRequested:
        """The outcome of a handler's transaction that :func:`outbox.relay.transaction.complete`
        ended; unless it committed, the session's close has rolled the handler's writes back."""
        if completion is transaction.Completion.CANCEL_REQUESTED:
            return completion
        if completion is transaction.Completion.STALE:
            return _STALE
        self._warn_return(sub, result)
        return _COMMITTED

    def _transaction_failed(self, job: Job, exc: BaseException) -> Outcome | Failure | Snoozed | _RetryInPlace:
        """The outcome of a handler's transaction that raised ``exc`` (rolled back)."""
        self.abandoned(job)
        if isinstance(exc, DBAPIError) and exc.connection_invalidated:
            if getattr(exc.orig, "sqlstate", None) == IDLE_IN_TRANSACTION_TIMEOUT:
                # The server ended the session because the handler sat idle inside its
                # transaction for longer than the lease: the handler's doing, so the
                # attempt counts (released, a handler that is always this slow would be
                # retried forever). Fenced: if a pause cost this worker the job, the
                # failure report changes nothing.
                log.warning("job %s (%s): its transaction sat idle longer than the lease and the server ended "
                            "it; counted as a failed attempt", job.id, job.consumer,
                            extra=job_fields(job, outcome="failed"))
                return self.failure(job, exc)
            # The connection broke (server restart, terminated backend): not the
            # handler's failure, so the attempt does not count. The release is fenced:
            # if the commit did happen before the connection broke, it changes nothing.
            log.warning("job %s (%s): database connection lost during its transaction (%s); releasing it",
                        job.id, job.consumer, describe(exc), extra=job_fields(job, outcome="released"))
            return _RELEASE
        sqlstate = transaction.retryable_sqlstate(exc)
        if sqlstate is not None and not isinstance(exc, LeaseLostError):
            return _RetryInPlace(exc, sqlstate)
        return self.failure(job, exc)

    def failure(self, job: Job, exc: BaseException) -> Outcome | Failure | Snoozed:
        """The outcome of an attempt that raised ``exc``: :attr:`Outcome.STALE` when the
        claim was lost (``LeaseLostError``, or ``job.lease_lost``), :class:`Snoozed` for a
        :class:`~outbox.Snooze`, else a :class:`Failure`
        whose delay is the consumer's policy's (:meth:`outbox.retry.RetryPolicy.delay`) for the
        attempt; permanent for a ``PermanentError`` and for what the policy's ``dead_on`` /
        ``retry_on`` make dead at once, whose error then begins with a line naming the rule.
        Re-raises ``exc`` if it is a ``KeyboardInterrupt`` or ``SystemExit`` and
        the executor was made with ``reraise_interrupts``."""
        if self.reraise_interrupts and isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise exc
        if isinstance(exc, LeaseLostError) or job.lease_lost:
            return _STALE
        if isinstance(exc, Snooze):
            return Snoozed(exc.seconds)
        if tracing.active():
            tracing.record_failure(job, exc)
        policy = self.policies.get(job.consumer, self._default_policy)
        rule = policy.dead_at_once(exc)
        return Failure(
            delay=policy.delay(job.attempt),
            permanent=rule is not None or isinstance(exc, PermanentError),
            error=format_error(exc) if rule is None else f"{rule}\n{format_error(exc, MAX_ERROR_CHARS - len(rule) - 1)}",
            timed_out=isinstance(exc, HandlerTimeoutError),
        )

    def _warn_return(self, sub: Subscriber, result: Any) -> None:
        if result is not None and sub.consumer not in self._warned_return:
            self._warned_return.add(sub.consumer)
            log.warning("handler of %s returned %s; the value is ignored (handlers return None)",
                        sub.consumer, type(result).__name__)



