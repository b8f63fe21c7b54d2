"""The watchdog: handler timeouts for handlers that cannot be cancelled.

A subscriber's ``timeout=`` bounds each attempt of its handler. An ``async def`` handler is
cancelled by its own event loop (``asyncio.timeout``, in the executor). A ``def`` handler
runs in a worker thread, and Python cannot stop a thread: so the executor arms this
watchdog before the handler starts and disarms it when the handler returns. When a
deadline passes first, the watchdog fires ``on_timeout(job, seconds)``: the runner then
fails the attempt (counted, fenced, ``last_error`` "handler timed out after N s", backoff
like any failure, dead when out of attempts) and hands the job back so any relay can run
it again; the claim is forgotten, so its heartbeats stop. The thread runs on; whatever it
ends with is dropped (``Outcome.TIMED_OUT``), and a transactional handler's transaction is
rolled back before its completion (or, had it got that far, fenced out).

The hung thread keeps its worker slot until it returns: the relay never claims work it
could not run, logs how many slots hung handlers hold, and, once every slot is held, claims
nothing and hands its buffered claims back. An ``async def`` handler is watched too, one
second past its timeout, in case it blocks its event loop or ignores cancellation.

A handler that always hangs ends dead after ``max_attempts`` attempts, like one that always
fails: a timeout is a failure, never a release.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Callable

from outbox.job import Job

#: How long past its timeout an ``async def`` handler is watched, seconds (its own event
#: loop cancels it at the timeout; the watchdog is for loops the handler blocks).
ASYNC_BACKSTOP_SECONDS = 1.0


class Watchdog:
    """Calls ``on_timeout(job, seconds)`` (from its own thread, :meth:`run`) for each job
    whose handler is still running ``seconds`` after :meth:`arm`. Thread-safe."""

    def __init__(self, on_timeout: Callable[[Job, float], None]) -> None:
        self.on_timeout = on_timeout
        self._cond = threading.Condition()
        self._armed: dict[int, tuple[float, Job, float]] = {}  # fence -> (deadline, job, seconds)
        self._deadlines: list[tuple[float, int]] = []  # heap of (deadline, fence)
        self._fired: set[int] = set()
        self._stopped = False

    def arm(self, job: Job, seconds: float) -> None:
        """Watch ``job``'s handler, which starts now, for ``seconds`` seconds."""
        deadline = time.monotonic() + seconds
        with self._cond:
            self._armed[job.fence] = (deadline, job, seconds)
            heapq.heappush(self._deadlines, (deadline, job.fence))
            self._cond.notify()

    def disarm(self, job: Job) -> bool:
        """Stop watching ``job`` (its handler returned, or its completion is about to be
        written); returns whether the watchdog had already fired for it."""
        with self._cond:
            self._armed.pop(job.fence, None)
            return job.fence in self._fired

    def end(self, job: Job) -> bool:
        """:meth:`disarm`, and forget ``job`` (the executor is done with it)."""
        with self._cond:
            self._armed.pop(job.fence, None)
            fired = job.fence in self._fired
            self._fired.discard(job.fence)
            return fired

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def run(self) -> None:
        """Fire for each deadline that passes while its job is armed, until :meth:`stop`."""
        while True:
            due: list[tuple[Job, float]] = []
            with self._cond:
                while not self._stopped and not due:
                    now = time.monotonic()
                    while self._deadlines and self._deadlines[0][0] <= now:
                        deadline, fence = heapq.heappop(self._deadlines)
                        entry = self._armed.get(fence)
                        if entry is not None and entry[0] == deadline:
                            del self._armed[fence]
                            self._fired.add(fence)
                            due.append((entry[1], entry[2]))
                    if not due:
                        wait = self._deadlines[0][0] - now if self._deadlines else None
                        self._cond.wait(wait)
                if self._stopped:
                    return
            for job, seconds in due:
                self.on_timeout(job, seconds)
