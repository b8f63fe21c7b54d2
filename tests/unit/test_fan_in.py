"""Fan-in declarations (``Outbox.after``): what a good one records, and every bad one refused
with ConfigurationError naming the problem, at declaration when the listed consumer is known
then, else when the relay starts (``Outbox.check_fan_ins``). No database needed."""

from __future__ import annotations

import pytest

from outbox import ConfigurationError, Outbox
from outbox.fan_in import MAX_LISTED, FanIn


def handler(job):
    return None


def registry(*consumers: str, topic: str = "order.placed") -> Outbox:
    ob = Outbox()
    for consumer in consumers:
        ob.subscriber(topic, consumer=consumer)(handler)
    return ob


def test_a_fan_in_is_recorded_and_marks_its_consumers():
    ob = registry("send_receipt", "create_invoice", "sync_crm")
    declared = ob.after("order.placed", consumers=["send_receipt", "create_invoice"], publish="order.fulfilled")
    assert declared == FanIn("order.fulfilled", "order.placed", ("send_receipt", "create_invoice"), "order.fulfilled")
    assert ob.fan_ins == [declared]
    assert ob.fanned_in("order.placed", "send_receipt") and ob.fanned_in("order.placed", "create_invoice")
    assert not ob.fanned_in("order.placed", "sync_crm")
    assert not ob.fanned_in("order.fulfilled", "send_receipt")
    named = ob.after("order.placed", consumers=["sync_crm"], publish="order.fulfilled", name="crm done")
    assert named.name == "crm done" and ob.fan_ins == [declared, named]
    ob.check_fan_ins()


def test_a_consumer_may_be_declared_after_the_fan_in_that_lists_it():
    ob = Outbox()
    ob.after("order.placed", consumers=["later"], publish="order.fulfilled")
    with pytest.raises(ConfigurationError, match="lists consumer 'later', which the registry does not declare"):
        ob.check_fan_ins()
    ob.subscriber(["order.placed", "order.changed"], consumer="later")(handler)
    ob.check_fan_ins()
    assert ob.fanned_in("order.placed", "later") and not ob.fanned_in("order.changed", "later")


@pytest.mark.parametrize(("kwargs", "problem"), [
    ({"topic": ""}, "topic"),
    ({"topic": 7}, "topic"),
    ({"publish": " "}, "publish"),
    ({"publish": "order.placed"}, "publish must be another topic than 'order.placed'"),
    ({"name": ""}, "name"),
    ({"consumers": []}, "consumers must be a non-empty list"),
    ({"consumers": "a"}, "consumers must be a non-empty list"),
    ({"consumers": None}, "consumers must be a non-empty list"),
    ({"consumers": ["a", "a"]}, "lists a consumer twice"),
    ({"consumers": ["a", 3]}, "consumers"),
    ({"consumers": [f"c{i}" for i in range(MAX_LISTED + 1)]}, f"at most {MAX_LISTED}"),
])
def test_bad_arguments_are_refused_naming_them(kwargs, problem):
    args = {"topic": "order.placed", "consumers": ["a"], "publish": "order.fulfilled", **kwargs}
    ob = registry("a")
    with pytest.raises(ConfigurationError, match="fan-in") as raised:
        ob.after(args.pop("topic"), **args)
    assert problem in str(raised.value)
    assert ob.fan_ins == [] and not ob.fanned_in("order.placed", "a")


def test_a_name_declared_twice_is_refused():
    ob = registry("a", "b")
    ob.after("order.placed", consumers=["a"], publish="order.fulfilled")
    with pytest.raises(ConfigurationError, match="'order.fulfilled' is declared twice; pass name="):
        ob.after("order.placed", consumers=["b"], publish="order.fulfilled")
    assert not ob.fanned_in("order.placed", "b")


def test_a_listed_consumer_of_another_topic_is_refused_whichever_comes_first():
    ob = registry("a", topic="order.changed")
    with pytest.raises(ConfigurationError, match="'a', which does not subscribe to 'order.placed'"):
        ob.after("order.placed", consumers=["a"], publish="order.fulfilled")
    ob = Outbox()
    ob.after("order.placed", consumers=["b"], publish="order.fulfilled")
    with pytest.raises(ConfigurationError, match="'b', which does not subscribe to 'order.placed'"):
        ob.subscriber("order.changed", consumer="b")(handler)
    assert ob.consumers == []


def test_a_coalescing_consumer_cannot_be_listed_whichever_comes_first():
    ob = Outbox()
    ob.subscriber("order.placed", consumer="index", coalesce=True)(handler)
    with pytest.raises(ConfigurationError, match="'index', which coalesces: its jobs may end superseded"):
        ob.after("order.placed", consumers=["index"], publish="order.indexed")
    ob = Outbox()
    ob.after("order.placed", consumers=["index"], publish="order.indexed")
    with pytest.raises(ConfigurationError, match="which coalesces"):
        ob.subscriber("order.placed", consumer="index", coalesce=True)(handler)


def test_a_forwarder_may_be_listed():
    from outbox import JetStream

    ob = Outbox()
    ob.forward("order.placed", to=JetStream("nats://127.0.0.1:4222", subject="orders.{topic}"), consumer="to_nats")
    ob.after("order.placed", consumers=["to_nats"], publish="order.forwarded")
    ob.check_fan_ins()


def test_a_loop_of_fan_ins_is_refused():
    ob = Outbox()
    for topic, consumer in (("a", "on_a"), ("b", "on_b"), ("c", "on_c")):
        ob.subscriber(topic, consumer=consumer)(handler)
    ob.after("a", consumers=["on_a"], publish="b")
    ob.after("b", consumers=["on_b"], publish="c")
    with pytest.raises(ConfigurationError, match=r"closes a loop of fan-ins \(c -> a -> b -> c\)"):
        ob.after("c", consumers=["on_c"], publish="a")
    ob.after("c", consumers=["on_c"], publish="d")  # a chain is fine
    ob.after("a", consumers=["on_a"], publish="c", name="a to c")  # so is a diamond
    assert [f.name for f in ob.fan_ins] == ["b", "c", "d", "a to c"]


def test_the_batch_completion_takes_the_locks_the_trigger_takes():
    """``job_complete_many`` takes the events' fan-in locks before its triggers run (no
    deadlock between batches): the same lock, by the same expressions, as the function."""
    from outbox.db import queries
    from outbox.db.fan_in import FAN_IN_DDL, FAN_IN_LOCK_CLASS, FAN_IN_LOCK_KEY

    text = queries.job_complete_many.text
    assert f"pg_advisory_xact_lock({FAN_IN_LOCK_CLASS}, f.lock_key)" in text
    assert f"SELECT DISTINCT {FAN_IN_LOCK_KEY.format(event_id='c.event_id')} AS lock_key" in text
    assert f"PERFORM pg_advisory_xact_lock({FAN_IN_LOCK_CLASS}, {FAN_IN_LOCK_KEY.format(event_id='event.id')});" \
        in FAN_IN_DDL[1]
    assert "%" not in text, "a statement without % runs unchanged through psycopg's own placeholders"
