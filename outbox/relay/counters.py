"""Counters: the relay's tallies (jobs claimed, completed, released, ...), shared by its threads.

The counts feed the relay's stop line and ``outbox-relay``'s own tests, never the database.
Several threads add to one counter (the dispatchers' completers, the workers, the
heartbeat, the forwarder); ``counts[name] += n`` on a plain dict reads, adds and stores in
three steps, between which another thread may store its own sum, and a count is lost. Adding
goes through :meth:`Counters.add`, under a lock; reading is a plain dict read.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable


class Counters(dict[str, int]):
    """Named counts, each starting at 0 (``names``: the ones that exist from the start, so a
    snapshot shows them at 0; :meth:`add` makes any other on first use). A ``dict`` for
    reading (``counts["completed"]``, ``{**counts}``); add only with :meth:`add`."""

    def __init__(self, names: Iterable[str] = ()) -> None:
        super().__init__((name, 0) for name in names)
        self._lock = threading.Lock()

    def add(self, name: str, n: int = 1) -> None:
        """Add ``n`` (default 1) to the count ``name``, atomically with other threads' adds."""
        with self._lock:
            self[name] = self.get(name, 0) + n
