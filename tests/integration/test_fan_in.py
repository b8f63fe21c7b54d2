"""Fan-in on a real PostgreSQL with real relays (:mod:`outbox.fan_in`, :mod:`outbox.db.fan_in`):
one follow-up, after the last listed job is done, in that completion's transaction, with the
original key, payload and trace context; exactly one when two relays finish the last two jobs
at the same moment (the race forced: the completions overlap, a lock-free version publishes
none); no deadlock when two batches complete jobs of the same events in opposite orders; what
dead (held back until a redrive ends done), cancelled (never), ``retention_done = 0``
(counts as done), replay (never again) and a refused follow-up do; a chain of two fan-ins;
the record pruned with its event; a fan-in no longer declared forgotten."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from outbox import Job, Outbox, PermanentError, admin, publish, publish_many
from outbox.db.jobs import claim_jobs, complete_jobs
from outbox.relay.router import register_subscriptions, route_all
from outbox.settings import OutboxSettings
from outbox.testing import drain, wait_for

from .helpers import running_relay, running_relays

PLACED, FULFILLED, CLOSED = "order.placed", "order.fulfilled", "order.closed"
LISTED = ("send_receipt", "create_invoice", "sync_crm")
TIMEOUT = 30
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def nothing(job: Job) -> None:
    """A lease-mode handler with nothing to do."""


def follow_ups(engine: sa.Engine, topic: str = FULFILLED) -> list[Any]:
    """The events on ``topic``, in id order: id, key, payload, headers, created_at."""
    with engine.connect() as c:
        return c.execute(sa.text("SELECT id, key, payload, headers, created_at FROM outbox_events WHERE topic = :t "
                                 "ORDER BY id"), {"t": topic}).all()


def records(engine: sa.Engine) -> list[tuple[int, str, int | None]]:
    """``outbox_fanin_fired``: (event id, fan-in, follow-up id), in that order."""
    with engine.connect() as c:
        return [tuple(r) for r in c.execute(sa.text(
            "SELECT event_id, name, follow_event_id FROM outbox_fanin_fired ORDER BY event_id, name"))]


def status_of(engine: sa.Engine, consumer: str, event_id: int | None = None) -> str | None:
    with engine.connect() as c:
        return c.execute(sa.text("SELECT status FROM outbox_jobs WHERE consumer = :c "
                                 "AND (CAST(:e AS bigint) IS NULL OR event_id = :e) ORDER BY id DESC LIMIT 1"),
                         {"c": consumer, "e": event_id}).scalar_one_or_none()


def registry(handlers: dict[str, Callable[..., Any]] | None = None, **options: Any) -> Outbox:
    """The three listed consumers of ``order.placed`` (``handlers`` replaces some; a handler
    taking a session is transactional) and the fan-in to ``order.fulfilled``."""
    ob = Outbox()
    for consumer in LISTED:
        handler = (handlers or {}).get(consumer, nothing)
        transactional = handler.__code__.co_argcount == 2
        ob.subscriber(PLACED, consumer=consumer, transactional=transactional, **options)(handler)
    ob.after(PLACED, consumers=list(LISTED), publish=FULFILLED)
    return ob


def place(engine: sa.Engine, n: int = 1, **extra: Any) -> list[int]:
    """Publish ``n`` keyed orders, each with a trace context; returns their ids."""
    with Session(engine) as s, s.begin():
        return publish_many(s, [{"topic": PLACED, "payload": {"order_id": i}, "key": f"order:{i}",
                                 "headers": {"traceparent": TRACEPARENT, "tracestate": "vendor=1", "other": "x"},
                                 **extra} for i in range(n)])


def test_one_follow_up_after_the_last_listed_job_in_its_transaction(engine, settings):
    release = threading.Event()

    def create_invoice(job: Job, session: Session) -> None:  # transactional: job_complete
        session.execute(sa.text("SELECT 1"))

    def sync_crm(job: Job) -> None:
        assert release.wait(TIMEOUT)

    ob = registry({"create_invoice": create_invoice, "sync_crm": sync_crm})
    shipped: list[Job] = []
    ob.subscriber(FULFILLED, consumer="ship")(shipped.append)
    with running_relay(ob, settings()):
        [event_id] = place(engine)
        wait_for(lambda: (status_of(engine, "send_receipt"), status_of(engine, "create_invoice"),
                          status_of(engine, "sync_crm")) == ("done", "done", "running"), timeout=TIMEOUT,
                 what="two listed jobs done, the third running")
        assert follow_ups(engine) == [] and records(engine) == []
        release.set()
        wait_for(lambda: shipped, timeout=TIMEOUT, what="the follow-up handled")
    [follow] = follow_ups(engine)
    assert follow.key == "order:0" and follow.payload == {"order_id": 0}
    assert follow.headers == {"traceparent": TRACEPARENT, "tracestate": "vendor=1", "fan_in": FULFILLED,
                              "fan_in_event_id": event_id}
    with engine.connect() as c:
        finished = c.execute(sa.text("SELECT finished_at FROM outbox_jobs WHERE consumer = 'sync_crm'")).scalar_one()
    assert follow.created_at == finished, "the follow-up is written in the transaction of the last completion"
    assert records(engine) == [(event_id, FULFILLED, follow.id)]
    assert [(j.event_id, j.key, j.headers["fan_in_event_id"]) for j in shipped] == [(follow.id, "order:0", event_id)]


def test_two_relays_finishing_the_last_two_jobs_at_once_publish_one_follow_up(engine, settings):
    """The first listed job is done beforehand (drain); the last two run on two relays (one
    job at a time each), their handlers leave a barrier together, and a trigger of the
    test's own holds each completion 0.5 s after its row changed and before the fan-in
    trigger runs, noting when: both completions changed their job before either checked. The
    check of the second, after the event's lock, sees the first's commit; the first saw the
    second's job unfinished. Exactly one follow-up (a version without the lock publishes
    none: each sees the other's job running)."""
    barrier = threading.Barrier(2, timeout=TIMEOUT)

    def create_invoice(job: Job, session: Session) -> None:  # job_complete in its transaction
        barrier.wait()

    def sync_crm(job: Job) -> None:  # job_complete_many, by the relay's dispatcher
        barrier.wait()

    with engine.begin() as c:
        c.execute(sa.text("CREATE TABLE test_pauses (consumer text, at timestamptz)"))
        c.execute(sa.text("CREATE FUNCTION test_pause() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
                          "INSERT INTO test_pauses VALUES (NEW.consumer, clock_timestamp()); "
                          "PERFORM pg_sleep(0.5); RETURN NULL; END $$"))
        c.execute(sa.text(  # named to fire before outbox_jobs_fan_in_done (triggers fire by name)
            "CREATE TRIGGER outbox_jobs_a_pause AFTER UPDATE OF status ON outbox_jobs FOR EACH ROW "
            "WHEN (NEW.status = 'done' AND NEW.consumer IN ('create_invoice', 'sync_crm')) "
            "EXECUTE FUNCTION test_pause()"))
    ob = registry({"create_invoice": create_invoice, "sync_crm": sync_crm})
    [event_id] = place(engine)
    assert [r.outcome for r in drain(engine, ob, consumers=["send_receipt"],
                                     settings=OutboxSettings(_env_file=None))] == ["done"]
    with running_relays(2, ob, settings(concurrency=1, prefetch=0)):
        wait_for(lambda: status_of(engine, "create_invoice") == status_of(engine, "sync_crm") == "done",
                 timeout=TIMEOUT, what="the last two jobs done")
    with engine.connect() as c:
        paused = dict(c.execute(sa.text("SELECT consumer, at FROM test_pauses")).all())
    # Each paused 0.5 s after its update, then checked: paused less than that apart, each
    # update came before the other's check.
    assert abs((paused["create_invoice"] - paused["sync_crm"]).total_seconds()) < 0.4, paused
    [follow] = follow_ups(engine)
    assert records(engine) == [(event_id, FULFILLED, follow.id)]


def test_two_batches_completing_jobs_of_the_same_events_in_opposite_orders_do_not_deadlock(engine):
    """Two listed consumers' jobs of 12 events, one consumer's ids in event order and the
    other's in the reverse order; each completed in one ``job_complete_many``, both at
    once, each row's triggers slowed by a pause: the two statements meet on the events'
    locks. ``job_complete_many`` takes them in key order before the triggers run, so neither
    waits for the other in a cycle (PostgreSQL would abort one with a deadlock), and every
    event fires once, from the batch that committed second."""
    ob = Outbox()
    for consumer in ("a", "b"):
        ob.subscriber("t", consumer=consumer)(nothing)
    ob.after("t", consumers=["a", "b"], publish="t.done")
    register_subscriptions(engine, ob, OutboxSettings(_env_file=None))
    with Session(engine) as s, s.begin():
        events = publish_many(s, [("t", {"n": n}) for n in range(12)])
    route_all(engine)
    with engine.begin() as c:  # b's jobs again, with ids in the reverse order of their events
        c.execute(sa.text("UPDATE outbox_jobs SET fan_in = false WHERE consumer = 'b'"))  # deleted, not settled
        c.execute(sa.text("DELETE FROM outbox_jobs WHERE consumer = 'b'"))
        c.execute(sa.text("INSERT INTO outbox_jobs (event_id, consumer, max_attempts, fan_in, status) "
                          "SELECT e, 'b', 5, true, 'ready' FROM unnest(CAST(:e AS bigint[])) AS e ORDER BY e DESC"),
                  {"e": events})
        c.execute(sa.text("CREATE FUNCTION test_pause() RETURNS trigger LANGUAGE plpgsql AS "
                          "$$ BEGIN PERFORM pg_sleep(0.02); RETURN NULL; END $$"))
        c.execute(sa.text("CREATE TRIGGER outbox_jobs_a_pause AFTER UPDATE OF status ON outbox_jobs FOR EACH ROW "
                          "WHEN (NEW.status = 'done') EXECUTE FUNCTION test_pause()"))
    with engine.begin() as c:
        claims = {consumer: claim_jobs(c, {consumer: 300.0}, 100, f"w-{consumer}") for consumer in ("a", "b")}
    # Whether the update takes its rows in id order or in the order given: a's in event order, b's reversed.
    claims["a"].sort(key=lambda j: j.event_id)
    claims["b"].sort(key=lambda j: -j.event_id)
    barrier = threading.Barrier(2, timeout=TIMEOUT)
    errors: list[BaseException] = []

    def complete(consumer: str) -> None:
        try:
            with engine.begin() as c:
                barrier.wait()
                assert len(complete_jobs(c, claims[consumer])) == 12
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=complete, args=(consumer,)) for consumer in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT)
    assert errors == []
    follows = follow_ups(engine, "t.done")
    assert sorted(f.headers["fan_in_event_id"] for f in follows) == sorted(events)
    assert sorted(r[0] for r in records(engine)) == sorted(events)


def test_a_dead_job_holds_the_fan_in_back_until_a_redrive_ends_done(engine, settings):
    tries: list[int] = []

    def sync_crm(job: Job) -> None:
        tries.append(job.attempt)
        if len(tries) == 1:
            raise PermanentError("the CRM refused the order")

    ob = registry({"sync_crm": sync_crm})
    with running_relay(ob, settings()):
        [event_id] = place(engine)
        wait_for(lambda: status_of(engine, "sync_crm") == "dead" and status_of(engine, "send_receipt") == "done"
                 and status_of(engine, "create_invoice") == "done", timeout=TIMEOUT, what="two done, one dead")
        assert follow_ups(engine) == [] and records(engine) == []
        with engine.begin() as c:
            assert len(admin.redrive(c, consumer="sync_crm")) == 1
        wait_for(lambda: follow_ups(engine), timeout=TIMEOUT, what="the follow-up after the redrive")
    [follow] = follow_ups(engine)
    assert records(engine) == [(event_id, FULFILLED, follow.id)] and tries == [1, 1]


def test_a_cancelled_job_means_the_fan_in_never_fires_even_once_pruned(engine, settings):
    """Event 1: sync_crm's job is cancelled while ready (its consumer paused), then pruned
    with the done ones; the last listed job done afterwards finds two listed jobs gone, and
    the record the deleted cancelled job left (follow-up NULL) says the fan-in will not
    fire. Event 2: create_invoice's job is cancelled while it runs (it ends cancelled)."""
    release = threading.Event()
    running = threading.Event()

    def send_receipt(job: Job) -> None:
        if job.payload["order_id"] == 0:
            assert release.wait(TIMEOUT)

    def create_invoice(job: Job) -> None:
        if job.payload["order_id"] == 1:
            running.set()
            wait_for(lambda: job.cancel_requested, timeout=TIMEOUT, what="the cancel request")

    ob = registry({"send_receipt": send_receipt, "create_invoice": create_invoice})
    with engine.begin() as c:
        admin.pause(c, "sync_crm")
    with running_relay(ob, settings(default_lease=1.5)):
        first, second = place(engine, 2)
        wait_for(lambda: status_of(engine, "create_invoice", first) == "done" and running.is_set(), timeout=TIMEOUT,
                 what="create_invoice done for order 0 and running for order 1")
        assert len(admin.cancel(engine, consumer="sync_crm").cancelled) == 2
        assert admin.cancel(engine, consumer="create_invoice").requested != []
        wait_for(lambda: status_of(engine, "create_invoice", second) == "cancelled", timeout=TIMEOUT,
                 what="the running job cancelled")
        assert admin.prune_now(engine, done_older_than=0, events_older_than=3600).jobs >= 3
        assert records(engine) == [(first, FULFILLED, None), (second, FULFILLED, None)]
        release.set()
        wait_for(lambda: status_of(engine, "send_receipt", first) is None
                 or status_of(engine, "send_receipt", first) == "done", timeout=TIMEOUT, what="the last job done")
    assert follow_ups(engine) == []
    assert records(engine) == [(first, FULFILLED, None), (second, FULFILLED, None)]


def test_jobs_deleted_when_done_count_as_done(engine, settings):
    """``retention_done = 0``: each completion deletes its job (``job_complete_many``'s and the
    transactional ``job_complete``'s delete branches); the fan-in fires once per event."""

    def create_invoice(job: Job, session: Session) -> None:
        session.execute(sa.text("SELECT 1"))

    ob = registry({"create_invoice": create_invoice})
    with running_relay(ob, settings(retention_done=0)):
        events = place(engine, 10)
        wait_for(lambda: len(follow_ups(engine)) == 10, timeout=TIMEOUT, what="ten follow-ups")
        wait_for(lambda: status_of(engine, "sync_crm") is None and status_of(engine, "create_invoice") is None
                 and status_of(engine, "send_receipt") is None, timeout=TIMEOUT, what="every listed job deleted")
    follows = follow_ups(engine)
    assert sorted(f.headers["fan_in_event_id"] for f in follows) == events
    assert sorted((f.key, f.payload["order_id"]) for f in follows) == sorted((f"order:{i}", i) for i in range(10))
    assert sorted(records(engine)) == sorted((e, FULFILLED, f.id) for f in follows
                                             for e in [f.headers["fan_in_event_id"]])


def test_a_chain_of_two_fan_ins(engine, settings):
    """order.placed -> [send_receipt, create_invoice, sync_crm] -> order.fulfilled -> [ship,
    notify] -> order.closed -> archive: one archive job per order, keyed, carrying the
    original trace context and naming the second fan-in and the order.fulfilled event."""
    ob = registry()
    ob.subscriber(FULFILLED, consumer="ship")(nothing)
    ob.subscriber(FULFILLED, consumer="notify")(nothing)
    ob.after(FULFILLED, consumers=["ship", "notify"], publish=CLOSED)
    archived: list[Job] = []
    lock = threading.Lock()

    def archive(job: Job) -> None:
        with lock:
            archived.append(job)

    ob.subscriber(CLOSED, consumer="archive")(archive)
    with running_relay(ob, settings()):
        events = place(engine, 3)
        wait_for(lambda: len(archived) == 3, timeout=TIMEOUT, what="three orders archived")
    fulfilled = {f.headers["fan_in_event_id"]: f.id for f in follow_ups(engine)}
    assert sorted(fulfilled) == events and len(follow_ups(engine, CLOSED)) == 3
    assert sorted((j.key, j.headers["fan_in"], j.headers["fan_in_event_id"], j.headers["traceparent"])
                  for j in archived) == sorted((f"order:{i}", CLOSED, fulfilled[e], TRACEPARENT)
                                               for i, e in enumerate(events))


def test_replay_and_a_second_completion_never_fire_again(engine):
    ob = registry()
    [event_id] = place(engine)
    drain(engine, ob, settings=OutboxSettings(_env_file=None))
    [follow] = follow_ups(engine)
    # A listed job set back to running and done again (by hand): the record stops a second one.
    with engine.begin() as c:
        c.execute(sa.text("UPDATE outbox_jobs SET status = 'running', lease_until = now() WHERE consumer = 'sync_crm'"))
        c.execute(sa.text("UPDATE outbox_jobs SET status = 'done', lease_until = NULL WHERE consumer = 'sync_crm'"))
    # A replay of the event to a listed consumer, its done job pruned first.
    admin.prune_now(engine, done_older_than=0, events_older_than=3600)
    assert admin.replay(engine, "send_receipt", from_event=event_id).created == 1
    assert [(r.consumer, r.outcome) for r in drain(engine, ob, settings=OutboxSettings(_env_file=None))
            if r.topic == PLACED] == [("send_receipt", "done")]
    assert follow_ups(engine) == [follow] and records(engine) == [(event_id, FULFILLED, follow.id)]


def test_the_record_is_pruned_with_its_event_and_pruning_done_jobs_fires_nothing(engine):
    ob = registry()
    first, second = place(engine, 2)
    drain(engine, ob, settings=OutboxSettings(_env_file=None), consumers=["send_receipt", "create_invoice"])
    with engine.begin() as c:  # the first order's last job done; the second's still ready
        c.execute(sa.text("UPDATE outbox_jobs SET status = 'done', finished_at = now() "
                          "WHERE consumer = 'sync_crm' AND event_id = :e"), {"e": first})
    [follow] = follow_ups(engine)
    admin.prune_now(engine, done_older_than=0, events_older_than=3600)  # done jobs go: nothing fires
    assert records(engine) == [(first, FULFILLED, follow.id)] and len(follow_ups(engine)) == 1
    with engine.begin() as c:
        c.execute(sa.text("DELETE FROM outbox_jobs WHERE event_id = :e"), {"e": second})  # no listed job running
    admin.prune_now(engine, done_older_than=0, events_older_than=0)
    with engine.connect() as c:
        assert c.execute(sa.text("SELECT count(*) FROM outbox_events WHERE id IN (:a, :b)"),
                         {"a": first, "b": second}).scalar_one() == 0
    assert records(engine) == [], "a record goes with its event"


def test_a_follow_up_that_cannot_be_published_dead_letters_the_last_job(engine, db_url, settings):
    """The follow-up goes through outbox_publish's rules: over the database's
    ``outbox.max_payload_bytes`` it is refused, the completion's statement fails, and the relay
    dead-letters the job naming the problem; once the limit is raised, a redrive fires it."""
    with engine.begin() as c:
        c.execute(sa.text(f'ALTER DATABASE "{db_url.database}" SET outbox.max_payload_bytes = 20'))
    ob = registry()
    with running_relay(ob, settings()):
        with Session(engine) as s, s.begin():
            event_id = publish(s, PLACED, {"order_id": 4, "note": "more than twenty bytes"}, key="order:4")
        wait_for(lambda: sorted(filter(None, (status_of(engine, c) for c in LISTED))) == ["dead", "done", "done"],
                 timeout=TIMEOUT, what="the last completion refused")
    with engine.connect() as c:
        error = c.execute(sa.text("SELECT last_error FROM outbox_jobs WHERE status = 'dead'")).scalar_one()
    assert "payload: is" in error and "the limit is 20 bytes" in error, error
    assert follow_ups(engine) == [] and records(engine) == []
    with engine.begin() as c:
        c.execute(sa.text(f'ALTER DATABASE "{db_url.database}" RESET outbox.max_payload_bytes'))
    with running_relay(ob, settings()):
        with engine.begin() as c:
            admin.redrive(c, every=True)
        wait_for(lambda: follow_ups(engine), timeout=TIMEOUT, what="the follow-up after the redrive")
    [follow] = follow_ups(engine)
    assert records(engine) == [(event_id, FULFILLED, follow.id)]


def test_a_completion_under_repeatable_read_is_refused(engine):
    ob = registry()
    place(engine)
    drain(engine, ob, settings=OutboxSettings(_env_file=None), consumers=["send_receipt", "create_invoice"])
    with engine.connect() as c:
        c.execute(sa.text("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ"))
        with pytest.raises(sa.exc.NotSupportedError) as raised:
            c.execute(sa.text("UPDATE outbox_jobs SET status = 'done' WHERE consumer = 'sync_crm'"))
        assert isinstance(raised.value.orig, psycopg.errors.FeatureNotSupported)
        assert "under REPEATABLE READ" in str(raised.value.orig)


def test_relays_write_their_fan_ins_and_forget_those_no_longer_declared(engine, caplog):
    settings = OutboxSettings(_env_file=None)

    def rows() -> list[tuple[Any, ...]]:
        with engine.connect() as c:
            return [tuple(r) for r in c.execute(sa.text(
                "SELECT name, topic, consumers, follow_topic FROM outbox_fanins ORDER BY name"))]

    register_subscriptions(engine, registry(), settings)
    other = Outbox()  # another service's registry, on the same database
    other.subscriber("invoice.sent", consumer="bookkeeping")(nothing)
    other.after("invoice.sent", consumers=["bookkeeping"], publish="invoice.booked")
    register_subscriptions(engine, other, settings)
    assert rows() == [("invoice.booked", "invoice.sent", ["bookkeeping"], "invoice.booked"),
                      (FULFILLED, PLACED, list(LISTED), FULFILLED)]
    caplog.set_level(logging.WARNING)
    changed = Outbox()
    for consumer in LISTED:
        changed.subscriber(PLACED, consumer=consumer)(nothing)
    changed.after(PLACED, consumers=["send_receipt", "sync_crm"], publish=FULFILLED)
    register_subscriptions(engine, changed, settings)
    assert rows()[1] == (FULFILLED, PLACED, ["send_receipt", "sync_crm"], FULFILLED)
    assert "fan-in order.fulfilled now has this registry's definition" in caplog.text
    bare = Outbox()
    for consumer in LISTED:
        bare.subscriber(PLACED, consumer=consumer)(nothing)
    register_subscriptions(engine, bare, settings)
    assert rows() == [("invoice.booked", "invoice.sent", ["bookkeeping"], "invoice.booked")]
    assert "fan-in order.fulfilled (after order.placed" in caplog.text and "is no longer declared" in caplog.text
    with engine.connect() as c:
        assert set(c.execute(sa.text("SELECT consumer, fan_in FROM outbox_subscriptions "
                                     "WHERE topic = :t"), {"t": PLACED}).all()) == {(c, False) for c in LISTED}


def test_a_relay_refuses_a_fan_in_of_an_undeclared_consumer(engine, settings):
    from outbox import ConfigurationError

    ob = Outbox()
    ob.subscriber(PLACED, consumer="send_receipt")(nothing)
    ob.after(PLACED, consumers=["send_receipt", "later"], publish=FULFILLED)
    with pytest.raises(ConfigurationError, match="lists consumer 'later', which the registry does not declare"):
        with running_relay(ob, settings()):
            pass
    with engine.connect() as c:
        assert c.execute(sa.text("SELECT count(*) FROM outbox_subscriptions")).scalar_one() == 0
