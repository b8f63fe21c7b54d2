"""The exception hierarchy: one root, :class:`OutboxError`, and a subclass per thing a
caller may want to catch.

Database errors are translated once, at the boundary that met them, and the driver's
exception is kept as ``__cause__`` (``raise ... from``).
"""

from __future__ import annotations

from typing import Any


class OutboxError(Exception):
    """Root of every error outbox raises on purpose."""


class ConfigurationError(OutboxError):
    """A setting, a subscriber declaration or a command-line option is invalid.

    Raised before anything is written; the message names the offending option.
    """


class AdminError(ConfigurationError):
    """An operator's command (:mod:`outbox.admin`: cancel, retry, replay, purge, relays) was
    given input it refuses: neither or both of job ids and a consumer, a consumer that has
    no subscription (replay) or still has one (purge), an ordered consumer to replay, events
    asked for that were already pruned. Raised before anything is written; the message
    names what was wrong and, where there is one, what to do instead."""


class InvalidEventError(OutboxError, ValueError):
    """``publish()`` was given an event it refuses to write.

    The message names the field (``topic``, ``key``, ``payload``, ``headers``) and the
    problem (not JSON-serialisable, holds ``\\u0000``, too large, empty). Raised before
    anything is sent to the database, so the caller's transaction stays usable. The SQL
    function ``outbox_publish`` raises the same message with SQLSTATE 22023
    (:mod:`outbox.db.event_rules`).
    """

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        self.problem = problem
        super().__init__(f"{field}: {problem}")


class PermanentError(OutboxError):
    """Raise from a handler to dead-letter the job at once, without further retries.

    Use it for failures no retry can fix: a malformed payload, a record that no longer
    exists, a request the remote side rejected as invalid.
    """


class ForwardingError(OutboxError):
    """A broker refused a forwarded message or did not acknowledge it in time; the message
    is the broker's answer, kept as the job's ``last_error``. The attempt counts: the job
    is retried with backoff, dead once out of attempts."""


class UndeliverableError(ForwardingError, PermanentError):
    """A forwarded message no retry can deliver (larger than the broker accepts, a subject
    no stream binds, an address its event cannot fill): the job is dead-lettered at once."""


class LeaseLostError(OutboxError):
    """The worker no longer owns the job: its lease expired and the reaper (or another
    worker) took it back, or the relay released it while shutting down.

    Raised by :meth:`outbox.Job.check_lease`; the handler should stop, since anything it
    reports afterwards is discarded (the fence no longer matches).
    """


class StaleFenceError(OutboxError):
    """A fenced write was refused because a newer fence already wrote the row.

    Raised only by :func:`outbox.fenced_write` with ``raise_on_stale=True``; by default it
    returns ``False`` instead.
    """


class DatabaseUnavailableError(OutboxError):
    """The database cannot be reached (refused, timed out, authentication failed).

    The message never contains the password of the URL.
    """


class DatabaseStatementError(OutboxError):
    """A statement failed in the database for a reason outbox does not handle itself: a
    permission refused, a constraint violated, a lock or statement timeout, the server out
    of disk.

    Raised where outbox translates database errors (the command line, a relay starting);
    the message is the driver's error class and the first line of its message, never the
    SQL or its parameters, never the password of the URL. The driver's exception is the
    ``__cause__``.
    """


class SchemaNotReadyError(OutboxError):
    """The database lacks outbox's tables or has an older schema revision.

    Fix: run ``outbox-relay migrate``.
    """


class DrainLimitError(OutboxError):
    """:func:`outbox.testing.drain` still found jobs to run after its ``max_rounds`` rounds:
    a handler that keeps publishing events its own consumers handle, or retries that never
    end. ``results`` holds what ran until then."""

    def __init__(self, message: str, results: list[Any]) -> None:
        super().__init__(message)
        self.results = results


class NotBlockingError(OutboxError):
    """``outbox-relay skip`` (:func:`outbox.admin.skip_dead_job`) was given a job that is
    not a dead job holding an ordered key (no such job, another status, already skipped or
    unordered); nothing was written."""


class HandlerMisuseError(ConfigurationError, PermanentError):
    """A handler used outbox in a way no retry can fix: it committed the transaction the
    relay owns (``session.commit()`` in a transactional handler), or returned an awaitable
    instead of running it (a ``def`` handler that returns a coroutine: the work never ran).
    Permanent: the job is dead at once with this message, not retried."""


class TransactionEndedError(PermanentError):
    """A transactional handler ended the transaction outbox began for it (a raw ``COMMIT`` or
    ``ROLLBACK``, closing its session) instead of leaving the commit to outbox: its writes
    could no longer commit together with the fenced completion. Recorded as the job's
    failure, permanent (dead at once), since the handler would do the same on every attempt;
    writes it committed itself stay committed (the database cannot take them back)."""


#: Longest a job may be snoozed at once, seconds (30 days).
MAX_SNOOZE_SECONDS = 30 * 24 * 3600.0


class Snooze(OutboxError):
    """Raise from a handler to put its job back to ``ready`` in ``seconds`` seconds (a
    finite number, 0 to :data:`MAX_SNOOZE_SECONDS`) without counting the attempt.

    The job's ``attempts`` is given back and its ``snoozes`` counter goes up by one
    (fenced, like every outcome; a transactional handler's writes roll back first). A job
    may be snoozed any number of times: snoozes are counted apart from attempts and shown
    by the CLI (architecture notes, "Timeouts and snooze"). Constructing it with bad
    ``seconds`` raises :class:`ConfigurationError` naming the value, so the attempt fails
    with that error instead.
    """

    def __init__(self, seconds: float) -> None:
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not (
                0 <= seconds <= MAX_SNOOZE_SECONDS):  # NaN fails the comparison too
            raise ConfigurationError(
                f"Snooze: seconds must be a finite number from 0 to {MAX_SNOOZE_SECONDS:g}, got {seconds!r}")
        self.seconds = float(seconds)
        super().__init__(f"snoozed for {self.seconds:g} s")


class HandlerTimeoutError(OutboxError):
    """Recorded as a job's failure when its handler ran past its subscriber's
    ``timeout=``: an ``async def`` handler was cancelled; a ``def`` handler's thread cannot
    be stopped, so its attempt was failed and the job handed back while the thread runs on
    (its result is dropped). Counted like any failure: a handler that always hangs ends
    dead after ``max_attempts``."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        super().__init__(f"handler timed out after {seconds:g} s")
