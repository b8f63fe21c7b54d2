"""What several dispatchers of one relay share (outbox/relay/dispatcher.py, outbox/relay/notify.py): the
relay's row, whose rewrite waits for the claims in flight and holds new ones back, and
the wake-ups, which reach every dispatcher. No database: the rules are in Python."""

from __future__ import annotations

import threading

from outbox.relay.claims import HeldClaims
from outbox.relay.dispatcher import RelayRow
from outbox.relay.notify import Wakeup

WAIT = 5.0  # seconds a thread gets to reach a point it must reach
BLOCKED = 0.3  # seconds a thread that must stay blocked is watched


def _in_thread(target: object) -> tuple[threading.Thread, threading.Event]:
    """Run ``target`` (a callable taking the 'entered' event) in a daemon thread."""
    entered = threading.Event()
    thread = threading.Thread(target=target, args=(entered,), daemon=True)  # type: ignore[arg-type]
    thread.start()
    return thread, entered


def test_a_rewrite_of_the_row_waits_for_the_claims_in_flight_and_holds_new_ones_back():
    row = RelayRow(HeldClaims(4), "host:1:x", "public", dispatchers=2)
    first_done = threading.Event()
    rewrite_done = threading.Event()

    def first_claim(entered: threading.Event) -> None:
        with row.claiming():
            entered.set()
            first_done.wait(WAIT)

    def rewrite(entered: threading.Event) -> None:
        with row.rewriting():
            entered.set()
            rewrite_done.wait(WAIT)

    def second_claim(entered: threading.Event) -> None:
        with row.claiming():
            entered.set()

    claim1, claim1_in = _in_thread(first_claim)
    assert claim1_in.wait(WAIT)
    writer, writer_in = _in_thread(rewrite)
    assert not writer_in.wait(BLOCKED)  # a claim is in flight: the rewrite waits for it
    claim2, claim2_in = _in_thread(second_claim)
    assert not claim2_in.wait(BLOCKED)  # a rewrite is waiting: a new claim waits behind it
    first_done.set()
    assert writer_in.wait(WAIT)  # the claim ended: the rewrite runs
    assert not claim2_in.wait(BLOCKED)  # and no claim runs beside it
    rewrite_done.set()
    assert claim2_in.wait(WAIT)
    for thread in (claim1, writer, claim2):
        thread.join(WAIT)


def test_claims_of_several_dispatchers_run_side_by_side():
    row = RelayRow(HeldClaims(4), "host:1:x", "public", dispatchers=2)
    release = threading.Event()

    def claim(entered: threading.Event) -> None:
        with row.claiming():
            entered.set()
            release.wait(WAIT)

    threads = [_in_thread(claim) for _ in range(2)]
    try:  # both inside at once: neither leaves before release, which comes after the check
        assert all(entered.wait(WAIT / 2) for _, entered in threads)
    finally:
        release.set()
    for thread, _ in threads:
        thread.join(WAIT)


def test_every_branch_of_a_wakeup_gets_each_wakeup_and_clears_only_its_own():
    wake = Wakeup()
    a, b = wake.branch(), wake.branch()
    wake.set()
    assert a.wait(0) == (True, False)
    assert a.wait(0) == (False, False)  # cleared for a
    assert b.wait(0) == (True, False)  # not taken from b
    wake.poke()
    wake.poke()  # a second poke before anyone waited still reaches both
    assert (a.wait(0), b.wait(0)) == ((False, True), (False, True))
    wake.rewind()
    assert a.take_rewind() == "head" and b.take_rewind() == "head"
    assert a.take_rewind() is None


def test_each_dispatcher_takes_one_closing_marker_and_puts_back_another_it_meets():
    """stop() queues one closing marker per dispatcher. A dispatcher that has its marker and
    takes late outcomes must leave the other's marker in the queue: without it the other
    would never stop (and the last to stop would never remove the relay's row)."""
    import sqlalchemy as sa

    from outbox import Outbox
    from outbox.relay.outcomes import Outcome
    from outbox.relay.runner import JobRunner
    from outbox.settings import OutboxSettings

    ob = Outbox()
    ob.subscriber("t", consumer="a")(lambda job: None)
    engine = sa.create_engine("postgresql+psycopg://nobody@127.0.0.1:1/none")  # never connected
    runner = JobRunner(engine, ob, OutboxSettings(_env_file=None, dispatchers=2), "host:1:x", Wakeup())
    first, second = runner.dispatchers
    late = ("job", Outcome.DONE)
    for item in (late, None, late, None):
        runner._outcomes.put(item)  # type: ignore[arg-type]
    assert first._take_outcomes(closing=False) == [late, None]  # up to its marker
    assert first._take_outcomes(closing=True) == [late]  # a late outcome, and the other marker put back
    assert second._take_outcomes(closing=False) == [None]
    assert first._take_outcomes(closing=True) == []


def test_the_shared_hint_is_where_the_latest_claim_stopped_even_before_an_earlier_one():
    """After a rewind a claim from the head may take only part of the jobs handed back
    (they keep their early place); the next claim must go on from where it stopped, not
    jump past the rest to the furthest key any claim reached (they would wait a second per
    claim's worth, for the next claim from the head). A claim that comes back short or
    empty keeps the hint: what sorts before it is announced (issue 28: going back to the
    head after every short claim read the whole index under a long snapshot)."""
    from datetime import UTC, datetime

    from outbox.relay.producer import ClaimHint

    at = datetime(2026, 12, 2, tzinfo=UTC)
    hint = ClaimHint()
    assert hint.start() is None and hint.key() is None  # no hint yet: from the head
    hint.claimed((0, at, 900))
    assert hint.start() == (0, at, 900)
    hint.claimed((0, at, 40))  # from the head again, after a rewind
    assert hint.start() == (0, at, 40)
    hint.claimed((0, at, 60))  # short after the hint: it stays where the claim stopped
    assert hint.start() == (0, at, 60)
    hint.claimed(None)  # nothing after it: unchanged
    assert hint.start() == hint.key() == (0, at, 60)
    assert hint.start("head") is None
    assert hint.start((0, at, 10)) == (0, at, 10)  # lowered by a wake-up
    assert hint.start((1, at, 10)) == (0, at, 60)  # a key after the hint changes nothing


def test_looks_from_the_head_are_spaced_by_their_cost():
    """A look-out looks at least HEAD_SECONDS apart, and a slow look (a long snapshot keeps
    the index entries of finished jobs) spaces the next one by its duration / HEAD_SHARE."""
    import time as clock

    from outbox.relay import notify

    assert 0 < notify.next_head_scan(0.001) - clock.monotonic() <= notify.HEAD_SECONDS
    due = notify.next_head_scan(0.5) - clock.monotonic()
    assert 0.5 / notify.HEAD_SHARE - 1 < due <= 0.5 / notify.HEAD_SHARE


def test_a_ready_notification_carries_a_key_just_before_the_first_job():
    from datetime import UTC, datetime

    from outbox.relay.notify import Wakeup, ready_key

    at = datetime(2026, 12, 2, 10, 0, 0, 123456, tzinfo=UTC)
    key = ready_key(f"ready -3 {at.timestamp()}")
    assert key is not None and key[0] == -3 and key[1] < at and (at - key[1]).total_seconds() < 0.002
    assert ready_key("ready x y") is None and ready_key("head") is None and ready_key("ready 1") is None
    wake = Wakeup()
    wake.lower((0, at, 5))
    wake.lower((0, at, 3))
    wake.lower((1, at, 1))
    assert wake.take_rewind() == (0, at, 3)
    assert wake.take_rewind() is None
    wake.lower((0, at, 3))
    wake.rewind()
    wake.lower((0, at, 1))
    assert wake.take_rewind() == "head"
