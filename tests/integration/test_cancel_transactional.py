"""Cancelling a running transactional job, on a real relay and database (issue 26, item 1).

The rule: the status tells the truth. A transactional attempt that ends ``cancelled``
committed nothing of its handler's transaction (it was rolled back, and the job then
marked cancelled, fenced, in a transaction of its own); a job whose handler's transaction
committed is ``done``, and a cancel that arrives after that finds it done and says so.

Both orders of the race on the job's row lock are driven here by the database itself:
the cancel's ``UPDATE`` holding the row when the fenced completion comes (the completion
waits, then sees the cancel), and the completion holding it when the cancel comes (its
commit held by a deferred trigger waiting on an advisory lock the test owns; the cancel
waits, then finds the job done). Then 100 jobs, each cancelled at a random point while its
handler runs: for every one, ``cancelled`` exactly when its write is absent.
"""

from __future__ import annotations

import asyncio
import queue
import random
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from outbox import Job, Outbox, admin, publish
from outbox.db import queries
from outbox.db.engine import make_engine
from outbox.ops.cli import main
from outbox.relay.relay import Relay
from outbox.testing import drain, wait_for

from .helpers import job_row, publish_events, running_relay

TIMEOUT = 30
#: The advisory lock key the deferred trigger waits on (test B holds it to delay a commit).
COMMIT_GATE = 4242


@pytest.fixture
def effects(engine: sa.Engine) -> Callable[[], dict[int, int]]:
    """A domain table the handlers write to (one row per write, a job's id in each); returns
    a reader: job id -> rows committed for it."""
    with engine.begin() as c:
        c.execute(sa.text("CREATE TABLE effects (id bigserial PRIMARY KEY, job_id bigint NOT NULL)"))

    def rows() -> dict[int, int]:
        with engine.connect() as c:
            return dict(c.execute(sa.text("SELECT job_id, count(*) FROM effects GROUP BY job_id")).all())

    return rows


def _url(db_url: sa.URL) -> list[str]:
    return ["--database-url", db_url.render_as_string(hide_password=False)]


class Handler:
    """One transactional handler of consumer ``tx`` (``def`` or ``async def``): writes an
    effect row, records its backend's pid, says it started, then returns when it sees
    ``job.cancel_requested`` (``watch``) or when the test sets ``proceed`` (it ignores the
    flag), whichever it is told to wait for."""

    def __init__(self, ob: Outbox, kind: str, *, watch: bool, lease: float = 1.5) -> None:
        self.started = threading.Event()
        self.proceed = threading.Event()
        self.pid: int | None = None
        self.jobs: list[Job] = []
        self.watch = watch
        deadline = TIMEOUT

        if kind == "sync":
            @ob.subscriber("t", consumer="tx", transactional=True, lease=lease)
            def handler(job: Job, session: Session) -> None:
                session.execute(sa.text("INSERT INTO effects (job_id) VALUES (:j)"), {"j": job.id})
                self._started(job, session.execute(sa.text("SELECT pg_backend_pid()")).scalar_one())
                end = time.monotonic() + deadline
                while not self._may_return(job) and time.monotonic() < end:
                    time.sleep(0.02)
        else:
            @ob.subscriber("t", consumer="tx", transactional=True, lease=lease)
            async def handler(job: Job, session: AsyncSession) -> None:  # type: ignore[misc]
                await session.execute(sa.text("INSERT INTO effects (job_id) VALUES (:j)"), {"j": job.id})
                self._started(job, (await session.execute(sa.text("SELECT pg_backend_pid()"))).scalar_one())
                end = time.monotonic() + deadline
                while not self._may_return(job) and time.monotonic() < end:
                    await asyncio.sleep(0.02)

    def _started(self, job: Job, pid: int) -> None:
        self.jobs.append(job)
        self.pid = pid
        self.started.set()

    def _may_return(self, job: Job) -> bool:
        return job.cancel_requested if self.watch else self.proceed.is_set()


def _waits_on_lock(engine: sa.Engine, *, pid: int | None = None, application_name: str | None = None,
                   events: tuple[str, ...] = ("transactionid", "tuple")) -> bool:
    """Whether backend ``pid`` (or one whose application_name is ``application_name``) is
    waiting for a heavyweight lock of one of the kinds ``events``."""
    with engine.connect() as c:
        return bool(c.execute(sa.text(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND wait_event = ANY (:events) "
            "AND (pid = :pid OR application_name = :app)"),
            {"events": list(events), "pid": pid, "app": application_name}).scalar_one())


@pytest.fixture
def relay_of(settings) -> Iterator[Callable[[Outbox], Relay]]:
    """Starts a relay (one worker, no prefetch) for a registry; stops it at the end."""
    relays: list[Relay] = []

    def start(ob: Outbox, **overrides) -> Relay:
        relay = Relay(ob, settings(**{"concurrency": 1, "prefetch": 0, **overrides}))
        relays.append(relay)
        relay.start()
        return relay

    yield start
    for relay in relays:
        relay.stop()


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("watch", [True, False], ids=["watches_flag", "ignores_flag"])
def test_cancel_before_the_completion_rolls_the_handlers_writes_back(engine, db_url, effects, relay_of, capsys,
                                                                      kind, watch):
    """Cancel committed while the handler runs: the handler (watching ``cancel_requested``,
    or ignoring it and returning anyway) returns, its transaction's completion sees the
    cancel, the transaction rolls back (its write with it) and the job ends ``cancelled``."""
    ob = Outbox()
    handler = Handler(ob, kind, watch=watch)
    publish_events(engine, "t", [{"n": 1}])
    relay = relay_of(ob)
    assert handler.started.wait(TIMEOUT)
    [job] = handler.jobs
    assert main(["cancel", str(job.id), *_url(db_url)]) == 0
    assert f"asked 1 running job to stop (cancelled when the attempt ends): [{job.id}]" in capsys.readouterr().out
    handler.proceed.set()  # a handler ignoring the flag returns now, before any heartbeat told it
    wait_for(lambda: job_row(engine, job.id)["status"] != "running", timeout=TIMEOUT, what="the attempt's outcome")
    row = job_row(engine, job.id)
    assert (row["status"], effects()) == ("cancelled", {}), "a cancelled job committed its handler's write"
    assert row["attempts"] == 1 and row["finished_at"] is not None and row["lease_until"] is None
    wait_for(lambda: relay.runner is not None and relay.runner.stats["cancelled"] == 1, timeout=TIMEOUT,
             what="the relay counting one cancelled job")


@pytest.mark.parametrize("keep_done", [True, False], ids=["done_kept", "done_deleted"])
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_completion_waiting_on_the_cancels_row_lock_ends_cancelled_and_commits_nothing(
        engine, effects, relay_of, kind, keep_done):
    """The cancel's ``UPDATE`` holds the job's row (not yet committed) when the handler's
    fenced completion comes: the completion waits for it, then sees ``cancel_requested``
    on the row's newest version, so the handler's transaction rolls back and the job ends
    ``cancelled`` (kept, whatever ``retention_done``)."""
    ob = Outbox()
    handler = Handler(ob, kind, watch=False)
    publish_events(engine, "t", [{"n": 1}])
    relay_of(ob, retention_done=86400.0 if keep_done else 0.0)
    assert handler.started.wait(TIMEOUT)
    [job] = handler.jobs
    with engine.begin() as cancel:
        rows = cancel.execute(queries.job_cancel_many, {"ids": [job.id], "consumer": None,
                                                        "statuses": ["running"], "limit": 10}).all()
        assert [(r.id, r.status) for r in rows] == [(job.id, "running")]
        handler.proceed.set()
        wait_for(lambda: _waits_on_lock(engine, pid=handler.pid), timeout=TIMEOUT,
                 what="the completion waiting for the cancel's row lock")
    wait_for(lambda: job_row(engine, job.id)["status"] != "running", timeout=TIMEOUT, what="the attempt's outcome")
    assert (job_row(engine, job.id)["status"], effects()) == ("cancelled", {})


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_cancel_waiting_on_the_completions_row_lock_finds_the_job_done_and_says_so(
        engine, db_url, effects, relay_of, capsys, kind):
    """The handler's fenced completion holds the job's row when the cancel comes (its
    commit held by a deferred trigger until the test lets it go): the cancel waits for the
    row, then finds the job ``done`` and says so; the handler's write is committed."""
    with engine.begin() as c:
        c.execute(sa.text(
            "CREATE FUNCTION effects_commit_gate() RETURNS trigger LANGUAGE plpgsql AS "
            f"$$ BEGIN PERFORM pg_advisory_xact_lock_shared({COMMIT_GATE}); RETURN NULL; END $$"))
        c.execute(sa.text("CREATE CONSTRAINT TRIGGER effects_commit_gate AFTER INSERT ON effects "
                          "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION effects_commit_gate()"))
    ob = Outbox()
    handler = Handler(ob, kind, watch=False)
    handler.proceed.set()  # the handler returns at once: its completion runs, then its commit waits
    cancel_engine = make_engine(db_url, application_name="cancel-under-test")
    results: list[admin.CancelResult] = []
    try:
        with engine.connect() as gate:
            gate.execute(sa.text("SELECT pg_advisory_lock(:k)"), {"k": COMMIT_GATE})
            publish_events(engine, "t", [{"n": 1}])
            relay_of(ob)
            assert handler.started.wait(TIMEOUT)
            [job] = handler.jobs
            wait_for(lambda: _waits_on_lock(engine, pid=handler.pid, events=("advisory",)), timeout=TIMEOUT,
                     what="the handler's commit, after its completion, waiting at the gate")
            assert job_row(engine, job.id)["status"] == "running"  # the completion is not committed yet
            canceller = threading.Thread(target=lambda: results.append(admin.cancel(cancel_engine, [job.id])))
            canceller.start()
            wait_for(lambda: _waits_on_lock(engine, application_name="cancel-under-test"), timeout=TIMEOUT,
                     what="the cancel waiting for the completion's row lock")
            gate.execute(sa.text("SELECT pg_advisory_unlock(:k)"), {"k": COMMIT_GATE})
            canceller.join(TIMEOUT)
    finally:
        cancel_engine.dispose()
    [result] = results
    assert (result.cancelled, result.requested, result.unchanged) == ([], [], {job.id: "done"})
    assert (job_row(engine, job.id)["status"], effects()) == ("done", {job.id: 1})
    capsys.readouterr()
    assert main(["cancel", str(job.id), *_url(db_url)]) == 1
    assert f"no job cancelled: job {job.id} is done" in capsys.readouterr().err


def test_a_cancelled_ordered_head_rolls_back_and_lets_the_next_job_of_its_key_run(engine, effects, relay_of):
    """An ordered transactional consumer: the head of key ``k`` cancelled while its handler
    runs ends ``cancelled`` with nothing committed, and the key's next job then runs and is
    ``done`` with its write (the cancelled head no longer holds the key)."""
    ob = Outbox()
    first = threading.Event()

    @ob.subscriber("t", consumer="tx", transactional=True, ordered=True, lease=1.5)
    def handler(job: Job, session: Session) -> None:
        session.execute(sa.text("INSERT INTO effects (job_id) VALUES (:j)"), {"j": job.id})
        if job.payload["n"] == 1:
            first.set()
            end = time.monotonic() + TIMEOUT
            while not job.cancel_requested and time.monotonic() < end:
                time.sleep(0.02)

    with Session(engine) as s, s.begin():
        for n in (1, 2):
            publish(s, "t", {"n": n}, key="k")
    relay_of(ob)
    assert first.wait(TIMEOUT)
    with engine.connect() as c:
        head, second = c.execute(sa.text("SELECT id FROM outbox_jobs ORDER BY id")).scalars().all()
    assert admin.cancel(engine, [head]).requested == [head]
    wait_for(lambda: job_row(engine, second)["status"] == "done", timeout=TIMEOUT, what="the key's next job done")
    assert job_row(engine, head)["status"] == "cancelled" and effects() == {second: 1}


def test_drain_reports_a_transactional_job_cancelled_while_it_ran_and_commits_nothing(engine, effects, settings):
    """``outbox.testing.drain`` runs the relay's executor: a transactional job cancelled while
    its handler runs is rolled back, recorded ``cancelled`` and reported so."""
    ob = Outbox()

    @ob.subscriber("t", consumer="tx", transactional=True)
    def handler(job: Job, session: Session) -> None:
        session.execute(sa.text("INSERT INTO effects (job_id) VALUES (:j)"), {"j": job.id})
        assert admin.cancel(engine, [job.id]).requested == [job.id]  # an operator, on another connection

    publish_events(engine, "t", [{"n": 1}])
    [result] = drain(engine, ob, settings=settings())
    assert result.outcome == "cancelled"
    assert (job_row(engine, result.job_id)["status"], effects()) == ("cancelled", {})


def test_a_hundred_cancels_racing_their_handlers_end_each_job_truthfully(engine, effects, settings):
    """100 jobs (sync and async transactional handlers, half of them watching
    ``cancel_requested``, half ignoring it, each running 0-1 s), each cancelled at a random
    point 0-1.1 s after its handler started: every job ends ``cancelled`` with no write
    committed, or ``done`` with its write, never anything else."""
    rng = random.Random()
    started: queue.Queue[int] = queue.Queue()
    ob = Outbox()

    def runs_for(job: Job) -> float:
        return float(job.payload["seconds"])

    @ob.subscriber("race", consumer="tx_sync", transactional=True, lease=2.0)
    def sync_handler(job: Job, session: Session) -> None:
        session.execute(sa.text("INSERT INTO effects (job_id) VALUES (:j)"), {"j": job.id})
        started.put(job.id)
        end = time.monotonic() + runs_for(job)
        while time.monotonic() < end and not (job.payload["watch"] and job.cancel_requested):
            time.sleep(0.01)

    @ob.subscriber("race", consumer="tx_async", transactional=True, lease=2.0)
    async def async_handler(job: Job, session: AsyncSession) -> None:
        await session.execute(sa.text("INSERT INTO effects (job_id) VALUES (:j)"), {"j": job.id})
        started.put(job.id)
        end = time.monotonic() + runs_for(job)
        while time.monotonic() < end and not (job.payload["watch"] and job.cancel_requested):
            await asyncio.sleep(0.01)

    publish_events(engine, "race", [{"n": n, "seconds": rng.uniform(0.0, 1.0), "watch": n % 2 == 0}
                                    for n in range(50)])
    timers: list[threading.Timer] = []
    with running_relay(ob, settings(concurrency=10, prefetch=0)):
        deadline = time.monotonic() + 120
        while len(timers) < 100:
            job_id = started.get(timeout=max(0.0, deadline - time.monotonic()))
            timer = threading.Timer(rng.uniform(0.0, 1.1), admin.cancel, (engine, [job_id]))
            timer.start()
            timers.append(timer)
        for timer in timers:
            timer.join(TIMEOUT)
        wait_for(lambda: _statuses(engine) and all(s in ("done", "cancelled") for s in _statuses(engine).values()),
                 timeout=60, what="every job done or cancelled")
    statuses = _statuses(engine)
    written = effects()
    assert len(statuses) == 100 and set(written.values()) <= {1}
    lying = sorted(i for i, s in statuses.items() if (s == "cancelled") == (i in written))
    cancelled = sum(s == "cancelled" for s in statuses.values())
    print(f"race of 100 cancels: {cancelled} cancelled, {100 - cancelled} done, "
          f"{sum(statuses[i] == 'cancelled' for i in lying)} cancelled with their write committed, "
          f"{sum(statuses[i] == 'done' for i in lying)} done without it")
    assert lying == [], f"{len(lying)} of 100 jobs' statuses do not match their committed writes: {lying[:20]}"
    assert 0 < cancelled < 100, "the race should end some jobs each way"


def _statuses(engine: sa.Engine) -> dict[int, str]:
    with engine.connect() as c:
        return dict(c.execute(sa.text("SELECT id, status FROM outbox_jobs")).all())
