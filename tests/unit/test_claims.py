"""The runner's claim state on its own (:mod:`outbox.relay.claims`, :mod:`outbox.relay.claim`):
the room a claim reserves and gives back, the hand-over to workers and buffer, the buffer's
claim order, and what the starter may take. No database, no threads."""

from __future__ import annotations

import pytest

from outbox.relay.claim import Claim, jobs_of
from outbox.relay.claims import HeldClaims
from outbox.testing import make_job


def claim(fence: int, *, priority: int = 0, consumer: str = "a", lease: float = 30.0) -> Claim:
    """A claim of job ``fence`` (its id too) at ``(priority, fence)`` in claim order."""
    made = Claim(make_job({"n": fence}, id=fence, fence=fence, consumer=consumer, lease_seconds=lease),
                 order=(priority, "2026-12-03", fence))
    made.sent_at(100.0)  # the lease bound: 100 + lease, by a made-up monotonic clock
    return made


def test_a_claim_keeps_the_runners_bookkeeping_off_the_job():
    c = claim(7, lease=10.0)
    assert (c.id, c.fence, c.consumer, c.lease_bound) == (7, 7, "a", 110.0)
    c.renewed(200.0)
    assert c.lease_bound == 210.0
    assert not hasattr(c.job, "_lease_bound") and not hasattr(c.job, "_claim_order")
    c.ran = 0.25
    assert c.fields(outcome="done")["duration_seconds"] == 0.25
    assert "duration_seconds" not in claim(8).fields()
    c.job.mark_lease_lost()
    assert c.lease_lost and jobs_of([c]) == [c.job]


def test_a_reservation_asks_for_the_room_left_and_reserves_idle_slots():
    held = HeldClaims(concurrency=2)
    with held.reserving(5, limit=4) as room:
        assert (room.asked, room.start_now) == (4, 2)
        assert held.taken() == 6  # asked for (4) + the reserved slots (2), until the hand-over
        with held.reserving(5, limit=4) as other:  # a second dispatcher's claim in flight
            assert (other.asked, other.start_now) == (0, 0)
    assert held.taken() == 0 and held.issued == 0 and held.expected == 0  # nothing handed over: all given back


def test_the_hand_over_fills_the_reserved_slots_first_and_buffers_the_rest_in_claim_order():
    held = HeldClaims(concurrency=2)
    started: list[Claim] = []
    first, second, third = claim(1), claim(2), claim(3)
    with held.reserving(3, limit=10) as room:
        assert room.hand_over([first, second, third], started.extend) == [first, second]
        with pytest.raises(RuntimeError):
            room.hand_over([], started.extend)  # once
    assert started == [first, second]
    assert list(held.buffer) == [third] and held.buffer_fences() == [3]
    assert held.count() == 3 and held.issued == 2 and held.expected == 0


def test_slots_a_short_claim_did_not_fill_are_given_back():
    held = HeldClaims(concurrency=4)
    with held.reserving(4, limit=10) as room:
        assert room.start_now == 4
        room.hand_over([claim(1)], lambda claims: None)
    assert held.issued == 1 and held.has_idle_worker()


def test_a_forwarders_jobs_never_take_a_reserved_slot():
    held = HeldClaims(concurrency=2, window=8, forwarding=["fwd"])
    sent = claim(1, consumer="fwd")
    run = claim(2)
    with held.reserving(2, limit=20) as room:
        assert room.hand_over([sent, run], lambda claims: None) == [run]
    assert list(held.buffer) == [sent] and held.issued == 1


def test_claims_handed_back_ahead_of_the_backlog_start_first():
    held = HeldClaims(concurrency=0)
    with held.reserving(3, limit=10) as room:
        room.hand_over([claim(10, priority=5), claim(11, priority=5)], lambda claims: None)
    with held.reserving(1, limit=10) as room:  # a job released by another relay: early in claim order
        room.hand_over([claim(3, priority=0)], lambda claims: None)
    assert [c.fence for c in held.buffer] == [3, 10, 11]


def test_the_starter_takes_what_idle_slots_allow_and_sets_aside_expired_leases():
    held = HeldClaims(concurrency=1)
    with held.reserving(3, limit=10) as room:
        assert room.start_now == 1
        busy = room.hand_over([claim(1), claim(2, lease=1.0), claim(3)], lambda claims: None)
    assert busy and held.issued == 1
    with held.lock:
        assert held.take_startable(now=105.0) == ([], [], [])  # the one slot is taken
    held.slot_freed(busy[0])
    with held.lock:
        jobs, forwards, expired = held.take_startable(now=105.0)  # claim 2's lease ran out at 101
    assert [c.fence for c in jobs] == [3] and forwards == [] and [c.fence for c in expired] == [2]
    assert held.buffer_fences() == [3]  # still listed until the starter's statement unlists it
    held.unlisted(jobs)
    assert held.buffer_fences() == [] and held.issued == 1


def test_a_heartbeat_loses_only_claims_held_and_not_finishing():
    held = HeldClaims(concurrency=3)
    a, b, c = claim(1), claim(2), claim(3)
    with held.reserving(3, limit=10) as room:
        room.hand_over([a, b, c], lambda claims: None)
    held.mark_finishing(b.fence)  # its outcome is being written: the completion took the row
    held.forget([c])
    assert held.lost([a, b, c], owned=set()) == [a]
    assert held.renewable() == [a, b]
    assert held.first_reports([a]) == [a] and held.first_reports([a]) == []  # summarised once
    assert held.get(1) is a and held.get(3) is None
