"""Counters: adds from many threads at once are never lost."""

from __future__ import annotations

import sys
import threading

from outbox.relay.counters import Counters


def test_names_start_at_zero_and_others_appear_on_first_add():
    counts = Counters(("completed",))
    assert counts == {"completed": 0}
    counts.add("completed", 3)
    counts.add("forwarded")
    assert counts == {"completed": 3, "forwarded": 1}


def test_adds_from_many_threads_are_all_counted():
    """Eight threads add 1 twenty thousand times each, switching threads as often as the
    interpreter allows: the total is exact (a plain ``d[k] += 1`` loses counts this way)."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        counts = Counters(("n",))
        start = threading.Barrier(8)

        def work() -> None:
            start.wait()
            for _ in range(20_000):
                counts.add("n")

        threads = [threading.Thread(target=work) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert counts["n"] == 160_000
