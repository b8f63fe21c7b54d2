"""Pacing in a running relay (:mod:`outbox.relay.pacing`), real PostgreSQL: at its defaults a
relay hands quick handlers' jobs to the pool ahead of its threads and claims more per
round; an elastic pool grows for handlers that wait and shrinks back when idle; explicit
settings and transactional handlers keep the threads fixed; a job handed ahead whose
handler never started is released at SIGTERM with its attempt given back."""

from __future__ import annotations

import threading
import time

import pytest
import sqlalchemy as sa

from outbox import Job, Outbox
from outbox.relay import pacing
from outbox.testing import wait_for

from .helpers import publish_events, running_relay

TIMEOUT = 60


def workers() -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith("outbox-worker-") and t.is_alive())


def done(engine: sa.Engine) -> int:
    with engine.connect() as c:
        return c.execute(sa.text("SELECT count(*) FROM outbox_jobs WHERE status = 'done'")).scalar_one()


class Waiting:
    """A handler that waits 20 ms off the CPU (``time.sleep``, as on I/O) and counts the most
    of its runs at once (:attr:`most`); a transactional subscriber's session is ignored."""

    def __init__(self) -> None:
        self.running = self.most = 0
        self.lock = threading.Lock()

    def __call__(self, job: Job, *session: object) -> None:
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
        time.sleep(0.02)
        with self.lock:
            self.running -= 1


def spin(job: Job) -> None:
    """A handler of pure Python on the CPU (about a millisecond): it waits for the GIL, not on I/O."""
    x = 0
    for i in range(20_000):
        x += i * i


@pytest.mark.parametrize("handler", [lambda job: None, spin], ids=["no-op", "cpu"])
def test_quick_handlers_get_jobs_handed_ahead_and_the_threads_stay(engine, settings, handler):
    ob = Outbox()
    ob.subscriber("t", consumer="a")(handler)
    seen: list[tuple[int, int]] = []
    most: list[int] = []
    with running_relay(ob, settings()) as relay:
        runner = relay.runner
        assert runner is not None and runner.pacing.grow is not None
        assert workers() == 8
        publish_events(engine, "t", [{"n": i} for i in range(6_000)])

        def look() -> bool:
            seen.append((runner.claims.ahead, runner.pacing.claim_batch()))
            most.append(runner.claims.concurrency)
            return done(engine) == 6_000

        wait_for(look, timeout=TIMEOUT, interval=0.01, what="6,000 quick jobs done")
        # Handlers on the CPU (or waiting for the GIL) do not keep growing the pool: a growth on
        # trial that did not raise the rate is taken back (a trial that noise or a burst's ramp-up
        # fooled may keep a doubling or two on a loaded machine; the first rule went to 128).
        assert max(most) <= 32, most
        wait_for(lambda: runner.claims.concurrency <= 32 and workers() == runner.claims.concurrency, timeout=5,
                 interval=0.05, what="the pool's threads at its size")
    # Jobs handed ahead: what the workers finish in 25 ms, so fewer for the CPU-bound handler
    # (about 1 ms each; under a loaded machine's share of the GIL, 18 at most was seen).
    assert max(a for a, _ in seen) > (20 if handler is not spin else 5), seen
    assert handler is spin or max(b for _, b in seen) > 50, seen  # no-op: larger claims


def test_an_elastic_pool_grows_for_handlers_that_wait_and_shrinks_when_idle(engine, settings, monkeypatch):
    monkeypatch.setattr(pacing, "IDLE_EXIT", 0.5)
    ob = Outbox()
    wait_on_io = Waiting()
    ob.subscriber("t", consumer="a")(wait_on_io)
    with running_relay(ob, settings()) as relay:
        assert relay.runner is not None
        publish_events(engine, "t", [{"n": i} for i in range(3_000)])
        wait_for(lambda: done(engine) == 3_000, timeout=TIMEOUT, interval=0.05, what="3,000 waiting jobs done")
        assert wait_on_io.most > 8, wait_on_io.most  # more handlers at once than the 8 threads of the setting
        assert relay.runner.claims.concurrency <= pacing.THREADS_MAX
        wait_for(lambda: relay.runner.claims.concurrency == 8 and workers() == 8, timeout=10, interval=0.1,
                 what="the pool back to 8 threads once idle")


@pytest.mark.parametrize("fixed", ["concurrency", "transactional"])
def test_an_explicit_concurrency_or_transactional_handlers_keep_the_threads(engine, settings, fixed):
    ob = Outbox()
    wait_on_io = Waiting()
    ob.subscriber("t", consumer="a", transactional=fixed == "transactional")(wait_on_io)
    with running_relay(ob, settings(**({"concurrency": 8} if fixed == "concurrency" else {}))) as relay:
        assert relay.runner is not None and relay.runner.pacing.grow is None
        publish_events(engine, "t", [{"n": i} for i in range(600)])
        wait_for(lambda: done(engine) == 600, timeout=TIMEOUT, interval=0.05, what="600 jobs done")
        assert wait_on_io.most == 8 and relay.runner.claims.concurrency == 8


def test_jobs_handed_ahead_and_not_started_get_their_attempt_back_at_sigterm(engine, settings):
    ob = Outbox()
    started: set[int] = set()
    ob.subscriber("t", consumer="a")(lambda job: (started.add(job.id), time.sleep(0.002)))
    publish_events(engine, "t", [{"n": i} for i in range(20_000)])
    with running_relay(ob, settings(shutdown_grace=5.0)) as relay:
        assert relay.runner is not None
        wait_for(lambda: relay.runner.claims.ahead > 0 and len(started) > 500, timeout=TIMEOUT, interval=0.01,
                 what="jobs handed ahead")
    with engine.connect() as c:
        rows = c.execute(sa.text("SELECT id, status, attempts FROM outbox_jobs")).all()
    never = [(i, s, a) for i, s, a in rows if i not in started]
    assert never and all(s == "ready" and a == 0 for _, s, a in never), never[:5]
    assert all(s == "done" and a == 1 for i, s, a in rows if i in started)


def test_the_standby_dispatcher_runs_only_while_the_backlog_is_deep(engine, settings):
    ob = Outbox()
    ob.subscriber("t", consumer="a")(lambda job: None)
    # Claims of the paced maximum (250) with room for them, set rather than paced: the paced
    # size reaches 250 only at 10,000 jobs/s, which a loaded test machine may never run.
    with running_relay(ob, settings(claim_batch=pacing.BATCH_MAX, prefetch=2 * pacing.BATCH_MAX)) as relay:
        runner = relay.runner
        assert runner is not None and len(runner.dispatchers) == 2
        standby = runner.dispatchers[-1]
        assert standby.standby is not None
        publish_events(engine, "t", [{"n": i} for i in range(30)])
        wait_for(lambda: done(engine) == 30, timeout=TIMEOUT, interval=0.02, what="30 jobs done")
        assert standby.connection._conn is None  # a small backlog: parked, never connected
        deep = []
        publish_events(engine, "t", [{"n": i} for i in range(30_000)])

        def look() -> bool:
            deep.append(runner.pacing.deep())
            return done(engine) == 30_030

        wait_for(look, timeout=TIMEOUT, interval=0.01, what="30,030 jobs done")
        assert any(deep) and standby.connection._conn is not None  # it ran rounds
        wait_for(lambda: not runner.pacing.deep(), timeout=5, interval=0.05, what="the backlog no longer deep")
    with engine.connect() as c:
        assert c.execute(sa.text("SELECT count(*) FROM outbox_relays")).scalar_one() == 0  # both left the row


def test_an_explicit_dispatchers_setting_has_no_standby(engine, settings):
    ob = Outbox()
    ob.subscriber("t", consumer="a")(lambda job: None)
    with running_relay(ob, settings(dispatchers=1)) as relay:
        assert relay.runner is not None and len(relay.runner.dispatchers) == 1
        assert relay.runner.dispatchers[0].standby is None
