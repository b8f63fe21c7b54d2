"""Typed events on a real PostgreSQL and a real relay: pydantic models published (with the
topic given or taken from the model, one by one and in batches, datetimes, decimals, UUIDs
and enums dumped in JSON mode), a model that no longer validates refused before anything is
written; subscribers that declare the payload's model (``payload=`` or ``Job[Model]``), in
lease and transactional mode, sync and async, get instances; a payload that does not
validate is dead at once with the validation error, never retried; plain dicts keep working."""

from __future__ import annotations

import contextlib
import enum
import io
import uuid
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, ClassVar

import pytest
import sqlalchemy as sa
from pydantic import BaseModel, Field
from sqlalchemy.orm import Session

from outbox import Job, Outbox, publish, publish_many
from outbox.errors import ConfigurationError, InvalidEventError
from outbox.ops.cli import main
from outbox.relay.relay import Relay
from outbox.testing import wait_for

TIMEOUT = 20


class Colour(enum.Enum):
    RED = "red"


class OrderPlaced(BaseModel):
    __topic__: ClassVar[str] = "order.placed"
    order_id: int
    total: Decimal
    at: datetime
    ref: uuid.UUID
    colour: Colour = Colour.RED


class Untopical(BaseModel):
    n: int


def order(n: int) -> OrderPlaced:
    return OrderPlaced(order_id=n, total=Decimal("12.50"), at=datetime(2026, 12, 4, 9, tzinfo=UTC),
                       ref=uuid.UUID(int=n))


def payloads(engine: sa.Engine, topic: str) -> list[Any]:
    with engine.connect() as c:
        return list(c.execute(sa.text("SELECT payload FROM outbox_events WHERE topic = :t ORDER BY id"),
                              {"t": topic}).scalars())


def test_models_are_published_as_json(engine):
    with Session(engine) as s, s.begin():
        publish(s, order(1), key="order:1")                       # the topic from the model
        publish(s, "order.placed", order(2))                       # given
        publish_many(s, [order(3), ("order.placed", order(4), "order:4"),
                         {"topic": "order.placed", "payload": order(5), "dedup_key": "o5"},
                         ("order.placed", {"order_id": 6})])       # plain dicts keep working
    stored = payloads(engine, "order.placed")
    assert [p["order_id"] for p in stored] == [1, 2, 3, 4, 5, 6]
    assert stored[0] == {"order_id": 1, "total": "12.50", "at": "2026-12-04T09:00:00Z",
                         "ref": "00000000-0000-0000-0000-000000000001", "colour": "red"}


@pytest.mark.parametrize("call, field, problem", [
    (lambda s: publish(s, Untopical(n=1)), "topic", "Untopical declares no __topic__"),
    (lambda s: publish(s, order(1), {"x": 1}), "payload", "is given beside a OrderPlaced"),
    (lambda s: publish(s, "order.placed"), "payload", "is missing"),
    (lambda s: publish_many(s, [order(1), Untopical(n=2)]), "events[1].topic", "Untopical declares no __topic__"),
])
def test_model_calls_that_name_no_topic_or_two_payloads_are_refused(engine, call, field, problem):
    with Session(engine) as s, s.begin():
        with pytest.raises(InvalidEventError) as info:
            call(s)
        assert info.value.field == field and problem in info.value.problem, info.value
        publish(s, "after", {})  # the transaction is still usable
    assert payloads(engine, "order.placed") == []


@pytest.mark.filterwarnings("ignore:Pydantic serializer warnings")  # the broken field, as pydantic dumps it
def test_a_model_that_no_longer_validates_is_refused(engine):
    broken = order(1)
    broken.order_id = "not a number"  # type: ignore[assignment]  # no validate_assignment: pydantic lets it
    with Session(engine) as s, s.begin():
        with pytest.raises(InvalidEventError, match="payload: does not validate as OrderPlaced once dumped"):
            publish(s, broken)
    assert payloads(engine, "order.placed") == []


def test_subscribers_get_their_model_and_a_bad_payload_is_dead_at_once(engine, settings):
    ob = Outbox()
    seen: dict[str, list[Any]] = {"kw": [], "annotated": [], "async": [], "tx": [], "plain": []}

    @ob.subscriber("order.placed", consumer="kw", payload=OrderPlaced)
    def by_keyword(job: Job[OrderPlaced]) -> None:
        seen["kw"].append(job.payload)

    @ob.subscriber("order.placed", consumer="annotated")
    def by_annotation(job: Job[OrderPlaced]) -> None:
        seen["annotated"].append(job.payload)

    @ob.subscriber("order.placed", consumer="async_typed")
    async def asynchronous(job: Job[OrderPlaced]) -> None:
        seen["async"].append(job.payload)

    @ob.subscriber("order.placed", consumer="tx", transactional=True, payload=OrderPlaced)
    def transactional(job: Job[OrderPlaced], session: Session) -> None:
        seen["tx"].append(job.payload)

    @ob.subscriber("order.placed", consumer="plain")
    def plain(job: Job) -> None:
        seen["plain"].append(job.payload)

    relay = Relay(ob, settings())
    relay.start()
    try:
        with Session(engine) as s, s.begin():
            good = publish(s, order(7), key="order:7")
            bad = publish(s, "order.placed", {"order_id": "seven"})  # a publisher without the model
        wait_for(lambda: [len(v) for v in seen.values()] == [1, 1, 1, 1, 2] and _statuses(engine, bad) == {
            "kw": "dead", "annotated": "dead", "async_typed": "dead", "tx": "dead", "plain": "done"},
            timeout=TIMEOUT, what="the good event handled by all, the bad one dead for the typed consumers")
    finally:
        relay.stop()
    for consumer in ("kw", "annotated", "async", "tx"):
        assert seen[consumer] == [order(7)] and isinstance(seen[consumer][0], OrderPlaced), consumer
    by_id = {str(p["order_id"]): p for p in seen["plain"]}  # plain dicts, as published
    assert by_id == {"7": order(7).model_dump(mode="json"), "seven": {"order_id": "seven"}}
    with engine.connect() as c:
        rows = c.execute(sa.text("SELECT consumer, attempts, last_error FROM outbox_jobs WHERE event_id = :e "
                                 "AND status = 'dead'"), {"e": bad}).all()
    assert len(rows) == 4
    for consumer, attempts, last_error in rows:
        assert attempts == 1, consumer  # never retried
        assert "does not validate as OrderPlaced" in last_error and "order_id" in last_error, last_error
    assert _statuses(engine, good) == dict.fromkeys(("kw", "annotated", "async_typed", "tx", "plain"), "done")
    # `dead` shows the validation error's lines under the job, not its first line alone.
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["dead", "--consumer", "kw", "--database-url", engine.url.render_as_string(hide_password=False)]) \
            == 0
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("job ") and "does not validate as OrderPlaced" in lines[0], lines
    assert any(line.startswith("    order_id") for line in lines[1:]), lines
    assert not any("Traceback" in line for line in lines), lines


def _statuses(engine: sa.Engine, event_id: int) -> dict[str, str]:
    with engine.connect() as c:
        return dict(c.execute(sa.text("SELECT consumer, status FROM outbox_jobs WHERE event_id = :e"),
                              {"e": event_id}).all())


class Aliased(BaseModel):
    __topic__: ClassVar[str] = "aliased"
    order_id: int = Field(alias="orderId")


def test_a_model_with_aliases_is_stored_by_alias(engine):
    """An alias is the field's name in JSON and what validation reads: the dump uses it."""
    with Session(engine) as s, s.begin():
        publish(s, Aliased(orderId=3))
    assert payloads(engine, "aliased") == [{"orderId": 3}]


def test_payload_declarations_are_checked():
    ob = Outbox()
    with pytest.raises(ConfigurationError, match="payload= must be a pydantic model class"):
        ob.subscriber("t", consumer="a", payload=dict)(lambda job: None)  # type: ignore[arg-type]

    with pytest.raises(ConfigurationError, match="payload=Untopical but the handler's job is annotated"):
        @ob.subscriber("t", consumer="b", payload=Untopical)
        def mixed(job: Job[OrderPlaced]) -> None: ...

    with pytest.raises(ConfigurationError, match="a payload model is one pydantic model class"):
        @ob.subscriber("t", consumer="c")
        def optional(job: Job[OrderPlaced | None]) -> None: ...

    def local_model() -> None:
        class Local(BaseModel):
            n: int

        @ob.subscriber("t", consumer="d")
        def local(job: Job[Local]) -> None: ...  # a string under the module's future import

    with pytest.raises(ConfigurationError, match="annotation 'Job\\[Local\\]' does not resolve"):
        local_model()
    assert "c" not in ob.consumers and "d" not in ob.consumers
