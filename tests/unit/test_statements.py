"""The statements of :mod:`outbox.db.queries`: every statement defined in the module is declared
in the registry, :class:`~outbox.db.queries.Statements` (so mypy knows it and rejects a misspelt
name, tests/unit/test_typing.py), and every declaration names a statement; each statement is
written out whole, and the pieces several of them share (named CTEs, copied word for word)
stay identical in every copy. No database needed."""

from __future__ import annotations

import re

import pytest
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


def _normal(sql: str) -> str:
    """``sql`` with each run of white space made one space (none next to a parenthesis or a
    comma), so copies indented differently compare equal."""
    return re.sub(r"\s*([,()])\s*", r"\1", re.sub(r"\s+", " ", sql).strip())


def _cte(statement: str, name: str) -> str:
    """The body of CTE ``name`` in ``statement`` (normalised), from its opening parenthesis
    to the matching one."""
    text = _normal(queries.statements()[statement].text)
    match = re.search(rf"(?:WITH |,){name} AS(?: MATERIALIZED)?\(", text)
    assert match, f"{statement} has no CTE {name}"
    depth, start = 0, match.end() - 1
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i + 1]
    raise AssertionError(f"{statement}: CTE {name} does not end")


#: (CTE name, the statements that carry a copy of it)
SHARED_CTES = [
    ("wanted", ["job_claim_many", "job_claim_after_many", "job_claim_limited_many"]),
    ("locked", ["job_heartbeat_many", "job_complete_many", "job_fail_many", "job_release_many", "job_snooze_many"]),
    ("args", ["job_complete_many", "job_release_many"]),
    ("claimed", ["job_claim_after_many", "job_claim_limited_many"]),
    ("listed", ["job_claim_after_many", "job_claim_limited_many"]),
    ("marked", ["job_claim_after_many", "job_claim_limited_many"]),
]


@pytest.mark.parametrize(("name", "holders"), SHARED_CTES, ids=[name for name, _ in SHARED_CTES])
def test_copies_of_a_shared_cte_are_identical(name, holders):
    copies = {holder: _cte(holder, name) for holder in holders}
    assert len(set(copies.values())) == 1, copies


def test_the_claims_set_a_claim_alike():
    """The main claim's UPDATE is the ``claimed`` CTE of the other claims, less the claim-order
    columns they also return; every pick that leaves the held-back consumers out says so in
    the same words."""
    claim = _normal(queries.job_claim_many.text)
    update = claim[claim.index("UPDATE outbox_jobs j"):]
    assert _cte("job_claim_limited_many", "claimed") == f"({update},j.priority,j.run_at)"
    held_back = _normal("""consumer NOT IN (
        SELECT c.consumer FROM outbox_consumers c
        WHERE c.paused_at IS NOT NULL OR c.concurrency IS NOT NULL OR c.rate_limit IS NOT NULL)""")
    for name in ("job_claim_many", "job_claim_after_many", "job_claim_candidates", "job_first_ready_before"):
        assert held_back in _normal(queries.statements()[name].text), name


def test_statements_are_not_assembled_from_fragments():
    """No module-level SQL fragment is left to splice into statements: every string constant
    of the module is a statement, its notes, or a name."""
    fragments = [name for name, value in vars(queries).items()
                 if isinstance(value, str) and re.search(r"\b(SELECT|UPDATE|WHERE|AS \()", value)
                 and not name.startswith("__")]
    assert fragments == []


def test_job_pages_differ_in_their_status_only():
    pages = {status: getattr(queries, f"job_page_{status}").text
             for status in ("ready", "running", "pending", "dead", "done", "cancelled", "superseded")}
    for status, text in pages.items():
        assert f"j.status = '{status}'" in text
        assert text.replace(f"'{status}'", "'ready'") == pages["ready"], status


def test_no_union_is_padded_with_nulls():
    """Two results are two statements (or two result sets), never one UNION whose arms fill
    the other's columns with NULLs."""
    padded = [name for name, statement in queries.statements().items()
              if re.search(r"UNION(?: ALL)? SELECT [^()]*\bNULL,NULL\b", _normal(statement.text))]
    assert padded == []


#: The statements that end an attempt other than as ``done`` and append it to ``history``
#: (the notes on ``history`` in :mod:`outbox.db.queries`).
HISTORY_WRITERS = {"job_complete_many", "job_cancel_claimed", "job_fail_many", "job_release_many", "job_snooze_many",
                   "job_bury", "job_bury_ready", "job_bury_expired", "job_reap_many"}


def test_every_history_append_keeps_the_same_bound_and_entry():
    """Each writer appends one entry with the same expression: the newest ``HISTORY_KEPT - 1``
    entries kept, then the new one, with the six fields in one order; no other statement
    writes ``history``, and every claim sets ``started_at``."""
    keep = _normal(f"""jsonb_path_query_array(coalesce(j.history, '[]'), '$[last - {queries.HISTORY_KEPT - 2} to last]')
                       || jsonb_build_array(jsonb_build_object(""")
    entry = re.compile(re.escape(keep) + r"'attempt',j\.attempts( \+ 1)?,'started_at',(j\.started_at|NULL),"
                       r"'ended_at',now\(\),'relay',(j\.locked_by|NULL),'outcome',.+?,'error',")
    for name, statement in queries.statements().items():
        text = _normal(statement.text)
        writes = re.search(r"\bhistory =", text) is not None
        assert writes == (name in HISTORY_WRITERS), name
        if writes:
            assert text.count(keep) == 1 and len(entry.findall(text)) == 1, name
    for name in ("job_claim_many", "job_claim_after_many", "job_claim_limited_many"):
        assert "started_at = now()" in queries.statements()[name].text, name
