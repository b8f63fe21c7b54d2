"""Pacing: how far a runner's claims run ahead of its workers, from how fast they finish.

A relay at its defaults must not need tuning to go fast (issue 33): the settings that make
the end-to-end bench fastest (many worker slots, large claims, no listed buffer) are wrong
for handlers that take seconds, and the defaults that suit those (8 workers, claims of 50,
a buffer of 50) leave a quick handler's relay waiting on round trips: each claim of at most
58 jobs pays the round's fixed cost (about 1.3 ms), and every hand-over from the buffer
pays a statement of the starter's (performance notes, levers 13 and 21).

:class:`Pacing` measures the rate at which the workers finish jobs (every
``SAMPLE_EVERY`` seconds or more: a higher rate counts at once, a lower one replaces half
the figure every ``HALF_LIFE`` seconds) and derives from it:

* ``ahead``: jobs handed to the worker pool beyond its idle threads, waiting in the pool's
  queue for the next thread to come free: what the workers get through in ``HORIZON``
  seconds at the measured rate, at most ``AHEAD_MAX``. A job handed to the pool is started
  as far as the database knows (not listed in the relay's row), like a job handed to one of
  512 threads the operating system has not run yet: a ``kill -9`` charges its attempt. The
  horizon bounds that: what a relay's crash charges beyond its running handlers is at most
  ``HORIZON`` seconds of its workers' work (architecture notes, "Attempts and crashes").
  0 while any handler is hung past its timeout (its thread may never come back), and 0
  with one job a minute (the rate decays to nothing: every job goes to an idle thread, as
  before).
* ``claim_batch``: the most jobs a claim asks for: what the workers and the forwarders'
  brokers (their acknowledgements, measured the same way) get through in ``HORIZON``
  seconds, bounded to [``BATCH_MIN``, ``BATCH_MAX``]: a large claim only while they get
  through it.

* **threads** (an elastic pool): handlers that wait (on a socket, a sleep, an API) leave
  the CPU idle while jobs wait for one of ``concurrency`` threads. While jobs wait for a
  thread, the handlers spent more than ``WAITING`` of their time off the CPU in the last
  measure (thread CPU time against wall time), the whole process used less than
  ``GIL_BUSY`` of a core (so the time off the CPU is not a wait for Python's GIL), and no
  handler is hung past its timeout, the pool doubles, up to ``THREADS_MAX``, on trial:
  unless the workers' rate over the next ``TRIAL`` seconds rose by ``GAIN``, the new
  threads retire as they finish their jobs and the pool does not grow for ``RETRY_AFTER``
  seconds (a thread waiting for the GIL, or for a CPU a busy host does not give it, looks
  like one waiting on I/O; only the rate tells). A thread beyond ``concurrency`` that
  finds no job for ``IDLE_EXIT`` seconds ends. Handlers bound by the CPU do not keep more
  threads, and one job a minute never grows it (no job waits).

* **a second dispatcher on standby**: with ``dispatchers`` not set (and room in the pool
  for one more connection), the runner has a second dispatcher that runs rounds only while
  the backlog is deep: while claims of ``BATCH_MAX`` come back full (each such claim keeps
  it on for ``DEEP_FOR`` seconds; a claim that comes back short ends it). Two statements in
  flight pay with large claims and cost with small ones (performance notes, lever 14), so
  the second one waits, parked, the rest of the time.

Explicit settings win: with ``prefetch`` set (env, flag or constructor) nothing is handed
ahead, with ``claim_batch`` set the batch is that, and with ``concurrency`` set the pool
has that many threads. A registry with transactional handlers keeps ``concurrency``
threads too: each holds a connection of the relay's pool, sized from ``concurrency``
(``pool_size``). The buffer (``prefetch``, 50 by default) stays, for jobs claimed beyond
``ahead`` while handlers take time.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

from outbox.relay.claims import HeldClaims
from outbox.settings import OutboxSettings
from outbox.telemetry.metrics import PacingReading

#: Seconds of the workers' work that may wait in the pool's queue (and be charged by a crash).
HORIZON = 0.025
#: Most jobs handed to the pool beyond its threads: two claims of ``BATCH_MAX``.
AHEAD_MAX = 500
#: Bounds of the adaptive claim batch (the default setting, and the bench's best batch).
BATCH_MIN, BATCH_MAX = 50, 250
#: Least seconds between two measurements of the workers' rate; a lower rate than the last
#: figure replaces half of it every ``HALF_LIFE`` seconds (a higher one at once).
SAMPLE_EVERY, HALF_LIFE = 0.05, 0.1
#: Most worker threads an elastic pool grows to.
THREADS_MAX = 128
#: Share of the handlers' time spent off the CPU above which more threads help.
WAITING = 0.5
#: Cores the whole process may use for the pool to grow: a thread waiting for Python's GIL
#: is off the CPU too, and a process near one core of Python is bound by the GIL, where
#: more threads only add contention (found by issue 33's adversarial run: a pure-Python loop
#: grew the pool to 128 threads for nothing).
GIL_BUSY = 0.75
#: Seconds after a growth that its effect is measured over (a trial), the rise in the
#: workers' rate it must bring to stay, and how long the pool does not try again after one
#: that did not: a thread waiting for the GIL, or for a CPU a busy host does not give the
#: process, is off the CPU like one waiting on I/O, and only the rate tells them apart (as
#: .NET's thread pool climbs: keep a change only if throughput rose).
TRIAL, GAIN, RETRY_AFTER = 0.3, 1.5, 10.0
#: Seconds a thread beyond ``concurrency`` waits for a job before it ends.
IDLE_EXIT = 30.0
#: Seconds a full claim of ``BATCH_MAX`` keeps the standby dispatcher running.
DEEP_FOR = 1.0

log = logging.getLogger(__name__)


class Pacing:
    """Sizes ``claims``' hand-off to the worker pool and the claims of a runner from the rate
    its workers finish jobs, unless ``settings`` fix them (see the module notes). Shared by
    the runner's dispatchers; :meth:`update` is cheap and may be called every round.

    ``grow(n)``, when given, starts ``n`` more worker threads (the runner's), or with ``n``
    negative retires that many as they finish their jobs: the pool is
    elastic unless ``settings`` fix ``concurrency``; the runner passes None for a registry
    with transactional handlers."""

    def __init__(self, settings: OutboxSettings, claims: HeldClaims,
                 grow: Callable[[int], None] | None = None) -> None:
        explicit = settings.model_fields_set
        self.settings = settings
        self.claims = claims
        self.adapt_ahead = "prefetch" not in explicit
        self.fixed_batch = settings.claim_batch if "claim_batch" in explicit else None
        self.grow = grow if "concurrency" not in explicit else None
        self.rate = 0.0  # jobs finished per second by the workers, smoothed
        self.forward_rate = 0.0  # forwarders' jobs their brokers acknowledged per second, smoothed
        self._lock = threading.Lock()
        self._at = time.monotonic()
        self._finished, self._acknowledged = claims.finished, claims.acknowledged
        self._wall = self._cpu = 0.0  # the handlers' wall and thread CPU seconds since the last measure
        self._process_cpu = time.process_time()  # the process's CPU seconds (every thread) at the last measure
        self._history: collections.deque[tuple[float, int]] = collections.deque(maxlen=64)  # (now, finished)
        self._trial: tuple[float, int, float, int] | None = None  # (started, finished then, rate before, threads added)
        self._quiet_until = 0.0  # no growth before this monotonic time (a trial failed)
        self._deep_until = 0.0  # monotonic time until which the backlog counts as deep

    def handled(self, wall: float, cpu: float) -> None:
        """A worker ran a job: ``wall`` seconds, ``cpu`` of them on the CPU (its thread's)."""
        with self._lock:
            self._wall += wall
            self._cpu += cpu

    def update(self, now: float | None = None) -> None:
        """Measure the workers' rate when ``SAMPLE_EVERY`` seconds have passed since the last
        measurement, and set ``claims.ahead`` from it. ``now``: monotonic seconds."""
        now = time.monotonic() if now is None else now
        if now - self._at < SAMPLE_EVERY or not self._lock.acquire(blocking=False):
            return
        try:
            finished, acknowledged, span = self.claims.finished, self.claims.acknowledged, now - self._at
            keep = 0.5 ** (span / HALF_LIFE)  # a higher rate counts at once, a lower one by halves
            sample = (finished - self._finished) / span
            self.rate = max(sample, keep * self.rate + (1 - keep) * sample)
            sample = (acknowledged - self._acknowledged) / span
            self.forward_rate = max(sample, keep * self.forward_rate + (1 - keep) * sample)
            process_cpu = time.process_time()
            busy = (process_cpu - self._process_cpu) / span  # cores the process used
            self._at, self._finished, self._acknowledged, self._process_cpu = now, finished, acknowledged, process_cpu
            self._history.append((now, finished))
            wall, cpu, self._wall, self._cpu = self._wall, self._cpu, 0.0, 0.0
            if self.adapt_ahead:
                self.claims.ahead = min(AHEAD_MAX, round(self.rate * HORIZON))
        finally:
            self._lock.release()
        if self.grow is None:
            return
        if self._trial is not None:
            self._judge(now, finished)
        elif (now >= self._quiet_until and wall > 0 and 1 - cpu / wall > WAITING and busy < GIL_BUSY
              and self.claims.concurrency < THREADS_MAX and not self.claims.hung and self.claims.waiting_for_thread()):
            before = self._rate_over(now, TRIAL)
            if before is not None:
                threads = self.claims.concurrency
                more = min(threads, THREADS_MAX - threads)
                log.info("worker threads %d -> %d: handlers wait %.0f %% of their time and jobs wait for a thread",
                         threads, threads + more, 100 * (1 - cpu / wall))
                self._trial = (now, finished, before, more)
                self.grow(more)

    def _rate_over(self, now: float, seconds: float) -> float | None:
        """The workers' plain rate over the last ``seconds`` (None: not measured that long)."""
        last_at, last = self._history[-1]
        for at, finished in reversed(self._history):
            if now - at >= seconds:
                return (last - finished) / (last_at - at)
        return None

    def _judge(self, now: float, finished: int) -> None:
        """End a trial ``TRIAL`` seconds after its growth: keep the threads if the workers'
        rate rose by ``GAIN``, else take them back and try again after ``RETRY_AFTER``."""
        assert self._trial is not None and self.grow is not None
        started, finished_then, before, added = self._trial
        if now - started < TRIAL:
            return
        self._trial = None
        after = (finished - finished_then) / (now - started)
        if after >= before * GAIN:
            return
        threads = self.claims.concurrency
        log.info("worker threads %d -> %d: %d more ran %.0f jobs/s against %.0f before (a wait for the CPU or "
                 "the GIL, not for I/O); no growth for %gs", threads, threads - added, added, after, before,
                 RETRY_AFTER)
        self._quiet_until = now + RETRY_AFTER
        self.grow(-added)

    def claimed(self, asked: int, got: int, now: float | None = None) -> None:
        """A claim asked for ``asked`` jobs and got ``got``: a full one of ``BATCH_MAX`` or more
        keeps the backlog deep for ``DEEP_FOR`` seconds, a short one ends it. ``now``:
        monotonic seconds."""
        if got < asked:
            self._deep_until = 0.0
        elif asked >= BATCH_MAX:
            self._deep_until = (time.monotonic() if now is None else now) + DEEP_FOR

    def deep(self, now: float | None = None) -> bool:
        """Whether the backlog is deep (see :meth:`claimed`): the standby dispatcher runs."""
        return (time.monotonic() if now is None else now) < self._deep_until

    def describe(self, dispatchers: int) -> str:
        """The runner's sizes for its start line, the paced ones marked as such
        (``dispatchers``: the runner's, a standby one included)."""
        settings = self.settings
        threads = f"concurrency {settings.concurrency}" + (f" (elastic, up to {THREADS_MAX})" if self.grow else "")
        batch = (f"claim_batch {self.fixed_batch}" if self.fixed_batch is not None
                 else f"claim_batch paced {BATCH_MIN}-{BATCH_MAX}")
        ahead = f"prefetch {settings.prefetch}" + (f" (+ up to {AHEAD_MAX} handed ahead, paced)" if self.adapt_ahead
                                                   else "")
        standby = dispatchers - settings.dispatchers
        return (f"{threads}, {batch}, {ahead}, dispatchers {settings.dispatchers}"
                + (f" (+{standby} on standby for a deep backlog)" if standby else ""))

    def reading(self, standby: bool) -> PacingReading:
        """What the pacing sizes now, for the metrics (``standby``: whether the runner has a
        standby dispatcher)."""
        threads, ahead = self.claims.pool_sizes()
        return PacingReading(threads=threads, ahead=ahead, claim_batch=self.claim_batch(),
                             standby=self.deep() if standby else None)

    def claim_batch(self) -> int:
        """Most jobs one claim asks for: the setting when given, else what the workers and the
        forwarders' brokers get through in ``HORIZON`` seconds, bounded to [``BATCH_MIN``,
        ``BATCH_MAX``]."""
        if self.fixed_batch is not None:
            return self.fixed_batch
        return max(BATCH_MIN, min(BATCH_MAX, round((self.rate + self.forward_rate) * HORIZON)))
