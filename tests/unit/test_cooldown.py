"""The wake-up cooldown's rule (``outbox.relay.notify.Cooldown``), without a clock to wait on:
each case would block for the cooldown's ten seconds if the rule were broken."""

from __future__ import annotations

import threading
import time

from outbox.relay.notify import Cooldown


def test_the_first_round_and_a_round_after_a_full_batch_start_at_once() -> None:
    cooldown = Cooldown(10.0)
    idle = threading.Event()
    started = time.monotonic()
    cooldown.wait(idle)  # no round yet
    cooldown.started()
    cooldown.skip()  # its batch came back full
    cooldown.wait(idle)
    assert time.monotonic() - started < 5.0


def test_a_round_waits_out_the_cooldown_until_stop_is_set() -> None:
    cooldown = Cooldown(10.0)
    stop = threading.Event()
    cooldown.started()
    threading.Timer(0.05, stop.set).start()
    started = time.monotonic()
    cooldown.wait(stop)
    assert 0.04 <= time.monotonic() - started < 5.0  # it waited, and the stop cut the wait short
