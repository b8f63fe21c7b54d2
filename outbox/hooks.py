"""Failure hooks: functions the relay calls after a job of a consumer went ``dead`` or was
put back to ``ready`` after a failed attempt, for alerts (Sentry, a chat message)::

    @ob.on_dead("send_receipt")
    def page_someone(failure: JobFailure) -> None:
        alerts.send(f"job {failure.job_id} of {failure.consumer} is dead: {failure.error}")

Declared with :meth:`outbox.Outbox.on_dead` and :meth:`outbox.Outbox.on_retry`; each is
given a :class:`JobFailure`. How they run (:mod:`outbox.relay.hooks`):

* **Durable.** The statement that changes the job writes a due call to
  ``outbox_hook_calls`` in its own transaction (a trigger, migration 0013), so a call is
  never lost to a crash, whichever relay (or ``outbox-relay`` command) changed the job.
* **Outside the job's transaction, after it.** A relay whose registry declares the hook
  takes due calls (``FOR UPDATE SKIP LOCKED``, leased for twice ``hook_timeout``) and runs
  them in threads of its own; a hook cannot change the job's outcome, and the job does not
  wait for it.
* **At least once.** The call is deleted once every hook of its kind for the consumer has
  returned. A relay that dies during a call leaves it leased: another relay calls it again
  when the lease runs out (``JobFailure.call`` then says which call it is). A row also
  remembers which hooks already returned, so one failing hook does not repeat the others.
* **Never forever.** A hook that raises or runs past ``hook_timeout`` is logged, counted
  (``outbox_hook_calls_total{result="failed"}``) and called again after a backoff; after
  :data:`outbox.relay.hooks.MAX_CALLS` calls it is given up: logged at ERROR with the
  job's id, counted ``gave_up``.

Which changes call which hook: ``on_dead``, a job that went ``dead`` by any path (its last
attempt failed, :class:`~outbox.PermanentError`, ``dead_on`` / ``retry_on``, a lease that
expired on the last attempt, a poison row dead-lettered); ``on_retry``, a job back to
``ready`` after a failed attempt (a failure with attempts left, or a lease that expired
with attempts left). A snooze, a release at shutdown and a redrive call neither.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

#: The kinds of failure hook.
HookKind = Literal["dead", "retry"]
HOOK_KINDS: tuple[HookKind, ...] = ("dead", "retry")


@dataclass(frozen=True, slots=True)
class JobFailure:
    """What a failure hook is given: a job of ``consumer`` went ``dead`` (``hook ==
    "dead"``) or back to ``ready`` after failed attempt ``attempt`` of ``max_attempts``
    (``hook == "retry"``), at ``failed_at`` (database clock), with ``error`` (the job's
    ``last_error`` then: type, message and a bounded traceback; None if it had none).

    ``job_id`` and ``event_id`` identify the job and its event; ``topic``, ``key``,
    ``payload`` (decoded JSON) and ``headers`` are the event's, read when the hook is
    called (``topic`` None, ``payload`` None and ``headers`` empty if the event was purged
    meanwhile). ``call``: 1 the first time this failure's hooks are called; more when an
    earlier call failed or its relay died during it (at least once: a hook may see the
    same failure twice)."""

    hook: HookKind
    job_id: int
    event_id: int
    consumer: str
    attempt: int
    max_attempts: int
    error: str | None
    failed_at: datetime
    topic: str | None
    key: str | None
    payload: Any
    headers: dict[str, Any]
    call: int = 1
