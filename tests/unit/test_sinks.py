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
    assert sink.describe() == "nats://a.example:4222,tls://[::1]:4443 subject orders.{topic} stream ORDERS"
    assert sink.extra == "nats" and not sink.connected


def test_jetstream_without_nats_py_says_what_to_install(monkeypatch):
    JetStream = jetstream()
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "nats" else real(name, *a))
    with pytest.raises(ConfigurationError, match=r"pip install 'outbox-relay\[nats\]'"):
        JetStream()
