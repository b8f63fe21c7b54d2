"""Promotion: an ordered key's next job becomes ready once the job before it finished
(architecture notes, "Ordering"; the relay's rules in :mod:`outbox.relay.ordering`).

Shared by the relay (after each round of outcomes, and the head sweep) and the operator's
commands (``cancel`` of an ordered head, ``skip`` of a dead one: :mod:`outbox.admin`). Both
run it after the change that finished the key's job committed, never in its transaction.
The pairs go to ``job_promote_many`` sorted and without repeats, so two promotions lock
the keys' heads in one order and cannot deadlock each other.
"""

from __future__ import annotations

from collections.abc import Iterable

from outbox.db.jobs import Executor, promote_keys


def promote_params(keys: Iterable[tuple[str, str]]) -> dict[str, list[str]] | None:
    """The parameters of ``job_promote_many`` for the (consumer, key) pairs ``keys``, sorted
    and without repeats; None when there are none (then no statement needs to run)."""
    pairs = sorted(set(keys))
    if not pairs:
        return None
    return {"consumers": [c for c, _ in pairs], "keys": [k for _, k in pairs]}


def promote(conn: Executor, keys: Iterable[tuple[str, str]], *, schema: str | None = None) -> list[int]:
    """Promote the pending head of each (consumer, key) in ``keys`` whose head is pending
    (``job_promote_many``); returns the ids promoted. ``conn`` should be autocommit, or the
    caller commits: run it after the outcomes that finished the keys' jobs committed (see
    the module notes)."""
    params = promote_params(keys)
    return [] if params is None else [r.id for r in promote_keys(conn, params, schema=schema)]
