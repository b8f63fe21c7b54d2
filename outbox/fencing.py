"""fenced_write: guard a downstream table with the job's fencing token.

The row keeps the fence of the last writer; a write applies only when its fence is higher
(``ON CONFLICT ... DO UPDATE ... WHERE table.fence < EXCLUDED.fence``). Fences come from
one global sequence and grow with every claim, so a worker that was paused past its lease
and wakes after another worker re-claimed the job holds a lower fence than the row and is
refused (seed article 000, "Fencing tokens"; Kleppmann, "How to do distributed locking").
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from sqlalchemy import FromClause, Table, UniqueConstraint, inspect
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Mapper, Session

from outbox.errors import ConfigurationError, StaleFenceError
from outbox.telemetry.metrics import record_stale_write

log = logging.getLogger(__name__)


def fenced_write(
    session: Session | Connection,
    table: FromClause | type[Any],
    key: Mapping[str, Any],
    values: Mapping[str, Any],
    fence: int,
    *,
    raise_on_stale: bool = False,
) -> bool:
    """Insert or update the row of ``table`` identified by ``key`` unless a write with an
    equal or higher fence got there first. Runs in ``session``'s transaction.

    ``table`` is a SQLAlchemy ``Table``, an ORM mapped class (its mapped table is written:
    ``Invoice`` and ``Invoice.__table__`` are the same) or that class's ``__table__`` (which
    SQLAlchemy types as a ``FromClause``; other ``FromClause`` objects are refused). It needs
    a ``fence`` bigint column and a primary key or unique constraint on exactly the columns of
    ``key`` (a mapping column name -> value; column names, not ORM attribute names, where the
    two differ). ``values`` are the other columns to write. ``fence`` is :attr:`outbox.Job.fence` (a positive int).

    Returns True when the row was written, False when it was left alone because its stored
    fence is equal or higher (logged as "stale write rejected", and counted in
    ``outbox_stale_writes_rejected_total`` when the relay serves metrics); with ``raise_on_stale``
    raises :class:`~outbox.errors.StaleFenceError` instead. Raises
    :class:`~outbox.errors.ConfigurationError` for a table or key that does not fit, and for
    a ``table`` that is neither a ``Table`` nor a mapped class (naming what it got).
    """
    table = table_of(table)
    if type(fence) is not int or fence < 1:
        raise ConfigurationError(f"fence must be a positive int (job.fence), got {fence!r}")
    if not key:
        raise ConfigurationError("key must name at least one column")
    if "fence" not in table.c:
        raise ConfigurationError(f"table {table.name!r} has no 'fence' column")
    unknown = [c for c in (*key, *values) if c not in table.c]
    if unknown or "fence" in key or "fence" in values:
        raise ConfigurationError(f"table {table.name!r}: bad column names {unknown or ['fence']!r}")
    if frozenset(key) not in _unique_keys(table):
        raise ConfigurationError(
            f"table {table.name!r} declares no primary key or unique constraint on exactly {sorted(key)!r}")
    insert = pg_insert(table).values({**key, **values, "fence": fence})
    statement = insert.on_conflict_do_update(
        index_elements=list(key),
        set_={**{c: insert.excluded[c] for c in values}, "fence": insert.excluded.fence},
        where=table.c.fence < insert.excluded.fence,
    ).returning(table.c.fence)
    # RETURNING, not rowcount: SQLAlchemy 2 does not keep an INSERT's rowcount (it reads -1).
    applied = session.execute(statement).first() is not None
    if not applied:
        record_stale_write()  # outbox_stale_writes_rejected_total of the relays in this process
        log.info("stale write rejected: %s %s at fence %s (a newer fence wrote it)", table.name, dict(key), fence,
                 extra={"table": table.name, "fence": fence, "outcome": "stale_write_rejected"})
        if raise_on_stale:
            raise StaleFenceError(f"{table.name} {dict(key)}: fence {fence} is not newer than the stored one")
    return applied


def table_of(target: Any) -> Table:
    """The ``Table`` that ``target`` writes to: ``target`` itself when it is a ``Table``, the
    mapped table of an ORM mapped class (declarative or imperative). Raises
    :class:`~outbox.errors.ConfigurationError` naming ``target`` for anything else (an ORM
    instance, a ``select()``, a table name as ``str``, a class mapped to a join)."""
    if isinstance(target, Table):
        return target
    mapper = inspect(target, raiseerr=False) if isinstance(target, type) else None
    if isinstance(mapper, Mapper) and isinstance(mapper.local_table, Table):
        return mapper.local_table
    what = f"class {target.__qualname__}" if isinstance(target, type) else f"{type(target).__name__} {target!r:.80}"
    raise ConfigurationError(
        f"table must be a sqlalchemy Table, an ORM mapped class or its __table__, got {what}")


def _unique_keys(table: Table) -> set[frozenset[str]]:
    """Column sets of ``table``'s primary key, unique constraints and unique indexes: the
    keys ``ON CONFLICT`` can name. Checked before writing, so a key that does not fit is a
    :class:`ConfigurationError` and the caller's transaction is not aborted by the server."""
    keys = {frozenset(c.name for c in table.primary_key.columns)}
    keys |= {frozenset(c.name for c in k.columns) for k in table.constraints if isinstance(k, UniqueConstraint)}
    keys |= {frozenset(c.name for c in i.columns) for i in table.indexes
             if i.unique and i.dialect_options["postgresql"].get("where") is None}  # partial: not a key
    keys |= {frozenset([c.name]) for c in table.columns if c.unique}
    return keys
