"""The statements' registry (:mod:`outbox.db.queries`): every statement defined in the module
is declared in :class:`~outbox.db.queries.Statements` (so mypy knows it and rejects a misspelt
name, tests/unit/test_typing.py) and every declaration names a statement; no database needed."""

from __future__ import annotations

import sqlalchemy as sa

from outbox.db import queries

#: Declared in the registry besides the module's statements.
EXTRA = {"schema", "schema_create"}


def test_every_statement_is_declared_in_the_registry():
    declared = set(queries.Statements.__annotations__) - EXTRA
    defined = set(queries.statements())
    assert sorted(defined - declared) == [], "defined in queries.py but not declared in Statements"
    assert sorted(declared - defined) == [], "declared in Statements but not defined in queries.py"


def test_declarations_are_text_clauses_and_set_in_every_schema():
    for schema in ("public", "tenant_a"):
        statements = queries.in_schema(schema)
        for name, kind in queries.Statements.__annotations__.items():
            assert kind == ("str" if name == "schema" else "TextClause"), name
            if name != "schema":
                assert isinstance(getattr(statements, name), sa.TextClause), (schema, name)
