"""Typing of the public API: ``mypy --strict`` passes on a small application that uses it as
the README does (publish, lease-mode and transactional subscribers, fenced_write with a
Table and an ORM class, Job's fields), and reports the mistakes a type checker should catch
there (a decorated handler called with the wrong arguments, a Job field used as the wrong
type, a transactional handler without its session, a typed payload's field misused), so the decorators keep the handler's
own type instead of ``Callable[..., Any]``; and a misspelt name of a statement in the
statements' registry (``queries.in_schema().job_claim_mnay``) fails the check too."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import outbox

pytest.importorskip("mypy")

SOURCE_ROOT = Path(outbox.__file__).resolve().parents[1]  # the folder that holds the outbox package

APP = textwrap.dedent('''
    from __future__ import annotations

    from typing import Any, ClassVar

    import sqlalchemy as sa
    from pydantic import BaseModel
    from sqlalchemy.ext.asyncio import AsyncSession
    from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

    from outbox import Job, Outbox, PermanentError, fenced_write, publish, publish_many

    ob = Outbox()
    md = sa.MetaData()
    invoices = sa.Table("invoices", md, sa.Column("order_id", sa.Integer, primary_key=True),
                        sa.Column("amount", sa.Integer), sa.Column("fence", sa.BigInteger))


    class Base(DeclarativeBase):
        pass


    class Invoice(Base):
        __tablename__ = "orm_invoices"
        order_id: Mapped[int] = mapped_column(primary_key=True)
        amount: Mapped[int]
        fence: Mapped[int] = mapped_column(sa.BigInteger)


    @ob.subscriber("order.placed", consumer="send_receipt", max_attempts=5, lease=30.0, priority=-1)
    def send_receipt(job: Job) -> None:
        idempotency_key: str = job.idempotency_key
        attempt: int = job.attempt + job.max_attempts + job.id + job.event_id
        names: str = job.consumer + job.topic
        key: str | None = job.key
        headers: dict[str, Any] = job.headers
        order_id: int = job.payload["order_id"]
        lease: float = job.lease_seconds
        job.check_lease()
        if job.lease_lost or job.wait_lease_lost(0.5):
            raise PermanentError(f"{idempotency_key} {attempt} {names} {key} {headers} {order_id} {lease}")


    class OrderPlaced(BaseModel):
        __topic__: ClassVar[str] = "order.placed"
        order_id: int


    @ob.subscriber("order.placed", consumer="typed")
    def typed(job: Job[OrderPlaced]) -> None:
        order_id: int = job.payload.order_id
        print(order_id)


    @ob.subscriber("order.placed", consumer="typed_tx", transactional=True, payload=OrderPlaced)
    def typed_tx(job: Job[OrderPlaced], session: Session) -> None:
        print(job.payload.order_id + job.fence)


    def publish_typed(s: Session) -> None:
        first: int = publish(s, OrderPlaced(order_id=1), key="order:1")
        second: int = publish(s, "order.placed", OrderPlaced(order_id=2))
        ids: list[int] = publish_many(s, [OrderPlaced(order_id=3), ("order.placed", OrderPlaced(order_id=4))])
        assert first not in ids and second not in ids


    @ob.subscriber("order.placed", consumer="notify")
    async def notify(job: Job) -> None:
        print(job.fence)


    @ob.subscriber("order.placed", consumer="create_invoice", transactional=True)
    def create_invoice(job: Job, session: Session) -> None:
        key = {"order_id": job.payload["order_id"]}
        written: bool = fenced_write(session, invoices, key=key, values={"amount": 1}, fence=job.fence)
        written = written and fenced_write(session, Invoice, key=key, values={"amount": 1}, fence=job.fence)
        written = written and fenced_write(session, Invoice.__table__, key=key, values={"amount": 1},
                                           fence=job.fence, raise_on_stale=True)


    def place_order(engine: sa.Engine, job: Job) -> None:
        with Session(engine) as s, s.begin():
            event_id: int = publish(s, "order.placed", {"order_id": 4}, key="order:4", headers={"trace": "x"},
                                    delay=1.5, dedup_key="order:4", priority=-1)
            ids: list[int] = publish_many(s, [("order.placed", {"order_id": 5}),
                                              {"topic": "order.placed", "payload": {}, "delay": 2}])
            assert event_id not in ids
        send_receipt(job)  # the decorated functions keep their own signatures
        with Session(engine) as s, s.begin():
            create_invoice(job, s)


    async def place_order_async(session: AsyncSession, job: Job) -> None:
        event_id: int = await publish(session, "order.placed", {"order_id": 6})
        ids: list[int] = await publish_many(session, [("order.placed", {"order_id": event_id})])
        assert ids
        await notify(job)
''')

#: (code appended to APP, the mypy error code it must draw, words of the message)
MISTAKES = [
    ("send_receipt(1)", "arg-type", 'Argument 1 to "send_receipt" has incompatible type "int"; expected "Job[Any]"'),
    ("create_invoice(Job(1, 1, 'c', 't', None, {}, {}, 1, 5, 1, 30.0))", "call-arg",
     'Missing positional argument "session" in call to "create_invoice"'),
    ("def f(job: Job) -> int:\n    return job.key", "return-value", 'got "str | None", expected "int"'),
    ("def g(job: Job) -> str:\n    return job.fence.upper()", "attr-defined", '"int" has no attribute "upper"'),
    ("n: int = send_receipt(Job(1, 1, 'c', 't', None, {}, {}, 1, 5, 1, 30.0))", "assignment",
     'expression has type "None", variable has type "int"'),
    ("Job(1, 1, 'c', 't', None, {}, {}, 1, 5, 1, 30.0, _lost=True)", "call-arg", 'Unexpected keyword argument "_lost"'),
    ("def h(s: Session) -> str:\n    return publish(s, 't', {})", "return-value", 'got "int", expected "str"'),
    ("async def k(s: AsyncSession) -> int:\n    return publish(s, 't', {})", "return-value",
     'got "Coroutine[Any, Any, int]", expected "int"'),
    ("@ob.subscriber('t', consumer='tx', transactional=True)\ndef tx(job: Job) -> None: ...", "type-var",
     'Value of type variable "TransactionalHandlerT"'),
    ("def m(job: Job[OrderPlaced]) -> str:\n    return job.payload.order_id", "return-value",
     'got "int", expected "str"'),
    ("def p(job: Job[OrderPlaced]) -> None:\n    print(job.payload.customer)", "attr-defined",
     '"OrderPlaced" has no attribute "customer"'),
]


@pytest.fixture
def mypy_cache(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """mypy's cache folder: in pytest's cache (.pytest_cache), so a later run checks only what
    changed (seconds instead of the half minute a cold check of SQLAlchemy's stubs takes);
    a folder of this run's own when the cache plugin is off (``-p no:cacheprovider``)."""
    cache = getattr(request.config, "cache", None)
    return cache.mkdir("mypy") if cache is not None else tmp_path_factory.mktemp("mypy-cache")


def _mypy(tmp_path: Path, cache: Path, source: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "app.py").write_text(source)
    env = {**os.environ, "MYPYPATH": str(SOURCE_ROOT)}
    # cwd: tmp_path, so no configuration file of the repository applies.
    return subprocess.run([sys.executable, "-m", "mypy", "--strict", "--no-error-summary", "--show-error-codes",
                           "--cache-dir", str(cache), "app.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


def test_mypy_strict_passes_on_an_app_using_the_public_api(tmp_path, mypy_cache):
    result = _mypy(tmp_path, mypy_cache, APP)
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_reports_each_mistake_in_the_app(tmp_path, mypy_cache):
    lines = APP.count("\n") + 1
    source = APP + "\n\n" + "\n\n".join(code for code, _, _ in MISTAKES) + "\n"
    result = _mypy(tmp_path, mypy_cache, source)
    assert result.returncode == 1, result.stdout + result.stderr
    errors = [line for line in result.stdout.splitlines() if ": error: " in line]
    assert all(int(re.match(r"app\.py:(\d+):", line)[1]) > lines for line in errors), errors  # the app is clean
    for code, error_code, words in MISTAKES:
        assert any(f"[{error_code}]" in line and words in line for line in errors), (code, errors)


STATEMENTS_APP = textwrap.dedent('''
    from __future__ import annotations

    from sqlalchemy import TextClause

    from outbox.db import queries

    statements = queries.in_schema("tenant_a")
    claim: TextClause = statements.job_claim_many
    create: TextClause = statements.schema_create
    schema: str = statements.schema
    misspelt = statements.job_claim_mnay
''')


def test_mypy_rejects_a_misspelt_statement_name(tmp_path, mypy_cache):
    result = _mypy(tmp_path, mypy_cache, STATEMENTS_APP)
    errors = [line for line in result.stdout.splitlines() if ": error: " in line]
    assert len(errors) == 1, result.stdout + result.stderr
    line = STATEMENTS_APP.splitlines().index("misspelt = statements.job_claim_mnay") + 1
    assert errors[0].startswith(f"app.py:{line}:"), errors
    assert '"Statements" has no attribute "job_claim_mnay"' in errors[0] and "[attr-defined]" in errors[0], errors
