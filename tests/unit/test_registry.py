"""Subscriber declarations: every bad option is refused when declared, naming the option."""

from __future__ import annotations

import math

import pytest

from outbox import ConfigurationError, Job, Outbox
from outbox.registry import MAX_ATTEMPTS_LIMIT


def handler(job):
    return None


def tx_handler(job, session):
    return None


def test_good_declarations_are_listed_in_order():
    ob = Outbox()

    @ob.subscriber("order.placed", consumer="send_receipt", max_attempts=5)
    def send_receipt(job: Job) -> None: ...

    @ob.subscriber("order.placed", consumer="create_invoice", transactional=True, lease=12, priority=-3)
    def create_invoice(job: Job, session) -> None: ...

    @ob.subscriber("order.cancelled", consumer="notify", lease=0.5, max_attempts=MAX_ATTEMPTS_LIMIT)
    async def notify(job: Job) -> None: ...

    assert ob.consumers == ["send_receipt", "create_invoice", "notify"]
    assert len(ob) == 3
    subs = list(ob)
    assert [(s.topics[0], s.consumer) for s in subs] == [
        ("order.placed", "send_receipt"), ("order.placed", "create_invoice"), ("order.cancelled", "notify")]
    receipt, invoice, notify_ = subs
    assert (receipt.max_attempts, receipt.lease, receipt.transactional, receipt.priority, receipt.is_async) == (
        5, None, False, 0, False)
    assert (invoice.lease, invoice.transactional, invoice.priority) == (12.0, True, -3)
    assert isinstance(invoice.lease, float)
    assert notify_.is_async and notify_.lease == 0.5 and notify_.max_attempts == MAX_ATTEMPTS_LIMIT
    assert ob["create_invoice"].handler is create_invoice


def test_decorator_returns_the_handler_unchanged():
    ob = Outbox()
    assert ob.subscriber("t", consumer="c")(handler) is handler


def test_default_consumer_name_is_module_and_qualname():
    ob = Outbox()

    class Holder:
        @staticmethod
        def method(job): ...

    ob.subscriber("t")(handler)
    ob.subscriber("t")(Holder.method)
    assert ob.consumers == [
        f"{__name__}.handler",
        f"{__name__}.test_default_consumer_name_is_module_and_qualname.<locals>.Holder.method",
    ]


def test_duplicate_consumer_is_refused_even_on_another_topic():
    ob = Outbox()
    ob.subscriber("a", consumer="same")(handler)
    with pytest.raises(ConfigurationError, match="'same' is declared twice"):
        ob.subscriber("b", consumer="same")(handler)
    assert ob.consumers == ["same"]


def test_duplicate_default_name_is_refused():
    ob = Outbox()
    ob.subscriber("a")(handler)
    with pytest.raises(ConfigurationError, match="declared twice"):
        ob.subscriber("b")(handler)


def test_registries_are_independent():
    first, second = Outbox(), Outbox()
    first.subscriber("a", consumer="c")(handler)
    second.subscriber("a", consumer="c")(handler)
    assert first.consumers == second.consumers == ["c"]


@pytest.mark.parametrize("name, problem", [
    ("", "must not be empty"),
    ("   ", "must not be empty"),
    ("x" * 256, "256 characters long"),
    ("a\x00b", "NUL"),
    ("a\ud800b", "surrogate"),
    (42, "must be a str"),
])
def test_bad_consumer_name(name, problem):
    ob = Outbox()
    with pytest.raises(ConfigurationError, match=problem) as info:
        ob.subscriber("t", consumer=name)(handler)
    assert "consumer" in str(info.value)
    assert len(ob) == 0


@pytest.mark.parametrize("topic, problem", [
    ("", "must not be empty"),
    ("\t\n", "must not be empty"),
    ("t" * 256, "256 characters long"),
    ("a\x00", "NUL"),
    (None, "is required"),
])
def test_bad_topic(topic, problem):
    with pytest.raises(ConfigurationError, match=problem) as info:
        Outbox().subscriber(topic, consumer="c")(handler)
    assert "topic" in str(info.value)


def test_longest_names_are_accepted():
    ob = Outbox()
    ob.subscriber("t" * 255, consumer="c" * 255)(handler)
    assert ob.consumers == ["c" * 255]


@pytest.mark.parametrize("value", [0, -1, 1.5, True, False, 10**6, MAX_ATTEMPTS_LIMIT + 1, "3", None, 5.0])
def test_bad_max_attempts(value):
    ob = Outbox()
    with pytest.raises(ConfigurationError, match="max_attempts") as info:
        ob.subscriber("t", consumer="c", max_attempts=value)(handler)
    assert repr(value) in str(info.value)
    assert len(ob) == 0


@pytest.mark.parametrize("value", [0, -1, 0.1, math.nan, math.inf, -math.inf, "3", True, 86_401, [3]])
def test_bad_lease(value):
    with pytest.raises(ConfigurationError, match="lease"):
        Outbox().subscriber("t", consumer="c", lease=value)(handler)


@pytest.mark.parametrize("value", [-32769, 32768, 1.0, "1", True, None])
def test_bad_priority(value):
    with pytest.raises(ConfigurationError, match="priority"):
        Outbox().subscriber("t", consumer="c", priority=value)(handler)


@pytest.mark.parametrize("value", [1, 0, "yes", None])
def test_bad_transactional(value):
    with pytest.raises(ConfigurationError, match="transactional"):
        Outbox().subscriber("t", consumer="c", transactional=value)(tx_handler)


def test_async_transactional_handler_is_accepted():
    async def handle(job, session): ...

    ob = Outbox()
    ob.subscriber("t", consumer="c", transactional=True)(handle)
    assert ob["c"].transactional and ob["c"].is_async


@pytest.mark.parametrize("arity", ["job", "job, session, extra", ""])
def test_async_transactional_handler_must_take_two_positionals(arity):
    namespace: dict = {}
    exec(f"async def handle({arity}): ...", namespace)
    with pytest.raises(ConfigurationError, match=r"must accept \(job, session\)"):
        Outbox().subscriber("t", consumer="c", transactional=True)(namespace["handle"])


def test_handler_must_be_callable():
    with pytest.raises(ConfigurationError, match="callable"):
        Outbox().subscriber("t", consumer="c")("not a function")


@pytest.mark.parametrize("bad", [
    lambda: None,
    lambda job, session: None,
    lambda job, session, extra: None,
    lambda *, job: None,
])
def test_lease_mode_handler_must_take_one_positional(bad):
    with pytest.raises(ConfigurationError, match=r"must accept \(job\)") as info:
        Outbox().subscriber("t", consumer="c")(bad)
    assert "'c'" in str(info.value)


@pytest.mark.parametrize("bad", [
    lambda: None,
    lambda job: None,
    lambda job, session, extra: None,
])
def test_transactional_handler_must_take_two_positionals(bad):
    with pytest.raises(ConfigurationError, match=r"must accept \(job, session\)"):
        Outbox().subscriber("t", consumer="c", transactional=True)(bad)


@pytest.mark.parametrize("fits, transactional", [
    (lambda job, extra=None: None, False),
    (lambda *args: None, False),
    (lambda job, session, *, flag=False: None, True),
    (lambda *args, **kw: None, True),
])
def test_flexible_signatures_fit(fits, transactional):
    ob = Outbox()
    ob.subscriber("t", consumer="c", transactional=transactional)(fits)
    assert ob.consumers == ["c"]


def test_callable_object_is_accepted():
    class Handler:
        def __call__(self, job): ...

    ob = Outbox()
    ob.subscriber("t", consumer="c")(Handler())
    assert not ob["c"].is_async


def test_object_with_async_call_is_async():
    class Handler:
        async def __call__(self, job): ...

    ob = Outbox()
    ob.subscriber("t", consumer="c")(Handler())
    assert ob["c"].is_async
    ob.subscriber("t", consumer="d", transactional=True)(type("H", (), {"__call__": _async_call})())
    assert ob["d"].is_async and ob["d"].transactional


async def _async_call(self, job, session): ...


# ---------------------------------------------------------------- several topics, forwarders

def test_one_consumer_may_take_several_topics():
    ob = Outbox()
    ob.subscriber(["order.placed", "order.paid"], consumer="c", ordered=True)(lambda job: None)
    assert ob["c"].topics == ("order.placed", "order.paid") and ob["c"].ordered


@pytest.mark.parametrize("topics, message", [
    ([], "non-empty list"),
    (["a", "a"], "names a topic twice"),
    (["a", ""], "topic"),
    (["a", 3], "topic"),
])
def test_bad_topic_lists_are_refused(topics, message):
    with pytest.raises(ConfigurationError, match=message):
        Outbox().subscriber(topics, consumer="c")(lambda job: None)


def test_a_forwarder_is_a_consumer_with_a_sink_and_no_handler():
    from outbox import JetStream, RabbitMQ

    ob = Outbox()
    ob.forward(["order.placed", "order.paid"], to=JetStream(subject="orders.{topic}.{key}"), consumer="to_nats",
               ordered=True, max_attempts=7)
    ob.forward("order.placed", to=RabbitMQ(exchange="orders"), consumer="to_rabbit")
    sub = ob["to_nats"]
    assert sub.topics == ("order.placed", "order.paid") and sub.sink is not None and sub.ordered
    assert sub.max_attempts == 7 and sub.timeout == 10.0 and not sub.transactional
    assert ob.consumers == ["to_nats", "to_rabbit"]
    job = Job(1, 1, "to_nats", "order.placed", None, {}, {}, 1, 7, 1, 30.0)
    with pytest.raises(ConfigurationError, match="forwarder"):
        sub.handler(job)  # never called by a relay: its sink sends the job


@pytest.mark.parametrize("build, message", [
    (lambda ob, JetStream: ob.forward("t", to="nats://x", consumer="f"), "must be a Sink"),
    (lambda ob, JetStream: ob.forward("t", to=JetStream(), consumer="f", timeout=None), "timeout"),
    (lambda ob, JetStream: ob.forward("t", to=JetStream(), consumer="f", timeout=0), "timeout"),
    (lambda ob, JetStream: ob.forward("t", to=JetStream(), consumer="f", on_dead="skip"), "needs ordered"),
    (lambda ob, JetStream: ob.forward("t", to=JetStream(subject="x.{nope}"), consumer="f"), "unknown field"),
    (lambda ob, JetStream: (ob.forward("t", to=JetStream(), consumer="f"),
                            ob.forward("u", to=JetStream(), consumer="f")), "declared twice"),
])
def test_bad_forwarder_declarations_fail_at_declaration(build, message):
    from outbox import JetStream

    with pytest.raises(ConfigurationError, match=message):
        build(Outbox(), JetStream)
