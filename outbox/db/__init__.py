"""Database layer: the tables (:mod:`outbox.db.tables`), every runtime statement by name
(:mod:`outbox.db.queries`), engines and error translation (:mod:`outbox.db.engine`).

:func:`include_object` is the alembic hook an application's ``env.py`` passes so that its
own autogenerate leaves outbox's tables alone."""

from outbox.db.tables import include_object

__all__ = ["include_object"]
