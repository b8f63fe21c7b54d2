"""Sink options are refused when declared, naming the option: subject templates and the
JetStream sink's settings. No broker needed."""

from __future__ import annotations

import importlib.util
from datetime import UTC, datetime

import pytest

from outbox.errors import ConfigurationError
from outbox.sinks import Message, Template

MSG = Message(job_id=1, event_id=7, consumer="fwd", topic="order.placed", key=None, idempotency_key="fwd:7",
              created_at=datetime(2024, 1, 1, tzinfo=UTC), body=b"{}")


@pytest.mark.parametrize(("text", "words"), [
    ("{topic}.{nope}", "unknown field {nope}"),
    ("{topic!r}", "no conversion or format spec"),
    ("{topic:>10}", "no conversion or format spec"),
    ("{topic.upper}", "unknown field {topic.upper}"),
    ("{topic[0]}", "unknown field {topic[0]}"),
    ("{topic", "does not parse"),
    ("", "non-empty string"),
    (b"{topic}", "non-empty string"),
    (None, "non-empty string"),
])
def test_bad_templates_are_refused_naming_what_is_wrong(text, words):
    with pytest.raises(ConfigurationError, match="subject template") as caught:
        Template(text, "subject")
    assert words in str(caught.value)


def test_a_template_renders_its_fields_and_refuses_a_missing_key():
    t = Template("orders.{topic}.{consumer}", "subject")
    assert t.render(MSG) == "orders.order.placed.fwd" and t.fields == {"topic", "consumer"}
    with pytest.raises(ValueError, match="event 7 has no key"):
        Template("{topic}.{key}", "routing key").render(MSG)


def jetstream():
    pytest.importorskip("nats", reason="nats-py is not installed (pip install 'outbox-relay[nats]')")
    from outbox.sinks.jetstream import JetStream

    return JetStream


@pytest.mark.parametrize(("options", "words"), [
    ({"url": "http://127.0.0.1:4222"}, "url 'http://127.0.0.1:4222' must be nats://"),
    ({"url": "nats://a:4222,redis://b"}, "url 'redis://b' must be nats://"),
    ({"url": "nats://127.0.0.1:99999"}, "does not parse"),
    ({"url": "nats://u:secret@h:x"}, "does not parse"),
    ({"url": "nats://h:4222/path"}, "takes no path"),
    ({"url": ""}, "url must be a nats:// or tls:// URL"),
    ({"url": 4222}, "url must be a nats:// or tls:// URL"),
    ({"subject": "orders.*.{topic}"}, "wildcard"),
    ({"subject": "orders.>"}, "wildcard"),
    ({"subject": "orders {topic}"}, "whitespace"),
    ({"subject": "orders..{topic}"}, "empty token"),
    ({"subject": ".{topic}"}, "empty token"),
    ({"subject": "{topic}.{oops}"}, "unknown field {oops}"),
    ({"stream": "a.b"}, "stream must be None or a stream name"),
    ({"stream": "a b"}, "stream must be None or a stream name"),
    ({"stream": ""}, "stream must be None or a stream name"),
    ({"stream": "x" * 256}, "stream must be None or a stream name"),
    ({"connect_timeout": 0}, "connect_timeout must be seconds"),
    ({"connect_timeout": float("nan")}, "connect_timeout must be seconds"),
    ({"connect_timeout": True}, "connect_timeout must be seconds"),
    ({"max_pending": 0}, "max_pending must be an integer"),
    ({"max_pending": 1.5}, "max_pending must be an integer"),
])
def test_bad_jetstream_options_are_refused_naming_the_option(options, words):
    JetStream = jetstream()
    url = options.pop("url", "nats://127.0.0.1:4222")
    with pytest.raises(ConfigurationError, match="JetStream") as caught:
        JetStream(url, **options)
    assert words in str(caught.value)
    assert "secret" not in str(caught.value)


def test_jetstream_describes_where_it_sends_without_credentials():
    JetStream = jetstream()
    sink = JetStream("nats://user:secret@a.example:4222, tls://[::1]:4443", subject="orders.{topic}", stream="ORDERS")
    assert sink.describe() == "nats://user:***@a.example:4222,tls://[::1]:4443 subject orders.{topic} stream ORDERS"
    assert JetStream("nats://s3cret-token@a.example:4222").describe() == "nats://***@a.example:4222 subject {topic}"
    assert sink.extra == "nats" and not sink.connected


def test_jetstream_without_nats_py_says_what_to_install(monkeypatch):
    JetStream = jetstream()
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "nats" else real(name, *a))
    with pytest.raises(ConfigurationError, match=r"pip install 'outbox-relay\[nats\]'"):
        JetStream()


def test_the_resend_span_is_the_longer_of_a_crash_and_a_lost_acknowledgement():
    from outbox.sinks import resend_span

    crash, why = resend_span(lease=8, reap_interval=2, poll_interval=1, timeout=10, max_attempts=3, backoff_base=1,
                             backoff_cap=3600)
    # a crash: 8 + 2 + 1 = 11; a lost PubAck: 10 + the delay after attempt 2 (2 s, no jitter) = 12
    assert crash == 12.0
    assert "lease 8 s + reap interval 2 s + poll interval 1 s = 11 s" in why
    assert "timeout 10 s + the retry delay after attempt 2 of 3, 2 s = 12 s" in why
    # Many attempts: the last retry's delay, capped (base 1 doubling: 1, 2, 4, ... capped at 60).
    assert resend_span(lease=30, reap_interval=2, poll_interval=1, timeout=10, max_attempts=10, backoff_base=1,
                       backoff_cap=60)[0] == 70.0
    # One attempt only: a failed one is never sent again, so only a crash re-sends.
    assert resend_span(lease=8, reap_interval=2, poll_interval=1, timeout=100, max_attempts=1, backoff_base=1,
                       backoff_cap=60) == (11.0, "after a relay dies, lease 8 s + reap interval 2 s + poll interval "
                                                 "1 s = 11 s")


def kafka():
    if importlib.util.find_spec("confluent_kafka") is None:
        pytest.skip("confluent-kafka is not installed (pip install 'outbox-relay[kafka]')")
    from outbox import Kafka

    return Kafka


@pytest.mark.parametrize(("options", "words"), [
    ({"bootstrap": ""}, "bootstrap entry '' must be host:port"),
    ({"bootstrap": "kafka://a:9092"}, "must be host:port"),
    ({"bootstrap": "a"}, "must be host:port"),
    ({"bootstrap": "a:0"}, "must be host:port"),
    ({"bootstrap": "user:secret@a:9092"}, "no credentials"),
    ({"bootstrap": 9092}, "bootstrap must be 'host:port'"),
    ({"bootstrap": []}, "bootstrap must be 'host:port'"),
    ({"topic": "orders {topic}"}, "topic template"),
    ({"topic": "orders/{topic}"}, "topic template"),
    ({"topic": "{topic}.{oops}"}, "unknown field {oops}"),
    ({"key": "{nope}"}, "unknown field {nope}"),
    ({"connect_timeout": 0}, "connect_timeout must be seconds"),
    ({"connect_timeout": True}, "connect_timeout must be seconds"),
    ({"config": {"acks": "1"}}, "config may not set 'acks'"),
    ({"config": {"enable.idempotence": False}}, "config may not set 'enable.idempotence'"),
    ({"config": {"partitioner": "consistent_random"}}, "config may not set 'partitioner'"),
    ({"config": {"sasl.password": ["secret"]}}, "must be a string, number or boolean, got ***"),
    ({"config": "linger.ms=5"}, "config must be a mapping"),
    ({"config": {"no.such.prop": 1}}, 'librdkafka refuses config: No such configuration property: "no.such.prop"'),
    ({"config": {"linger.ms": "abc"}}, "librdkafka refuses config: Invalid value"),
    ({"config": {"security.protocol": "SASL_SSL", "sasl.mechanism": "PLAIN"}},
     "sasl.username and sasl.password must be set"),
])
def test_bad_kafka_options_are_refused_naming_the_option(options, words):
    Kafka = kafka()
    bootstrap = options.pop("bootstrap", "127.0.0.1:9092")
    with pytest.raises(ConfigurationError, match="Kafka") as caught:
        Kafka(bootstrap, **options)
    assert words in str(caught.value)
    assert "secret" not in str(caught.value)


def test_kafka_describes_where_it_sends_and_takes_tls_and_sasl_properties():
    Kafka = kafka()
    sink = Kafka("a.example:9093, b.example:9093", topic="orders.{topic}",
                 config={"security.protocol": "SASL_SSL", "sasl.mechanism": "PLAIN", "sasl.username": "u",
                         "sasl.password": "secret", "linger.ms": 2})
    assert sink.describe() == "kafka a.example:9093,b.example:9093 topic orders.{topic}"
    assert sink.extra == "kafka" and not sink.connected
    assert sink.config["security.protocol"] == "SASL_SSL"


def test_a_kafka_record_carries_the_payload_key_and_outbox_headers():
    Kafka = kafka()
    created = datetime(2026, 12, 4, 12, 0, 0, 250_000, tzinfo=UTC)
    message = Message(7, 42, "fwd", "order.placed", "order:1", "fwd:42", created, b'{"n": 1}',
                      {"traceparent": "00-ab-cd-01", "outbox-event-id": "forged"})
    topic, key, headers, timestamp = Kafka(topic="shop.{topic}")._record(message)
    assert (topic, key, timestamp) == ("shop.order.placed", b"order:1", 1796385600250)
    assert dict(headers) == {"traceparent": b"00-ab-cd-01", "Outbox-Event-Id": b"42", "Outbox-Topic": b"order.placed",
                             "Outbox-Idempotency-Key": b"fwd:42", "Outbox-Key": b"order:1",
                             "Outbox-Created-At": b"2026-12-04T12:00:00.250000+00:00"}
    keyless = Message(8, 43, "fwd", "order.placed", None, "fwd:43", created, b"{}")
    assert Kafka()._record(keyless)[1] is None  # no key: the partitioner spreads it
    assert Kafka(key=None)._record(message)[1] is None
    with pytest.raises(ValueError, match="is not a Kafka topic name"):
        Kafka(topic="{key}")._record(message)  # "order:1" holds a ':'
