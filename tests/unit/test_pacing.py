"""The runner's pacing on its own (:mod:`outbox.relay.pacing`): the workers' rate, the jobs
handed to the pool ahead of its threads, the claim batch, the elastic pool's growth, and
what explicit settings fix. Real :class:`HeldClaims`, a made-up monotonic clock, no threads."""

from __future__ import annotations

import time

import pytest

from outbox.relay import pacing
from outbox.relay.claims import HeldClaims
from outbox.relay.pacing import Pacing
from outbox.settings import OutboxSettings
from outbox.telemetry.metrics import PacingReading


def make(**explicit: int) -> tuple[HeldClaims, Pacing, list[int]]:
    """A pacing of 8 threads; ``explicit``: settings given (env, flag or constructor)."""
    held = HeldClaims(concurrency=explicit.get("concurrency", 8))
    grown: list[int] = []
    settings = OutboxSettings(_env_file=None, **explicit)
    return held, Pacing(settings, held, grown.append), grown


def finish(held: HeldClaims, n: int) -> None:
    """``n`` handlers returned (what ``slot_freed`` counts)."""
    held.finished += n


def test_quick_workers_get_jobs_handed_ahead_and_larger_claims():
    held, p, _ = make()
    start = p._at
    assert (held.ahead, p.claim_batch(), held.worker_slots()) == (0, 50, 8)
    finish(held, 800)  # 800 jobs in 100 ms: 8,000 jobs/s
    p.update(start + 0.1)
    assert p.rate == pytest.approx(8_000)
    assert held.ahead == round(8_000 * pacing.HORIZON) == 200
    assert p.claim_batch() == 200 and held.worker_slots() == 208
    finish(held, 4_000)  # 40,000 jobs/s: both bounded
    p.update(start + 0.2)
    assert (held.ahead, p.claim_batch()) == (pacing.AHEAD_MAX, pacing.BATCH_MAX)


def test_the_rate_decays_by_halves_and_one_job_a_minute_hands_nothing_ahead():
    held, p, _ = make()
    start = p._at
    finish(held, 2_000)
    p.update(start + 0.1)  # 20,000 jobs/s
    assert held.ahead == pacing.AHEAD_MAX
    p.update(start + 0.2)  # none finished: halved
    assert p.rate == pytest.approx(10_000) and held.ahead == 250
    finish(held, 1)
    p.update(start + 60.2)  # one job a minute: the figure is that
    assert p.rate == pytest.approx(1 / 60) and held.ahead == 0 and p.claim_batch() == pacing.BATCH_MIN


def test_measures_closer_than_the_sample_interval_change_nothing():
    held, p, _ = make()
    start = p._at
    finish(held, 1_000)
    p.update(start + pacing.SAMPLE_EVERY / 2)
    assert (p.rate, held.ahead) == (0.0, 0)


def test_a_hung_handler_takes_the_jobs_ahead_away():
    held, p, _ = make()
    finish(held, 2_000)
    p.update(p._at + 0.1)
    assert held.worker_slots() == 8 + pacing.AHEAD_MAX
    held.hang()
    assert held.worker_slots() == 8
    with held.reserving(100, limit=1_000) as room:
        assert room.start_now == 8


@pytest.mark.parametrize("explicit", [{"prefetch": 50}, {"prefetch": 0}])
def test_an_explicit_prefetch_hands_nothing_ahead_and_the_batch_is_still_paced(explicit):
    held, p, _ = make(**explicit)
    finish(held, 2_000)
    p.update(p._at + 0.1)
    assert p.rate > 0 and held.ahead == 0 and held.worker_slots() == 8
    assert p.claim_batch() == pacing.BATCH_MAX


def test_brokers_acknowledgements_size_the_claims_but_hand_no_worker_jobs_ahead():
    held = HeldClaims(concurrency=8, window=500, forwarding=["fwd"])
    p = Pacing(OutboxSettings(_env_file=None), held)
    held.acknowledged += 800  # 8,000 acknowledgements a second
    p.update(p._at + 0.1)
    assert p.forward_rate == pytest.approx(8_000) and p.rate == 0
    assert p.claim_batch() == 200 and held.ahead == 0


def test_an_explicit_claim_batch_wins():
    held, p, _ = make(claim_batch=50)
    finish(held, 2_000)
    p.update(p._at + 0.1)
    assert held.ahead == pacing.AHEAD_MAX and p.claim_batch() == 50


def busy(held: HeldClaims, waiting: int) -> None:
    """Every thread busy and ``waiting`` jobs handed to the pool beyond them."""
    held.issued = held.concurrency + waiting


def run_pool(held: HeldClaims, p: Pacing, grown: list[int], seconds: float, per_thread: float) -> float:
    """Drive ``p`` for ``seconds`` in steps of 0.1 s of a made-up clock: every thread busy, 10
    jobs waiting, handlers off the CPU; ``per_thread(threads)`` jobs finished per thread and
    step. Applies each growth to ``held`` as the runner would. Returns the clock."""
    t = p._at
    for _ in range(round(seconds / 0.1)):
        t += 0.1
        held.issued = held.concurrency + 10
        finish(held, round(per_thread(held.concurrency) * held.concurrency))
        p.handled(0.005, 0.0001)  # a handler 5 ms off the CPU
        before = len(grown)
        p.update(t)
        if len(grown) > before:
            held.add_threads(grown[-1])
    return t


def test_handlers_that_wait_on_io_grow_the_pool_by_trials_up_to_the_bound():
    held, p, grown = make()
    run_pool(held, p, grown, 4.0, lambda threads: 20)  # each thread 200 jobs/s: the rate follows the threads
    assert grown == [8, 16, 32, 64] and held.concurrency == pacing.THREADS_MAX


def test_a_growth_that_does_not_raise_the_rate_is_taken_back_and_not_tried_again_for_a_while():
    held, p, grown = make()
    run_pool(held, p, grown, 2.0, lambda threads: 800 / threads)  # 8,000 jobs/s however many threads: the GIL
    assert grown == [8, -8] and held.concurrency == 8
    run_pool(held, p, grown, pacing.RETRY_AFTER - 2.5, lambda threads: 800 / threads)
    assert grown == [8, -8]  # quiet
    run_pool(held, p, grown, 2.5, lambda threads: 800 / threads)
    assert grown == [8, -8, 8, -8]  # tried again once the quiet spell ended


def test_the_pool_does_not_grow_for_handlers_on_the_cpu_nor_without_jobs_waiting():
    held, p, grown = make()
    busy(held, 10)
    p.handled(0.001, 0.0009)  # on the CPU
    p.update(p._at + 0.1)
    held.issued = 3  # threads idle
    p.handled(0.005, 0.0001)
    p.update(p._at + 0.1)
    assert grown == []


def test_an_explicit_concurrency_fixes_the_pool():
    held, p, grown = make(concurrency=8)
    busy(held, 10)
    p.handled(0.005, 0.0001)
    p.update(p._at + 0.1)
    assert grown == [] and p.grow is None


def test_only_idle_threads_beyond_the_floor_retire():
    held = HeldClaims(concurrency=16)
    held.issued = 16
    assert not held.retire_thread(floor=8)  # every thread busy
    held.issued = 4
    assert [held.retire_thread(floor=8) for _ in range(10)] == [True] * 8 + [False] * 2
    assert held.concurrency == 8


def test_full_claims_of_the_largest_batch_keep_the_backlog_deep_for_a_while_and_a_short_one_ends_it():
    _, p, _ = make()
    assert not p.deep(100.0)
    p.claimed(pacing.BATCH_MAX, pacing.BATCH_MAX, now=100.0)
    assert p.deep(100.0 + pacing.DEEP_FOR - 0.01) and not p.deep(100.0 + pacing.DEEP_FOR)
    p.claimed(pacing.BATCH_MAX, pacing.BATCH_MAX, now=101.0)
    p.claimed(50, 50, now=101.5)  # a full small claim changes nothing
    assert p.deep(101.6)
    p.claimed(pacing.BATCH_MAX, 3, now=101.7)  # came back short: drained
    assert not p.deep(101.8)


def test_the_start_line_says_what_is_paced_and_what_is_set():
    _, p, _ = make()
    assert p.describe(2) == ("concurrency 8 (elastic, up to 128), claim_batch paced 50-250, prefetch 50 "
                             "(+ up to 500 handed ahead, paced), dispatchers 1 (+1 on standby for a deep backlog)")
    _, fixed, _ = make(concurrency=16, claim_batch=100, prefetch=0, dispatchers=2)
    assert fixed.describe(2) == "concurrency 16, claim_batch 100, prefetch 0, dispatchers 2"


def test_the_pool_does_not_grow_while_the_process_is_bound_by_the_gil_or_a_handler_hangs():
    held, p, grown = make()
    busy(held, 10)
    p.handled(0.005, 0.0001)  # off the CPU: a wait for the GIL looks the same from the thread
    spin = time.process_time() + 0.12
    while time.process_time() < spin:  # the process busy for the whole measure: a core
        pass
    p.update(p._at + 0.1)
    held.hang()
    p.handled(0.005, 0.0001)
    p.update(p._at + 0.1)
    assert grown == []
    held.unhang()
    for _ in range(4):  # a trial compares with the rate over the last 0.3 s
        p.handled(0.005, 0.0001)
        p.update(p._at + 0.1)
    assert grown == [8]  # the same measure grows the pool once neither holds


def test_the_metrics_reading_is_what_the_pacing_sizes_now():
    held, p, _ = make()
    start = p._at
    finish(held, 800)  # 8,000 jobs/s
    p.update(start + 0.1)
    assert p.reading(standby=True) == PacingReading(threads=8, ahead=200, claim_batch=200, standby=False)
    p.claimed(pacing.BATCH_MAX, pacing.BATCH_MAX, now=time.monotonic())  # a full claim of the largest batch
    assert p.reading(standby=True).standby is True and p.reading(standby=False).standby is None
    held.hang()  # a hung handler takes the jobs ahead away, and the gauge with them
    assert p.reading(standby=False) == PacingReading(threads=8, ahead=0, claim_batch=200, standby=None)
