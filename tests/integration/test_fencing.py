"""fenced_write: a downstream row keeps the fence of its last writer and accepts only
higher fences, so a worker paused past its lease cannot overwrite the one that took over
(seed article 000, "Fencing tokens")."""

from __future__ import annotations

import logging

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from outbox import ConfigurationError, StaleFenceError, fenced_write
from outbox.db.jobs import claim_jobs, complete_jobs
from outbox.relay.maintenance import reap_expired

from .helpers import expire_lease, job_row, routed_jobs

md = sa.MetaData()
invoices = sa.Table(
    "invoices", md,
    sa.Column("order_id", sa.Integer, primary_key=True),
    sa.Column("amount", sa.Integer, nullable=False),
    sa.Column("note", sa.Text),
    sa.Column("fence", sa.BigInteger, nullable=False),
)
ledger = sa.Table(  # a composite unique key, not the primary key
    "ledger", md,
    sa.Column("id", sa.Integer, sa.Identity(), primary_key=True),
    sa.Column("account", sa.Text, nullable=False),
    sa.Column("day", sa.Integer, nullable=False),
    sa.Column("total", sa.Integer, nullable=False),
    sa.Column("fence", sa.BigInteger, nullable=False),
    sa.UniqueConstraint("account", "day"),
)
unfenced = sa.Table("unfenced", md, sa.Column("k", sa.Integer, primary_key=True), sa.Column("v", sa.Integer))


@pytest.fixture
def tables(engine):
    md.create_all(engine)


def _invoice(engine: sa.Engine, order_id: int = 1):
    with engine.connect() as c:
        row = c.execute(sa.select(invoices).where(invoices.c.order_id == order_id)).mappings().first()
    return dict(row) if row else None


def _write(engine: sa.Engine, fence: int, amount: int, **kw) -> bool:
    with Session(engine) as s, s.begin():
        return fenced_write(s, invoices, key={"order_id": 1}, values={"amount": amount}, fence=fence, **kw)


def test_insert_then_update_only_with_a_higher_fence(engine, tables, caplog):
    caplog.set_level(logging.INFO)
    assert _write(engine, 10, 100) is True
    assert _invoice(engine) == {"order_id": 1, "amount": 100, "note": None, "fence": 10}
    assert _write(engine, 11, 110) is True
    assert _invoice(engine)["amount"] == 110 and _invoice(engine)["fence"] == 11

    assert _write(engine, 11, 999) is False  # equal fence: refused
    assert _write(engine, 3, 999) is False   # lower fence: refused
    assert _invoice(engine) == {"order_id": 1, "amount": 110, "note": None, "fence": 11}
    assert sum("stale write rejected" in r.getMessage() for r in caplog.records) == 2

    with pytest.raises(StaleFenceError):
        _write(engine, 11, 999, raise_on_stale=True)
    assert _invoice(engine)["amount"] == 110
    assert _write(engine, 12, 120, raise_on_stale=True) is True
    assert _invoice(engine)["fence"] == 12


def test_works_with_a_core_connection_and_a_composite_unique_key(engine, tables):
    key = {"account": "acme", "day": 3}
    with engine.begin() as conn:
        assert fenced_write(conn, ledger, key=key, values={"total": 5}, fence=7) is True
        assert fenced_write(conn, ledger, key=key, values={"total": 6}, fence=7) is False
        assert fenced_write(conn, ledger, key={"account": "acme", "day": 4}, values={"total": 1}, fence=2) is True
        assert fenced_write(conn, ledger, key=key, values={"total": 9}, fence=8) is True
    with engine.connect() as c:
        rows = c.execute(sa.text("SELECT account, day, total, fence FROM ledger ORDER BY day")).all()
    assert [tuple(r) for r in rows] == [("acme", 3, 9, 8), ("acme", 4, 1, 2)]


def test_paused_worker_is_refused_after_another_worker_reclaimed_the_job(engine, tables):
    [job_id] = routed_jobs(engine, "order.placed", ["create_invoice"], n=1, max_attempts=3)
    leases = {"create_invoice": 30.0}

    with engine.begin() as conn:
        [a] = claim_jobs(conn, leases, 1, "worker-a")
    # Worker A pauses (GC, SIGSTOP, VM migration) past its lease; the reaper takes the job
    # back and worker B claims it.
    with engine.begin() as conn:
        expire_lease(conn, job_id)
        assert reap_expired(conn).retried == 1
    with engine.begin() as conn:
        [b] = claim_jobs(conn, leases, 1, "worker-b")
    assert b.id == a.id and b.fence > a.fence

    with Session(engine) as s, s.begin():
        assert fenced_write(s, invoices, key={"order_id": 1}, values={"amount": 200, "note": "B"}, fence=b.fence)
    with engine.begin() as conn:
        assert complete_jobs(conn, [b]) == {job_id}
    invoice = _invoice(engine)
    job = job_row(engine, job_id)
    assert invoice == {"order_id": 1, "amount": 200, "note": "B", "fence": b.fence}
    assert (job["status"], job["fence"], job["locked_by"]) == ("done", b.fence, "worker-b")

    # A wakes up, unaware time passed, and writes its result.
    with Session(engine) as s, s.begin():
        assert fenced_write(s, invoices, key={"order_id": 1}, values={"amount": 100, "note": "A"}, fence=a.fence) is False
    with engine.begin() as conn:
        assert complete_jobs(conn, [a]) == set()
    assert _invoice(engine) == invoice
    assert job_row(engine, job_id) == job

    with pytest.raises(StaleFenceError), Session(engine) as s, s.begin():
        fenced_write(s, invoices, key={"order_id": 1}, values={"amount": 100}, fence=a.fence, raise_on_stale=True)
    assert _invoice(engine) == invoice


@pytest.mark.parametrize("table, key, values, fence, words", [
    (invoices, {"order_id": 1}, {"amount": 1}, 0, "fence"),
    (invoices, {"order_id": 1}, {"amount": 1}, -5, "fence"),
    (invoices, {"order_id": 1}, {"amount": 1}, True, "fence"),
    (invoices, {"order_id": 1}, {"amount": 1}, "7", "fence"),
    (invoices, {"order_id": 1}, {"amount": 1}, 1.0, "fence"),
    (invoices, {"order_id": 1}, {"amount": 1}, None, "fence"),
    (invoices, {}, {"amount": 1}, 1, "key"),
    (invoices, {"order_id": 1}, {"nope": 1}, 1, "nope"),
    (invoices, {"nope": 1}, {"amount": 1}, 1, "nope"),
    (invoices, {"order_id": 1}, {"amount": 1, "fence": 9}, 1, "fence"),
    (invoices, {"order_id": 1, "fence": 9}, {"amount": 1}, 1, "fence"),
    (unfenced, {"k": 1}, {"v": 1}, 1, "fence"),
    (invoices, {"amount": 1}, {"note": "x"}, 1, "unique"),
    (ledger, {"account": "acme"}, {"day": 1, "total": 1}, 1, "unique"),
    (ledger, {"account": "acme", "day": 1, "total": 1}, {}, 1, "unique"),
], ids=["zero", "negative", "bool", "str", "float", "none", "empty-key", "unknown-value",
        "unknown-key", "fence-in-values", "fence-in-key", "no-fence-column", "not-a-key",
        "part-of-a-key", "more-than-a-key"])
def test_bad_arguments_raise_configuration_error_before_writing(engine, tables, table, key, values, fence, words):
    with Session(engine) as s, s.begin():
        with pytest.raises(ConfigurationError, match=words):
            fenced_write(s, table, key=key, values=values, fence=fence)
        s.execute(sa.text("SELECT 1"))  # the transaction is still usable
    assert _invoice(engine) is None


class Base(DeclarativeBase):
    pass


class Invoice(Base):
    """A declarative mapped class whose attribute names are its column names."""

    __tablename__ = "orm_invoices"
    order_id: Mapped[int] = mapped_column(primary_key=True)
    amount: Mapped[int]
    fence: Mapped[int] = mapped_column(sa.BigInteger)


class Unmapped:
    __tablename__ = "orm_invoices"


def _orm_invoice(engine: sa.Engine) -> tuple[int, int] | None:
    with Session(engine) as s:
        row = s.get(Invoice, 1)
        return (row.amount, row.fence) if row else None


@pytest.mark.parametrize("target", [Invoice, Invoice.__table__], ids=["mapped-class", "__table__"])
def test_a_mapped_class_or_its_table_is_fenced_like_a_table(engine, target):
    Base.metadata.create_all(engine)

    def write(fence: int, amount: int) -> bool:
        with Session(engine) as s, s.begin():
            return fenced_write(s, target, key={"order_id": 1}, values={"amount": amount}, fence=fence)

    assert write(5, 50) is True
    assert _orm_invoice(engine) == (50, 5)
    assert write(4, 999) is False  # stale: an older claim
    assert write(5, 999) is False  # equal: refused too
    assert _orm_invoice(engine) == (50, 5)
    assert write(6, 60) is True    # fresh
    assert _orm_invoice(engine) == (60, 6)
    with Session(engine) as s, s.begin(), pytest.raises(StaleFenceError):
        fenced_write(s, Invoice, key={"order_id": 1}, values={"amount": 1}, fence=6, raise_on_stale=True)


@pytest.mark.parametrize("target, words", [
    ("orm_invoices", "got str 'orm_invoices'"),
    (Unmapped, "got class Unmapped"),
    (Invoice(order_id=1, amount=1, fence=1), "got Invoice"),
    (sa.select(invoices), "got Select"),
    (None, "got NoneType"),
], ids=["str", "unmapped-class", "orm-instance", "select", "none"])
def test_anything_but_a_table_or_mapped_class_is_a_configuration_error(engine, tables, target, words):
    with Session(engine) as s, s.begin():
        with pytest.raises(ConfigurationError, match=f"Table, an ORM mapped class or its __table__, {words}"):
            fenced_write(s, target, key={"order_id": 1}, values={"amount": 1}, fence=1)
        s.execute(sa.text("SELECT 1"))  # nothing was sent; the transaction is still usable
