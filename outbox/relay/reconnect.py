"""Reconnecting after the database went away: one :class:`Reconnector` per relay, shared by
every loop that talks to the database (router, maintenance, heartbeat, the job runner's
dispatcher, the listener).

Why one shared object: while PostgreSQL is down (restarted, failed over, unreachable) every
loop fails on its own. Each used to sleep out its own capped exponential backoff (0.2 s
doubling up to ``reconnect_max``, 10 s by default), so once the server accepted connections
again a loop could sleep on for up to ``reconnect_max`` seconds, and the router, then the
dispatcher, came back one after the other (about 11 s, then 12 s more, after a restart).

How it works:

* A **lost connection** (:func:`outbox.db.engine.is_disconnect`: refused, broken or
  terminated connection, server shutting down or starting up) is replaced **at once**: the
  first disconnect of a run is retried with no wait, and that retry opens a new connection.
  One connection ended by ``pg_terminate_backend``, a pooler or a network blip says nothing
  about the server, and waiting before a retry that would have worked stalled the router
  and the dispatcher 0.25-0.5 s per lost connection (issue 26, item 7: with its backends
  killed twice a second a relay offered 600 jobs/s ran 427-528 and built backlogs of
  2,400-4,200 jobs).
* Only when that retry fails too (connecting fails: the server is down, restarting or
  unreachable) is the database marked **unreachable**, and the loop retries after a short
  jittered **probe** interval, :data:`PROBE_INTERVAL` (0.25-0.5 s): while the server is
  down a connection attempt is refused at once, so probing is cheap.
* The first loop whose round trip gets through calls :meth:`Reconnector.recovered`, which
  **announces** it when the database was marked unreachable: every loop waiting out a probe
  interval retries at once. The listener, which reconnects on its own connection, announces
  the same way. So after an outage work resumes within about one probe interval (plus a
  connect) of the server accepting connections again.
* Any other error (a statement the server refused, a lock timeout, a bug) keeps the capped
  exponential backoff up to ``reconnect_max``: retrying at once would not fix it, and an
  announcement does not cut that wait short.
* Every wait ends within :data:`STOP_CHECK` seconds of the loop's ``stop`` event being set.

Failure logging: a loop logs its first failure of a run of disconnects (the rest of the
run is expected), every other error, and one line when it gets through again. Nothing here
raises; what a loop does with the work it could not do (the dispatcher keeps its outcomes
for the next round) is the loop's business.

The connections themselves recover through the pool: the relay's engine pre-pings every
checkout (:func:`outbox.db.engine.make_engine`), so the first checkout after a restart finds
its connection dead and SQLAlchemy invalidates the whole pool at once; the dispatcher drops
its own connection on a disconnect and checks out a fresh one on its next round.
"""

from __future__ import annotations

import logging
import random
import threading
import time

from outbox import backoff
from outbox.db.engine import describe, is_disconnect

log = logging.getLogger(__name__)

#: Longest wait between two tries while the database is unreachable, seconds; each wait is
#: drawn between half of it and all of it (jitter), so a relay's loops do not probe in step.
PROBE_INTERVAL = 0.5
#: First wait of the capped backoff that errors other than disconnects get, seconds.
BACKOFF_BASE = 0.2
#: Longest a wait takes to notice its ``stop`` event, seconds.
STOP_CHECK = 0.1


class Reconnector:
    """The reconnect policy of one relay: a lost connection replaced at once, short probes
    while connecting fails (the database unreachable), all waiting loops released as soon
    as one gets through, capped backoff (up to ``reconnect_max`` seconds) for every other
    error. Thread-safe; share one per relay."""

    def __init__(self, reconnect_max: float, *, probe_interval: float = PROBE_INTERVAL,
                 rng: random.Random | None = None) -> None:
        self.reconnect_max = reconnect_max
        self.probe_interval = probe_interval
        self._rng = rng or random.Random()
        self._cond = threading.Condition(threading.Lock())
        self._unreachable = False
        self._epoch = 0  # bumped by every announcement that the database is reachable again
        #: Announcements made (the database reachable again after a disconnect), for tests and stats.
        self.announcements = 0

    @property
    def unreachable(self) -> bool:
        """True from a failed retry after a disconnect (connecting failed) until some loop
        gets a round trip through."""
        return self._unreachable

    def delay(self, failures: int, exc: BaseException) -> float:
        """Seconds to wait before try number ``failures + 1`` (``failures``: the failed tries
        in a row, this one included): none after the first disconnect (the lost connection is
        replaced at once), a probe interval (0.5x to 1x of :attr:`probe_interval`) after
        every further one, else the capped jittered backoff of
        :func:`outbox.backoff.retry_delay` (base 0.2 s, cap ``reconnect_max``)."""
        if is_disconnect(exc):
            return 0.0 if failures <= 1 else self.probe_interval * self._rng.uniform(0.5, 1.0)
        cap = max(BACKOFF_BASE, self.reconnect_max)
        return backoff.retry_delay(max(1, failures), base=BACKOFF_BASE, cap=cap, jitter=0.5, rng=self._rng)

    def backoff(self, failures: int, what: str, exc: BaseException, stop: threading.Event | None, *,
                cap: float | None = None, log_failure: bool = True) -> int:
        """A round trip of loop ``what`` failed with ``exc`` (its ``failures``-th failure in a
        row before this one): log it, wait (see the module docstring; at most ``cap``
        seconds when given; until ``stop`` is set at the latest) and return ``failures + 1``.
        The first disconnect of a run returns at once: the loop's next try replaces the
        connection. A disconnect on that try or a later one (connecting failed) marks the
        database unreachable and waits for a probe interval or an announcement."""
        failures += 1
        disconnect = is_disconnect(exc)
        down = disconnect and failures > 1  # the try after a lost connection failed too
        with self._cond:
            epoch = self._epoch
            if down:
                self._unreachable = True
        if log_failure and (failures == 1 or not disconnect):
            log.warning("database error in %s (%s); retrying %s", what, describe(exc),
                        "at once on a new connection, then as soon as the database is reachable" if disconnect
                        else "with backoff")
        delay = self.delay(failures, exc)
        if cap is not None:
            delay = min(delay, cap)
        self.wait(delay, stop, epoch if disconnect else None)
        return failures

    def wait(self, seconds: float, stop: threading.Event | None, epoch: int | None = None) -> bool:
        """Wait ``seconds``, or until ``stop`` is set, or (``epoch`` given: the value of
        :meth:`epoch` when the failure happened) until the database is announced reachable
        after it. Returns True when an announcement ended the wait."""
        deadline = time.monotonic() + seconds
        with self._cond:
            while True:
                if epoch is not None and self._epoch != epoch:
                    return True
                left = deadline - time.monotonic()
                if left <= 0 or (stop is not None and stop.is_set()):
                    return False
                self._cond.wait(min(left, STOP_CHECK) if stop is not None else left)

    def epoch(self) -> int:
        """How many times the database was announced reachable again so far."""
        with self._cond:
            return self._epoch

    def recovered(self, failures: int, what: str) -> int:
        """A round trip of loop ``what`` got through (after ``failures`` failed ones): log it
        when it had failed, announce it when the database was marked unreachable (every
        waiting loop retries at once), and return 0, the new failure count. Cheap when
        nothing failed: a loop calls it after every round."""
        if failures:
            log.info("database reachable again (%s) after %d failed tries", what, failures)
        if self._unreachable:
            with self._cond:
                if self._unreachable:
                    self._unreachable = False
                    self._epoch += 1
                    self.announcements += 1
                    self._cond.notify_all()
        return 0
