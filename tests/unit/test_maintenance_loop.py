"""The maintenance loop (:class:`outbox.relay.maintenance.Maintenance`) alone, on a real
database and without a relay: a reaper round, a pruning round (with the vacuum when
autovacuum is off), and the loop's rounds until it is stopped."""

from __future__ import annotations

import threading

import sqlalchemy as sa
from sqlalchemy.orm import Session

from outbox import Outbox, publish_many
from outbox.relay.maintenance import Maintenance
from outbox.relay.notify import Wakeup
from outbox.relay.reconnect import Reconnector
from outbox.relay.router import register_subscriptions, route_all
from outbox.testing import wait_for

TIMEOUT = 20.0


def _jobs(engine: sa.Engine, settings, n: int, *, max_attempts: int = 5) -> None:
    """``n`` ready jobs of consumer ``a``, one per event."""
    ob = Outbox()
    ob.subscriber("t", consumer="a", max_attempts=max_attempts)(lambda job: None)
    register_subscriptions(engine, ob, settings())
    with Session(engine) as s, s.begin():
        publish_many(s, [("t", {"n": i}) for i in range(n)])
    route_all(engine)


def _run_expired(engine: sa.Engine) -> None:
    """Every job claimed by a worker that vanished: running, one attempt, lease expired."""
    with engine.begin() as conn:
        conn.execute(sa.text(
            "UPDATE outbox_jobs SET status = 'running', attempts = attempts + 1, fence = nextval('outbox_fence_seq'),"
            " locked_by = 'gone', lease_until = now() - interval '1 second'"))


def _statuses(engine: sa.Engine) -> dict[str, int]:
    with engine.connect() as conn:
        return dict(conn.execute(sa.text("SELECT status, count(*) FROM outbox_jobs GROUP BY status")).all())


def _maintenance(engine: sa.Engine, settings, **overrides) -> Maintenance:
    return Maintenance(engine, settings(**overrides), stop=threading.Event(), wake_workers=Wakeup(),
                       reconnect=Reconnector(0.2))


def test_a_reaper_round_takes_back_expired_leases_and_wakes_the_workers(engine, settings):
    _jobs(engine, settings, 3)
    _run_expired(engine)
    maintenance = _maintenance(engine, settings)
    reaped = maintenance.reap()
    assert (reaped.retried, reaped.dead, reaped.unstarted) == (3, 0, 0)
    assert _statuses(engine) == {"ready": 3}
    assert maintenance.wake_workers.take_rewind()  # back with their early place: claim from the head
    assert maintenance.wake_workers.wait(0) == (True, False)
    assert (maintenance.stats["reaped"], maintenance.stats["reaped_dead"]) == (3, 0)
    assert maintenance.reap().retried == 0  # nothing left expired
    assert maintenance.wake_workers.wait(0) == (False, False)


def test_a_job_whose_lease_expired_on_its_last_attempt_is_dead(engine, settings):
    _jobs(engine, settings, 2, max_attempts=1)
    _run_expired(engine)
    maintenance = _maintenance(engine, settings)
    assert maintenance.reap().dead == 2
    assert _statuses(engine) == {"dead": 2}
    assert (maintenance.stats["reaped"], maintenance.stats["reaped_dead"]) == (2, 2)


def test_a_pruning_round_deletes_old_done_jobs_and_finished_events(engine, settings):
    _jobs(engine, settings, 4)
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE outbox_jobs SET status = 'done', finished_at = now() - interval '2 hours'"
                             " WHERE id IN (SELECT id FROM outbox_jobs ORDER BY id LIMIT 3)"))
        conn.execute(sa.text("UPDATE outbox_events SET routed_at = now() - interval '2 hours'"))
    maintenance = _maintenance(engine, settings, retention_done=3600, retention_events=3600)
    assert maintenance.prune() == (3, 3)  # the fourth event still has its ready job
    assert _statuses(engine) == {"ready": 1}
    assert (maintenance.stats["pruned_jobs"], maintenance.stats["pruned_events"]) == (3, 3)


def test_a_pruning_round_deletes_batch_after_batch_until_it_has_caught_up(engine, settings, monkeypatch):
    """A round is not one batch: it deletes batch after batch (each its own transaction) until
    one is not full, so the pruner keeps up with a rate above a batch per ``prune_interval``
    (one batch of 5,000 a minute could not follow a relay finishing 900 jobs a second). A
    round whose time (``reap_interval``) runs out says it is behind, and the loop prunes
    again after the next reaper round."""
    from outbox.relay import maintenance as module

    monkeypatch.setattr(module, "PRUNE_BATCH", 2)
    _jobs(engine, settings, 7)
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE outbox_jobs SET status = 'done', finished_at = now() - interval '2 hours'"))
        conn.execute(sa.text("UPDATE outbox_events SET routed_at = now() - interval '2 hours'"))
    maintenance = _maintenance(engine, settings, retention_done=3600, retention_events=3600)
    assert maintenance.prune() == (7, 7)  # four batches of at most 2 of each
    assert not maintenance.prune_behind and _statuses(engine) == {}
    _jobs(engine, settings, 5)
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE outbox_jobs SET status = 'done', finished_at = now() - interval '2 hours'"))
    slow = _maintenance(engine, settings, retention_done=3600, retention_events=3600, reap_interval=0.000001)
    assert slow.prune() == (2, 0)  # its time was up after the first batch
    assert slow.prune_behind
    assert slow.prune() == (2, 0) and slow.prune() == (1, 0) and not slow.prune_behind


def test_a_pruning_round_vacuums_when_autovacuum_is_off(engine, settings):
    with engine.begin() as conn:
        conn.execute(sa.text("ALTER TABLE outbox_jobs SET (autovacuum_enabled = false)"))
    maintenance = _maintenance(engine, settings)
    assert maintenance.prune() == (0, 0)
    assert maintenance.prune() == (0, 0)
    assert (maintenance.stats["vacuums"], maintenance.stats["vacuums_skipped"]) == (2, 0)


def test_the_loop_reaps_every_interval_until_stopped(engine, settings):
    _jobs(engine, settings, 2)
    maintenance = _maintenance(engine, settings, reap_interval=0.05, prune_interval=3600)
    maintenance.start()
    try:
        _run_expired(engine)
        # The round counts after its commit: wait for both, not the rows alone.
        wait_for(lambda: _statuses(engine) == {"ready": 2} and maintenance.stats["reaped"] == 2, timeout=TIMEOUT,
                 what="the expired jobs reaped and counted")
        _run_expired(engine)
        wait_for(lambda: maintenance.stats["reaped"] == 4, timeout=TIMEOUT, what="a later round reaping again")
    finally:
        maintenance.stop()
        assert maintenance.join(timeout=5)
    assert maintenance.stop_event.is_set()
