"""outbox.testing.drain on a real PostgreSQL: it routes and runs every due job in the
calling thread with the relay's claim, executor and fenced statements, and reports how
each attempt ended (done / retried / dead); retries run again only with run_retries; it
is bounded by max_rounds."""

from __future__ import annotations

import asyncio

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from outbox import ConfigurationError, Job, Outbox, PermanentError, fenced_write, publish
from outbox.errors import DrainLimitError
from outbox.settings import OutboxSettings
from outbox.testing import DRAIN_WORKER_ID, drain

from .helpers import publish_events


def _settings(**overrides) -> OutboxSettings:
    return OutboxSettings(_env_file=None, **{"backoff_base": 60.0, "backoff_cap": 600.0, **overrides})


def _jobs(engine: sa.Engine) -> list[sa.Row]:
    with engine.connect() as c:
        return c.execute(sa.text(
            "SELECT id, consumer, status, attempts, last_error, locked_by, run_at > now() AS waiting "
            "FROM outbox_jobs ORDER BY id")).all()


def test_drain_runs_a_handler_that_succeeds(engine):
    ob = Outbox()
    seen: list[dict] = []

    @ob.subscriber("order.placed", consumer="receipt")
    def receipt(job: Job) -> None:
        seen.append(job.payload)

    event_ids = publish_events(engine, "order.placed", [{"order": 1}, {"order": 2}])
    results = drain(engine, ob, settings=_settings())
    assert [(r.consumer, r.event_id, r.topic, r.attempt, r.outcome, r.error) for r in results] == [
        ("receipt", e, "order.placed", 1, "done", None) for e in event_ids]
    assert seen == [{"order": 1}, {"order": 2}]
    assert [(j.status, j.attempts, j.locked_by) for j in _jobs(engine)] == [("done", 1, DRAIN_WORKER_ID)] * 2
    assert drain(engine, ob, settings=_settings()) == []  # nothing due any more


def test_drain_with_retention_done_zero_deletes_each_job_it_completes(engine, invoices):
    """``retention_done = 0`` in drain's settings: its completions delete the jobs, as the
    relay's do, lease mode and transactional alike (the fenced write commits with it)."""
    ob = Outbox()

    @ob.subscriber("t", consumer="lease")
    def lease(job: Job) -> None: ...

    @ob.subscriber("t", consumer="tx", transactional=True)
    def tx(job: Job, session: Session) -> None:
        fenced_write(session, invoices, key={"order_id": job.payload["n"]}, values={"total_cents": 1}, fence=job.fence)

    publish_events(engine, "t", [{"n": 1}, {"n": 2}])
    results = drain(engine, ob, settings=_settings(retention_done=0))
    assert sorted((r.consumer, r.outcome) for r in results) == [("lease", "done")] * 2 + [("tx", "done")] * 2
    assert _jobs(engine) == []
    with engine.connect() as c:
        assert c.execute(sa.text("SELECT count(*) FROM invoices")).scalar_one() == 2


def test_drain_retries_only_when_asked(engine):
    ob = Outbox()
    calls: list[int] = []

    @ob.subscriber("t", consumer="flaky", max_attempts=5)
    def flaky(job: Job) -> None:
        calls.append(job.attempt)
        if job.attempt <= 2:
            raise RuntimeError(f"flaky attempt {job.attempt}")

    publish_events(engine, "t", [{"n": 1}])
    first = drain(engine, ob, settings=_settings())
    assert [(r.attempt, r.outcome) for r in first] == [(1, "retried")]
    assert first[0].error.startswith("RuntimeError: flaky attempt 1")
    [job] = _jobs(engine)
    assert (job.status, job.attempts, job.waiting) == ("ready", 1, True)  # waiting out its backoff
    assert drain(engine, ob, settings=_settings()) == []  # not due: not run again

    rest = drain(engine, ob, run_retries=True, settings=_settings())
    assert [(r.attempt, r.outcome) for r in rest] == [(2, "retried"), (3, "done")]
    assert calls == [1, 2, 3]
    [job] = _jobs(engine)
    assert (job.status, job.attempts) == ("done", 3)


def test_drain_without_run_retries_runs_a_retried_job_once_even_if_due_again(engine):
    """A backoff shorter than the round: the job is due again within the same call, and
    still runs once (one attempt per job per drain, without run_retries)."""
    ob = Outbox()
    calls: list[int] = []

    @ob.subscriber("t", consumer="fails", max_attempts=5)
    def fails(job: Job) -> None:
        calls.append(job.attempt)
        raise RuntimeError("no")

    @ob.subscriber("t", consumer="slow")
    def slow(job: Job) -> None:
        import time
        time.sleep(0.2)  # longer than the retry delay below

    publish_events(engine, "t", [{"n": 1}])
    results = drain(engine, ob, settings=_settings(backoff_base=0.01, backoff_cap=0.01))
    assert sorted((r.consumer, r.outcome) for r in results) == [("fails", "retried"), ("slow", "done")]
    assert calls == [1]


def test_drain_reports_dead_letters(engine):
    ob = Outbox()

    @ob.subscriber("t", consumer="refuses")
    def refuses(job: Job) -> None:
        raise PermanentError("malformed payload")

    @ob.subscriber("t", consumer="always_fails", max_attempts=3)
    def always_fails(job: Job) -> None:
        raise ValueError(f"attempt {job.attempt}")

    publish_events(engine, "t", [{"n": 1}])
    results = drain(engine, ob, run_retries=True, settings=_settings())
    by_consumer: dict[str, list] = {}
    for r in results:
        by_consumer.setdefault(r.consumer, []).append((r.attempt, r.outcome, r.error.splitlines()[0]))
    assert by_consumer == {
        "refuses": [(1, "dead", "PermanentError: malformed payload")],
        "always_fails": [(1, "retried", "ValueError: attempt 1"), (2, "retried", "ValueError: attempt 2"),
                         (3, "dead", "ValueError: attempt 3")],
    }
    assert sorted((j.consumer, j.status, j.attempts) for j in _jobs(engine)) == [
        ("always_fails", "dead", 3), ("refuses", "dead", 1)]


def test_a_handler_that_returns_a_coroutine_is_dead_at_once_naming_the_mistake(engine):
    """A ``def`` handler returning a coroutine (an async call forgotten un-awaited) did no
    work: dead at once with a message saying so, not done, not retried; also in a
    transactional handler, whose writes roll back."""
    ob = Outbox()

    async def send_mail(job: Job) -> None: ...

    @ob.subscriber("t", consumer="forgot_await", max_attempts=5)
    def forgot_await(job: Job):  # type: ignore[no-untyped-def]
        return send_mail(job)

    @ob.subscriber("t", consumer="tx_forgot_await", max_attempts=5, transactional=True)
    def tx_forgot_await(job: Job, session: Session):  # type: ignore[no-untyped-def]
        session.execute(sa.text("CREATE TABLE IF NOT EXISTS misuse_effects (n int)"))
        session.execute(sa.text("INSERT INTO misuse_effects VALUES (1)"))
        return send_mail(job)

    publish_events(engine, "t", [{"n": 1}])
    results = drain(engine, ob, run_retries=True, settings=_settings())
    assert sorted((r.consumer, r.attempt, r.outcome) for r in results) == [
        ("forgot_await", 1, "dead"), ("tx_forgot_await", 1, "dead")]
    for r in results:
        assert r.error.startswith("HandlerMisuseError:") and "returned coroutine" in r.error, r.error
        assert "async def" in r.error
    with engine.connect() as c:
        assert c.execute(sa.text("SELECT to_regclass('misuse_effects')")).scalar() is None  # rolled back


@pytest.fixture
def invoices(engine) -> sa.Table:
    table = sa.Table("invoices", sa.MetaData(), sa.Column("order_id", sa.Integer, primary_key=True),
                     sa.Column("total_cents", sa.Integer), sa.Column("fence", sa.BigInteger, nullable=False))
    table.create(engine)
    return table


def _invoices(engine: sa.Engine, table: sa.Table) -> list[tuple]:
    with engine.connect() as c:
        return [tuple(r) for r in c.execute(sa.select(table).order_by(table.c.order_id))]


def test_drain_runs_transactional_handlers_with_fenced_write(engine, invoices):
    ob = Outbox()
    fences: dict[int, int] = {}

    @ob.subscriber("order.placed", consumer="invoice", transactional=True, max_attempts=3)
    def invoice(job: Job, session: Session) -> None:
        fences[job.payload["order_id"]] = job.fence
        fenced_write(session, invoices, key={"order_id": job.payload["order_id"]},
                     values={"total_cents": job.payload["total"]}, fence=job.fence)
        if job.payload["order_id"] == 2 and job.attempt == 1:
            raise RuntimeError("rolled back with the failed attempt")

    with Session(engine) as s, s.begin():
        publish(s, "order.placed", {"order_id": 1, "total": 100})
        publish(s, "order.placed", {"order_id": 2, "total": 200})
    results = drain(engine, ob, run_retries=True, settings=_settings())
    assert [(r.attempt, r.outcome) for r in results] == [(1, "done"), (1, "retried"), (2, "done")]
    assert _invoices(engine, invoices) == [(1, 100, fences[1]), (2, 200, fences[2])]


def test_drain_runs_async_handlers_lease_and_transactional(engine, invoices):
    ob = Outbox()

    @ob.subscriber("order.placed", consumer="notify")
    async def notify(job: Job) -> None:
        await asyncio.sleep(0)

    @ob.subscriber("order.placed", consumer="invoice", transactional=True, max_attempts=3)
    async def invoice(job: Job, session: AsyncSession) -> None:
        await session.execute(sa.insert(invoices).values(order_id=job.payload["order_id"], total_cents=job.attempt,
                                                         fence=job.fence))
        if job.attempt == 1:
            raise RuntimeError("first attempt rolls back")

    publish_events(engine, "order.placed", [{"order_id": 7}])
    results = drain(engine, ob, run_retries=True, settings=_settings())
    assert sorted((r.consumer, r.attempt, r.outcome) for r in results) == [
        ("invoice", 1, "retried"), ("invoice", 2, "done"), ("notify", 1, "done")]
    with engine.connect() as c:
        fence = c.execute(sa.text("SELECT fence FROM outbox_jobs WHERE consumer = 'invoice'")).scalar_one()
    assert _invoices(engine, invoices) == [(7, 2, fence)]


def test_drain_follows_events_published_by_handlers_and_is_bounded(engine):
    ob = Outbox()

    @ob.subscriber("order.placed", consumer="placed", transactional=True)
    def placed(job: Job, session: Session) -> None:
        publish(session, "invoice.due", {"order": job.payload["order"]})

    @ob.subscriber("invoice.due", consumer="due")
    def due(job: Job) -> None: ...

    @ob.subscriber("ping", consumer="ping_forever", transactional=True)
    def ping_forever(job: Job, session: Session) -> None:
        publish(session, "ping", {"n": job.payload["n"] + 1})

    publish_events(engine, "order.placed", [{"order": 1}])
    results = drain(engine, ob, settings=_settings())
    assert [(r.consumer, r.topic, r.outcome) for r in results] == [
        ("placed", "order.placed", "done"), ("due", "invoice.due", "done")]

    publish_events(engine, "ping", [{"n": 0}])
    with pytest.raises(DrainLimitError, match="after 3 rounds") as info:
        drain(engine, ob, max_rounds=3, settings=_settings())
    assert [r.outcome for r in info.value.results] == ["done"] * 3
    # The job the fourth round claimed was handed back, attempt not counted.
    waiting = [j for j in _jobs(engine) if j.status != "done"]
    assert [(j.consumer, j.status, j.attempts) for j in waiting] == [("ping_forever", "ready", 0)]


def test_drain_runs_only_the_chosen_consumers(engine):
    ob = Outbox()
    ob.subscriber("t", consumer="a")(lambda job: None)
    ob.subscriber("t", consumer="b")(lambda job: None)
    publish_events(engine, "t", [{"n": 1}])
    assert [(r.consumer, r.outcome) for r in drain(engine, ob, consumers=["b"], settings=_settings())] == [
        ("b", "done")]
    assert sorted((j.consumer, j.status) for j in _jobs(engine)) == [("a", "ready"), ("b", "done")]
    with pytest.raises(ConfigurationError, match=r"\['nope'\] are not declared"):
        drain(engine, ob, consumers=["nope"])
    with pytest.raises(ConfigurationError, match="max_rounds"):
        drain(engine, ob, max_rounds=0)


def test_drain_refuses_async_handlers_inside_a_running_event_loop(engine):
    ob = Outbox()

    @ob.subscriber("t", consumer="a")
    async def handler(job: Job) -> None: ...

    async def main() -> None:
        with pytest.raises(ConfigurationError, match="asyncio.to_thread"):
            drain(engine, ob)
        assert await asyncio.to_thread(drain, engine, ob, settings=_settings()) == []

    asyncio.run(main())


def test_drain_runs_delayed_publishes_only_with_run_scheduled(engine):
    ob = Outbox()
    seen: list[dict] = []

    @ob.subscriber("reminder", consumer="remind")
    def remind(job: Job) -> None:
        seen.append(job.payload)

    with Session(engine) as s, s.begin():
        publish(s, "reminder", {"n": 1}, delay=3600)
        publish(s, "reminder", {"n": 2})
    assert [r.outcome for r in drain(engine, ob, settings=_settings())] == ["done"]
    assert seen == [{"n": 2}]  # the delayed one waits for its hour, as in the relay
    assert [(j.status, j.waiting) for j in _jobs(engine)] == [("ready", True), ("done", False)]

    results = drain(engine, ob, run_scheduled=True, settings=_settings())
    assert [(r.outcome, r.attempt) for r in results] == [("done", 1)]
    assert seen == [{"n": 2}, {"n": 1}]
    assert [j.status for j in _jobs(engine)] == ["done", "done"]


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit], ids=["ctrl-c", "exit"])
@pytest.mark.parametrize("transactional", [False, True], ids=["lease", "transactional"])
def test_an_interrupt_in_a_handler_stops_drain_and_hands_the_job_back(engine, interrupt, transactional):
    ob = Outbox()
    ran: list[int] = []

    def lease(job: Job) -> None:
        ran.append(job.id)
        raise interrupt()

    def tx(job: Job, session: Session) -> None:
        session.execute(sa.text("SELECT 1"))
        lease(job)

    ob.subscriber("t", consumer="c", transactional=transactional)(tx if transactional else lease)
    publish_events(engine, "t", [{"n": 1}, {"n": 2}])
    with pytest.raises(interrupt):
        drain(engine, ob, settings=_settings())
    assert len(ran) == 1  # the second job did not run after the interrupt
    assert [(j.status, j.attempts, j.waiting) for j in _jobs(engine)] == [("ready", 0, False), ("ready", 0, False)]


def test_drain_runs_capped_and_rate_limited_consumers_and_leaves_paused_ones(engine):
    """The relay's main claim leaves out capped, rate-limited and paused consumers; drain
    claims the first two on their own path (one job at a time never exceeds a cap, the
    bucket holds one second of claims) and runs nothing of a paused consumer."""
    ob = Outbox()
    seen: list[tuple[str, int]] = []

    @ob.subscriber("t", consumer="capped", concurrency=1)
    def capped(job: Job) -> None:
        seen.append(("capped", job.payload["n"]))

    @ob.subscriber("t", consumer="limited", rate_limit="100/s")
    def limited(job: Job) -> None:
        seen.append(("limited", job.payload["n"]))

    @ob.subscriber("t", consumer="held")
    def held(job: Job) -> None:
        seen.append(("held", job.payload["n"]))

    with engine.begin() as c:
        c.execute(sa.text("INSERT INTO outbox_consumers (consumer, paused_at) VALUES ('held', now())"))
    publish_events(engine, "t", [{"n": 1}, {"n": 2}])
    results = drain(engine, ob, settings=_settings())
    assert sorted(seen) == [("capped", 1), ("capped", 2), ("limited", 1), ("limited", 2)]
    assert {(r.consumer, r.outcome) for r in results} == {("capped", "done"), ("limited", "done")}
    statuses = {(j.consumer, j.status) for j in _jobs(engine)}
    assert statuses == {("capped", "done"), ("limited", "done"), ("held", "ready")}
