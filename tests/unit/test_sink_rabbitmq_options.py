"""The RabbitMQ sink's options are checked when it is built (a bad forwarder fails at import
of the application module), and ``describe()`` never shows the password. No broker and no
aio-pika needed: its presence is simulated where the test needs it."""

from __future__ import annotations

import importlib.util
import re
from typing import Any

import pytest

from outbox.errors import ConfigurationError
from outbox.sinks import Sink
from outbox.sinks.rabbitmq import RabbitMQ


@pytest.fixture
def aio_pika_present(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "aio_pika" else real(name, *a))


@pytest.mark.parametrize(("options", "message"), [
    ({"url": "http://127.0.0.1:5672/"}, "RabbitMQ url must be an amqp:// or amqps:// URL"),
    ({"url": "127.0.0.1:5672"}, "RabbitMQ url must be an amqp:// or amqps:// URL"),
    ({"url": "amqp:///vhost"}, "RabbitMQ url must be an amqp:// or amqps:// URL with a host"),
    ({"url": None}, "RabbitMQ url must be"),
    ({"exchange": None}, "RabbitMQ exchange must be a string"),
    ({"exchange": "x" * 256}, "RabbitMQ exchange name is longer than 255 bytes"),
    ({"routing_key": ""}, "routing key template must be a non-empty string"),
    ({"routing_key": "orders.{event}"}, "routing key template 'orders.{event}' names unknown field {event}"),
    ({"routing_key": "{topic!r}"}, "routing key template '{topic!r}': {topic} takes no conversion or format spec"),
    ({"connect_timeout": 0}, "RabbitMQ connect_timeout must be a positive number of seconds"),
    ({"connect_timeout": True}, "RabbitMQ connect_timeout must be a positive number of seconds"),
    ({"connect_timeout": "5"}, "RabbitMQ connect_timeout must be a positive number of seconds"),
])
def test_a_bad_option_is_named(aio_pika_present: None, options: dict[str, Any], message: str):
    with pytest.raises(ConfigurationError, match="^" + re.escape(message)):
        RabbitMQ(**options)


@pytest.mark.parametrize(("url", "shown"), [("amqq://relay:s3cret@mq.example/", "got amqq://relay:***@mq.example/"),
                                             ("relay:s3cret@mq.example", "got <unparseable URL>")])
def test_a_refused_url_is_shown_without_its_password(aio_pika_present: None, url: str, shown: str):
    with pytest.raises(ConfigurationError) as refused:
        RabbitMQ(url)
    assert str(refused.value).endswith(shown) and "s3cret" not in str(refused.value)


def test_missing_aio_pika_says_which_extra_to_install(monkeypatch: pytest.MonkeyPatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "aio_pika" else real(name, *a))
    with pytest.raises(ConfigurationError, match=r"pip install 'outbox-relay\[rabbitmq\]'"):
        RabbitMQ()


def test_describe_shows_where_it_sends_without_the_password(aio_pika_present: None):
    sink = RabbitMQ("amqps://relay:s3cr%40t@mq.example.org:5671/prod?heartbeat=30", exchange="orders",
                    routing_key="orders.{topic}.{key}")
    assert isinstance(sink, Sink) and sink.extra == "rabbitmq"
    assert sink.describe() == ("amqps://relay:***@mq.example.org:5671/prod?heartbeat=30 exchange 'orders' routing key "
                               "orders.{topic}.{key}")
    assert "s3cr" not in sink.describe()
    assert RabbitMQ().describe() == "amqp://guest:***@127.0.0.1:5672/ exchange (default) routing key {topic}"
    assert not RabbitMQ().connected
