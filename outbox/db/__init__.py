"""Database layer: the tables (:mod:`outbox.db.tables`), every runtime statement by name
(:mod:`outbox.db.queries`), engines and error translation (:mod:`outbox.db.engine`)."""
