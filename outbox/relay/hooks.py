"""The failure hooks' runner (:class:`HookRunner`, thread ``outbox-hooks``): calls the
registry's ``on_dead`` / ``on_retry`` hooks (:mod:`outbox.hooks`) for the due calls the
trigger of migration 0013 wrote to ``outbox_hook_calls``.

A round:

1. **Lease**, one short transaction (``hook_call_lease_many``): up to :data:`BATCH` due calls
   of the (consumer, hook) pairs this registry declares, oldest first, ``FOR UPDATE SKIP
   LOCKED`` so relays share them; each gets ``calls + 1`` and is due again after twice
   ``hook_timeout`` (its lease). ``calls`` is the lease's fence.
2. **Call**, outside any transaction: each hook of the call's (consumer, kind) not yet in its
   ``done`` list runs in a thread of its own (an ``async def`` hook on an event loop of that
   thread), all of the round's at once, each given a :class:`~outbox.JobFailure`. The round
   waits for them up to ``hook_timeout``; a hook still running then is counted failed (its
   thread is left to end on its own: Python cannot stop it). While :data:`MAX_HUNG` such
   threads still run, no new call is leased, so hooks that hang hold a bounded number of
   threads.
3. **End**, one statement per outcome, each checking ``calls`` (the row count read): every
   hook returned: the row is deleted; some failed: ``done`` gains the hooks that returned,
   ``last_error`` the failure, and the call is due again after a backoff
   (:data:`RETRY_BASE` doubling to :data:`RETRY_CAP`); a call that has failed
   :data:`MAX_CALLS` times is given up: deleted, logged at ERROR with the job's id. A call
   leased more than :data:`MAX_CALLS` times (the relays making it died) is given up
   without calling.

Guarantees: a call is made at least once per hook (a relay that dies during one leaves it
leased, and another relay makes it again when the lease runs out: ``JobFailure.call`` > 1)
and at most :data:`MAX_CALLS` times; a hook never changes its job (the job's statement
committed before the hook runs, and nothing here writes ``outbox_jobs``). Counted in
``stats`` and, with metrics on, ``outbox_hook_calls_total{consumer,hook,result}``.

Calls that no relay makes: a relay writes its registry's hooks to
``outbox_subscriptions.hooks`` when it starts, and the trigger writes calls only for the
hooks written there, so a consumer whose hooks are removed stops getting calls once a
relay of the new registry starts. Calls written before then wait for a relay that has the
hook; :func:`warn_uncalled` logs them at relay start, and SQL deletes them
(``DELETE FROM outbox_hook_calls WHERE consumer = ...``).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError

from outbox import backoff
from outbox.db import queries
from outbox.hooks import JobFailure
from outbox.registry import Outbox
from outbox.relay.counters import Counters
from outbox.relay.outcomes import format_error
from outbox.relay.reconnect import Reconnector
from outbox.settings import OutboxSettings
from outbox.telemetry.metrics import RelayMetrics

log = logging.getLogger(__name__)

#: Most calls leased per round.
BATCH = 16
#: Most times a hook is called for one failure; then it is given up.
MAX_CALLS = 5
#: Wait before the next call after a failed one, seconds: RETRY_BASE * 2**(calls-1), capped
#: at RETRY_CAP, with a quarter of jitter.
RETRY_BASE = 5.0
RETRY_CAP = 300.0
#: Most hook threads still running past ``hook_timeout`` (Python cannot stop a thread) before
#: the runner leases no new call: hooks that hang (an alerting service that never answers)
#: during a wave of dead jobs hold at most this many threads (plus one round's), not one per call.
MAX_HUNG = 32


@dataclass
class _Call:
    """One leased hook call: the row, the failure given to its hooks, the hooks still to
    call (name, hook) and, once the round waited, what each did."""

    id: int
    calls: int
    consumer: str
    hook: str
    done: list[str]
    failure: JobFailure
    pending: list[tuple[str, Callable[..., Any]]]
    errors: dict[str, str] = field(default_factory=dict)
    returned: list[str] = field(default_factory=list)


def call_hook(hook: Callable[..., Any], failure: JobFailure) -> None:
    """Call ``hook(failure)``; an awaitable it returns (an ``async def`` hook) is run to its
    end on an event loop of this thread. Raises what the hook raises."""
    result = hook(failure)
    if inspect.isawaitable(result):
        async def awaited() -> Any:
            return await result

        asyncio.run(awaited())


class HookRunner:
    """The loop of ``registry``'s failure hooks (see the module notes) on the tables of
    ``settings.schema_name``, until ``stop`` is set: a round, then another at once after a
    full batch, else after ``poll_interval``. ``reconnect`` paces the retries after a
    database error (the loop never ends for one). ``stats`` counts ``hook_calls_ok``,
    ``hook_calls_failed`` and ``hook_calls_gave_up`` (per hook); ``metrics`` too, when given.
    Settings read: ``hook_timeout``, ``poll_interval``."""

    COUNTS = ("hook_calls_ok", "hook_calls_failed", "hook_calls_gave_up")

    def __init__(self, engine: Engine, registry: Outbox, settings: OutboxSettings, *, stop: threading.Event,
                 reconnect: Reconnector, metrics: RelayMetrics | None = None) -> None:
        self.engine = engine
        self.registry = registry
        self.settings = settings
        self.statements = queries.in_schema(settings.schema_name)
        self.stop_event = stop
        self.reconnect = reconnect
        self.metrics = metrics
        self.stats = Counters(self.COUNTS)
        self.pairs = [(consumer, kind) for consumer in registry.consumers for kind in registry.hooks_of(consumer)]
        self._thread: threading.Thread | None = None
        self._hung: list[threading.Thread] = []  # hook threads left running past hook_timeout
        self._full = False  # MAX_HUNG of them run (logged once when it begins)

    def start(self) -> None:
        """Start the loop's thread (``outbox-hooks``)."""
        self._thread = threading.Thread(target=self.run, name="outbox-hooks", daemon=True)
        self._thread.start()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the thread to end, up to ``timeout`` seconds; True when it has (or never started)."""
        if self._thread is not None:
            self._thread.join(timeout=timeout)
        return self._thread is None or not self._thread.is_alive()

    def run(self) -> None:
        """The loop; never raises (a round that fails is logged and tried again after a backoff)."""
        failures = 0
        full = False
        while not self.stop_event.wait(0 if full or failures else self.settings.poll_interval):
            try:
                full = self.round() >= BATCH
                failures = self.reconnect.recovered(failures, "failure hooks")
            except DBAPIError as exc:
                full = False
                failures = self.reconnect.backoff(failures, "failure hooks", exc, self.stop_event)
            except Exception as exc:  # noqa: BLE001 - a bug here must not end the alerts for good
                log.exception("failure hooks: a round failed; trying again")
                full = False
                failures = self.reconnect.backoff(failures, "failure hooks", exc, self.stop_event)

    def round(self) -> int:
        """One round (lease, call, end; module notes); returns how many calls it leased.
        Raises the database's errors (a call leased and not ended is made again once its
        lease runs out)."""
        if not self.pairs:
            return 0
        room = self._room()
        if room <= 0:
            return 0
        timeout = self.settings.hook_timeout
        with self.engine.begin() as conn:
            rows = conn.execute(self.statements.hook_call_lease_many, {
                "consumers": [c for c, _ in self.pairs], "hooks": [k for _, k in self.pairs],
                "limit": min(BATCH, room), "lease": 2 * timeout}).all()
        calls = [self._call_of(row) for row in rows]
        threads: list[tuple[_Call, str, threading.Thread]] = []
        for call in calls:
            if call.calls > MAX_CALLS:
                continue  # made MAX_CALLS times already, by relays that did not end it: given up below
            for name, hook in call.pending:
                thread = threading.Thread(target=self._run_one, args=(call, name, hook), daemon=True,
                                          name=f"outbox-hook-{call.id}")
                thread.start()
                threads.append((call, name, thread))
        deadline = time.monotonic() + timeout
        for call, name, thread in threads:
            while thread.is_alive() and not self.stop_event.is_set():
                thread.join(max(0.0, min(0.1, deadline - time.monotonic())))
                if time.monotonic() >= deadline:
                    break
            if thread.is_alive() and name not in call.errors and name not in call.returned:
                if self.stop_event.is_set():
                    continue  # stopping: the call stays leased and is made again after the lease
                call.errors[name] = f"HookTimeout: ran past hook_timeout ({timeout:g} s)"
        self._hung.extend(thread for _, _, thread in threads if thread.is_alive())
        for call in calls:
            self._end(call)
        return len(rows)

    def _room(self) -> int:
        """How many calls a round may lease: :data:`MAX_HUNG` less the hook threads still
        running past their timeout (0 or less: none, logged when it starts)."""
        self._hung = [thread for thread in self._hung if thread.is_alive()]
        room = MAX_HUNG - len(self._hung)
        full, self._full = self._full, room <= 0
        if room <= 0 and not full:
            log.warning("failure hooks: %d hook threads still run past hook_timeout (%g s); no new hook call "
                        "until some end (they wait, leased, for this or another relay)", len(self._hung),
                        self.settings.hook_timeout)
        return room

    def _call_of(self, row: Any) -> _Call:
        failure = JobFailure(hook=row.hook, job_id=row.job_id, event_id=row.event_id, consumer=row.consumer,
                             attempt=row.attempt, max_attempts=row.max_attempts, error=row.error,
                             failed_at=row.created_at, topic=row.topic, key=row.key, payload=row.payload,
                             headers=dict(row.headers or {}), call=row.calls)
        done = list(row.done or ())
        pending = [(name, hook) for name, hook in self.registry.hooks_for(row.consumer, row.hook) if name not in done]
        return _Call(id=row.id, calls=row.calls, consumer=row.consumer, hook=row.hook, done=done, failure=failure,
                     pending=pending)

    def _run_one(self, call: _Call, name: str, hook: Callable[..., Any]) -> None:
        try:
            call_hook(hook, call.failure)
        except BaseException as exc:  # noqa: BLE001 - a hook's failure is counted, never the relay's
            call.errors.setdefault(name, format_error(exc))
        else:
            call.returned.append(name)

    def _end(self, call: _Call) -> None:
        """Write how ``call`` ended (module notes, step 3)."""
        job = {"job_id": call.failure.job_id, "consumer": call.consumer, "hook": call.hook}
        ok = [n for n in call.returned if n not in call.errors]
        failed = {n: e for n, e in call.errors.items() if n not in ok}
        self._count("ok", call, len(ok))
        self._count("failed", call, len(failed))
        for name, error in failed.items():
            log.warning("failure hook %s (on_%s of %s) failed for job %s, call %d of at most %d: %s", name, call.hook,
                        call.consumer, call.failure.job_id, call.calls, MAX_CALLS, error.partition("\n")[0],
                        extra={**job, "hook_name": name, "call": call.calls})
        left = [n for n, _ in call.pending if n not in ok]
        unfinished = [n for n in left if n not in failed]  # stopping: still running, the call stays leased
        if unfinished and not failed and call.calls <= MAX_CALLS:
            return
        if not left:
            self._delete(call)
            return
        if call.calls >= MAX_CALLS:  # this was the last call, or (more) the relays of the last ones died
            self._count("gave_up", call, len(left))
            log.error("failure hooks %s (on_%s of %s) given up for job %s after %d calls; last error: %s",
                      ", ".join(left), call.hook, call.consumer, call.failure.job_id, min(call.calls, MAX_CALLS),
                      next(iter(failed.values()), "its relays stopped or died during the call").partition("\n")[0],
                      extra={**job, "outcome": "gave_up"})
            self._delete(call)
            return
        delay = backoff.retry_delay(call.calls, base=RETRY_BASE, cap=RETRY_CAP, jitter=0.25)
        error = "\n".join(f"{name}: {text}" for name, text in failed.items())
        with self.engine.begin() as conn:
            kept = conn.execute(self.statements.hook_call_fail, {
                "id": call.id, "calls": call.calls, "done": [*call.done, *ok], "error": error, "delay": delay}).rowcount
        if not kept:
            log.info("failure hook call %s of job %s: another relay took it over (its lease ran out)", call.id,
                     call.failure.job_id, extra=job)

    def _delete(self, call: _Call) -> None:
        with self.engine.begin() as conn:
            deleted = conn.execute(self.statements.hook_call_delete_many,
                                   {"ids": [call.id], "calls": [call.calls]}).all()
        if not deleted:
            log.info("failure hook call %s of job %s: another relay took it over (its lease ran out)", call.id,
                     call.failure.job_id, extra={"job_id": call.failure.job_id, "consumer": call.consumer})

    def _count(self, result: str, call: _Call, n: int) -> None:
        if not n:
            return
        self.stats.add(f"hook_calls_{result}", n)
        if self.metrics is not None:
            self.metrics.hook_called(call.consumer, call.hook, result, n)


def warn_uncalled(engine: Engine, schema: str) -> None:
    """Log at WARNING the hook calls waiting for a hook no subscription declares now (no
    relay will make them until one declaring it starts), by consumer and hook; one round trip."""
    with engine.connect() as conn:
        rows = conn.execute(queries.in_schema(schema).hook_call_counts).all()
    for row in rows:
        if not row.declared:
            log.warning("%d failure hook calls (on_%s of %s, the oldest from %s) wait for a relay whose registry "
                        "declares that hook; none does now. Declare it, or delete them: DELETE FROM "
                        "outbox_hook_calls WHERE consumer = '%s' AND hook = '%s'", row.calls, row.hook, row.consumer,
                        row.oldest, row.consumer, row.hook)
