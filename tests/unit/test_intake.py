"""The intake's rules without a broker: what a message becomes (identity, topic, key,
headers, rejections), declarations refused with the option named, and Standard Webhooks
signatures against the scheme's published test vector."""

from __future__ import annotations

import base64
import json

import pytest

from outbox import ConfigurationError, Outbox
from outbox.intake import Received, arrival, body_hash
from outbox.intake.webhooks import Refused, Webhook


class Manual(Webhook):
    """A source that is never run: the rules only."""

    def __init__(self) -> None:
        super().__init__("whsec_" + base64.b64encode(b"k" * 24).decode())


def intake(**options: object):  # type: ignore[no-untyped-def]
    ob = Outbox()
    return ob.intake("in", source=Manual(), **options)  # type: ignore[arg-type]


def message(body: bytes = b'{"a": 1}', headers: dict[str, str] | None = None, **kw: object) -> Received:
    return Received(body=body, headers=headers or {}, subject=str(kw.pop("subject", "orders.eu")), **kw)  # type: ignore[arg-type]


def test_the_senders_headers_give_identity_topic_and_key_and_travel_with_the_event() -> None:
    got = arrival(intake(), message(headers={"Outbox-Idempotency-Key": "fwd:7", "Outbox-Topic": "order.placed",
                                             "Outbox-Key": "order:7", "traceparent": "00-" + "1" * 32 + "-" + "2" * 16
                                             + "-01", "Nats-Msg-Id": "fwd:7"}, message_id="fwd:7"))
    assert got.identity == "fwd:7" and got.event is not None and got.problem is None
    assert (got.event.topic, got.event.key) == ("order.placed", "order:7")
    headers = json.loads(got.event.headers)
    assert headers["traceparent"].startswith("00-1111") and "Nats-Msg-Id" not in headers
    assert json.loads(got.event.payload) == {"a": 1}


def test_the_identity_falls_back_to_the_brokers_id_then_refuses() -> None:
    assert arrival(intake(topic="t"), message(message_id="m-1")).identity == "m-1"
    nothing = arrival(intake(topic="t"), message())
    assert nothing.event is None and "no identity" in (nothing.problem or "")
    assert nothing.identity == "unidentified:" + body_hash(message())
    hashed = arrival(intake(topic="t", identity=body_hash), message())
    assert hashed.identity == body_hash(message()) and hashed.event is not None


def test_topic_rules_a_name_a_mapping_a_function() -> None:
    assert arrival(intake(topic="t"), message(message_id="1")).event.topic == "t"  # type: ignore[union-attr]
    mapped = intake(topic={"orders.eu": "order.placed"})
    assert arrival(mapped, message(message_id="1")).event.topic == "order.placed"  # type: ignore[union-attr]
    assert "no topic for subject 'orders.us'" in (arrival(mapped, message(message_id="1", subject="orders.us"))
                                                  .problem or "")
    assert arrival(intake(topic=lambda m: m.subject.upper()), message(message_id="1")).event.topic == "ORDERS.EU"  # type: ignore[union-attr]
    assert "no Outbox-Topic header" in (arrival(intake(), message(message_id="1")).problem or "")


@pytest.mark.parametrize(("body", "problem"), [
    (b"\xff", "not UTF-8 JSON"), (b"{", "not UTF-8 JSON"), (b"NaN", "not UTF-8 JSON"),
    (b'{"a": "\\u0000"}', "not a valid event"), (b'{"a": 1}' + b" " * 2000, "over the intake's max_payload_bytes"),
])
def test_bodies_that_cannot_be_events_are_rejected_with_the_reason(body: bytes, problem: str) -> None:
    got = arrival(intake(topic="t", max_payload_bytes=1000), message(body, message_id="1"))
    assert got.event is None and problem in (got.problem or ""), got.problem


def test_a_failing_user_function_rejects_the_message_naming_it() -> None:
    def broken(m: Received) -> str:
        raise KeyError("tenant")

    got = arrival(intake(topic="t", identity=broken), message())
    assert got.event is None and "identity= raised KeyError" in (got.problem or "")
    assert "RuntimeError: no key" in (arrival(intake(topic="t", key=lambda m: (_ for _ in ()).throw(
        RuntimeError("no key"))), message(message_id="1")).problem or "")


@pytest.mark.parametrize(("options", "named"), [
    ({"topic": ""}, "topic"), ({"topic": {}}, "mapping is empty"), ({"topic": 3}, "topic="),
    ({"identity": "header"}, "identity="), ({"batch": 0}, "batch"), ({"max_backlog": 0}, "max_backlog"),
    ({"max_payload_bytes": 0}, "max_payload_bytes"), ({"batch": 50, "max_backlog": 40}, "at least batch"),
])
def test_bad_declarations_name_the_option(options: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigurationError, match=named):
        intake(**options)


def test_a_name_is_declared_once_and_the_source_must_be_a_source() -> None:
    ob = Outbox()
    ob.intake("in", source=Manual(), topic="t")
    with pytest.raises(ConfigurationError, match="declared twice"):
        ob.intake("in", source=Manual(), topic="t")
    with pytest.raises(ConfigurationError, match="source= must be a Source"):
        ob.intake("other", source="nats://x", topic="t")  # type: ignore[arg-type]


def test_the_webhook_signature_matches_the_schemes_published_test_vector() -> None:
    """The Standard Webhooks specification's example (secret, msg_p5jXN8AQM9LWM0D4loKWxJek,
    1614265330, body ``{"test": 2432232314}``), which every reference library tests."""
    hook = Webhook("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
    body = b'{"test": 2432232314}'
    signature = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
    assert hook.sign("msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body) == signature
    headers = {"webhook-id": "msg_p5jXN8AQM9LWM0D4loKWxJek", "webhook-timestamp": "1614265330",
               "webhook-signature": "v1,bm90IGl0 " + signature}  # any listed signature may match
    assert hook.verify(headers, body, now=1614265330 + 299).message_id == "msg_p5jXN8AQM9LWM0D4loKWxJek"
    with pytest.raises(Refused) as late:
        hook.verify(headers, body, now=1614265330 + 301)
    assert late.value.status == 400
    with pytest.raises(Refused) as tampered:
        hook.verify(headers, body + b" ", now=1614265330)
    assert tampered.value.status == 401
    with pytest.raises(Refused) as v2:
        hook.verify({**headers, "webhook-signature": signature.replace("v1,", "v2,")}, body, now=1614265330)
    assert v2.value.status == 401


@pytest.mark.parametrize(("secret", "named"), [("whsec_not base64!", "not base64"), ("whsec_c2hvcnQ=", "at least 16"),
                                               ([], "non-empty list")])
def test_bad_webhook_secrets_are_refused_without_showing_them(secret: object, named: str) -> None:
    with pytest.raises(ConfigurationError, match=named) as refused:
        Webhook(secret)  # type: ignore[arg-type]
    assert "c2hvcnQ" not in str(refused.value)


@pytest.mark.parametrize(("message", "problem"), [
    (message(b"[" * 5000 + b"]" * 5000, message_id="1"), "not UTF-8 JSON"),  # deeper than the parser goes
    (message(headers={"Outbox-Idempotency-Key": "x" * 10_000}), "identity of 10000 characters"),
    (message(headers={"Outbox-Idempotency-Key": "a\x00b"}), "holds a NUL"),
    (message(headers={"Outbox-Idempotency-Key": "a\udc80b"}), "a lone surrogate"),
])
def test_hostile_messages_are_rejected_never_raise(message: Received, problem: str) -> None:
    got = arrival(intake(topic="t"), message)
    assert got.event is None and problem in (got.problem or ""), got.problem
    assert len(got.identity) <= 600 and "\x00" not in got.identity


def test_a_hostile_exception_message_is_kept_printable() -> None:
    def broken(m: Received) -> str:
        raise ValueError("bad \x00 and \udc80")

    got = arrival(intake(topic="t", identity=broken), message())
    assert got.problem is not None and "\x00" not in got.problem and "\\u0000" in got.problem
    got.problem.encode("utf-8")  # storable
