"""The wake-up cooldown's rule (``outbox.relay.notify.Cooldown``), without a clock to wait on:
each case would block for the cooldown's ten seconds if the rule were broken; and the wait
that ends a dispatcher's cooldown when an outcome is posted (``Wakeup.wait_poke``)."""

from __future__ import annotations

import threading
import time

from outbox.relay.notify import Cooldown, Wakeup


def test_the_first_round_and_a_round_after_a_full_batch_start_at_once() -> None:
    cooldown = Cooldown(10.0)
    idle = threading.Event()
    started = time.monotonic()
    cooldown.wait(idle.wait)  # no round yet
    assert not cooldown.holding()
    cooldown.started()
    assert cooldown.holding()
    cooldown.skip()  # its batch came back full
    assert not cooldown.holding()
    cooldown.wait(idle.wait)
    assert time.monotonic() - started < 5.0


def test_a_round_waits_out_the_cooldown_until_stop_is_set() -> None:
    cooldown = Cooldown(10.0)
    stop = threading.Event()
    cooldown.started()
    threading.Timer(0.05, stop.set).start()
    started = time.monotonic()
    cooldown.wait(stop.wait)
    assert 0.04 <= time.monotonic() - started < 5.0  # it waited, and the stop cut the wait short


def test_a_poke_ends_a_cooldown_waited_through_wait_poke_and_a_jobs_hint_does_not() -> None:
    """A dispatcher waits out its cooldown through ``Wakeup.wait_poke``: an outcome posted
    (a poke) ends the wait at once; a jobs hint (a NOTIFY) does not, and is left for
    ``Wakeup.wait``, which the poke no longer reports (it was taken)."""
    cooldown = Cooldown(10.0)
    wake = Wakeup()
    cooldown.started()
    threading.Timer(0.05, wake.set).start()  # a jobs hint: shares the next round
    threading.Timer(0.3, wake.poke).start()  # an outcome: ends the cooldown
    started = time.monotonic()
    cooldown.wait(wake.wait_poke)
    assert 0.25 <= time.monotonic() - started < 5.0
    assert wake.wait(0) == (True, False)
    assert not wake.wait_poke(0.01)
