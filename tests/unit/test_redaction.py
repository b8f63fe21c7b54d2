"""The one redaction rule (:mod:`outbox.redaction`): what it hides, what it shows, that its
list of secret parameters covers libpq's own, and that :func:`split_secrets` leaves none."""

from __future__ import annotations

import pytest
from psycopg import pq
from sqlalchemy.engine import make_url

from outbox.db.engine import redact as engine_redact
from outbox.redaction import SECRET_PARAMETERS, UNPARSEABLE, redact, split_secrets

SECRET = "Zq9secret"


@pytest.mark.parametrize("url, shown", [
    (f"postgresql://u:{SECRET}@db:5432/app", "postgresql://u:***@db:5432/app"),
    (f"postgresql://u@db/app?password={SECRET}&sslmode=require", "postgresql://u@db/app?password=***&sslmode=require"),
    (f"postgresql://u:{SECRET}@db/app?sslpassword={SECRET}&password={SECRET}",
     "postgresql://u:***@db/app?password=***&sslpassword=***"),
    (f"postgresql://u@db/app?PassWord={SECRET}&SSLPASSWORD={SECRET}",
     "postgresql://u@db/app?PassWord=***&SSLPASSWORD=***"),
    (f"postgresql://u@db/app?password={SECRET}&password={SECRET}x", "postgresql://u@db/app?password=***&password=***"),
    (f"postgresql+psycopg://u@db/app?oauth_client_secret={SECRET}&scram_client_key={SECRET}"
     f"&scram_server_key={SECRET}&sslkey=/keys/client.key",
     "postgresql+psycopg://u@db/app?oauth_client_secret=***&scram_client_key=***&scram_server_key=***"
     "&sslkey=%2Fkeys%2Fclient.key"),
    (f"postgresql://u:pa/ss{SECRET}@db/app", "postgresql://u:***@db/app"),  # SQLAlchemy reads it so
    (f"postgresql://u:{SECRET}@db:notaport/app?password={SECRET}", "postgresql://u:***@db:notaport/app?password=***"),
    (f"postgresql://u:{SECRET}@[::1]:5432,db2:5433/app?sslpassword={SECRET}#x",
     "postgresql://u:***@[::1]:5432,db2:5433/app?sslpassword=***#x"),
    (f"mysql://u:{SECRET}@db/app?password={SECRET}", "mysql://u:***@db/app?password=***"),
    (f"amqps://relay:{SECRET}@mq.example:5671/prod?heartbeat=30", "amqps://relay:***@mq.example:5671/prod?heartbeat=30"),
    (f"nats://relay:{SECRET}@nats.example:4222", "nats://relay:***@nats.example:4222"),
    (f"nats://{SECRET}@nats.example:4222", "nats://***@nats.example:4222"),  # a token
    (f"tls://{SECRET}@nats.example:4443", "tls://***@nats.example:4443"),
    (f"amqp://relay@mq.example/?p%61ssword={SECRET}", "amqp://relay@mq.example/?p%61ssword=***"),
    (f"amqp://relay:{SECRET}/x@mq.example/", UNPARSEABLE),  # '/' in a password: another parser may split there
    (SECRET, UNPARSEABLE),
    (f"host=db password={SECRET}", UNPARSEABLE),
])
def test_the_rule(url, shown):
    assert redact(url) == shown
    assert SECRET not in redact(url)


def test_a_sqlalchemy_url_and_text_are_shown_alike():
    url = make_url(f"postgresql+psycopg://u:{SECRET}@db/app?password={SECRET}&host=/run/pg")
    assert redact(url) == "postgresql+psycopg://u:***@db/app?host=%2Frun%2Fpg&password=***"
    assert redact(url) == redact(url.render_as_string(hide_password=False))
    assert engine_redact is redact  # the old import path is the same rule


def test_the_list_covers_every_parameter_libpq_hides():
    """libpq marks the parameters whose value it hides with display character ``*``
    (``PQconndefaults()``); each is in SECRET_PARAMETERS, so a libpq that adds one fails
    here. ``scram_client_key`` / ``scram_server_key`` (display ``D``) authenticate as the
    user: they are in the list too."""
    options = {o.keyword.decode(): o.dispchar.decode() for o in pq.Conninfo.get_defaults()}
    hidden = {name for name, display in options.items() if display == "*"}
    assert hidden and hidden <= SECRET_PARAMETERS, hidden - SECRET_PARAMETERS
    assert SECRET_PARAMETERS - hidden <= {"scram_client_key", "scram_server_key"}
    assert "sslkey" in options and "sslkey" not in SECRET_PARAMETERS  # a path, shown


def test_split_secrets_leaves_no_secret_in_the_url():
    url = make_url(f"postgresql://u:user{SECRET}@db:5432/app?password=query{SECRET}&sslpassword=ssl{SECRET}"
                   f"&application_name=x&host=/run/pg")
    left, secrets = split_secrets(url)
    assert SECRET not in left.render_as_string(hide_password=False)
    assert left.password is None and (left.username, left.host, left.port, left.database) == ("u", "db", 5432, "app")
    assert dict(left.query) == {"application_name": "x", "host": "/run/pg"}
    # the query's password wins over the userinfo's, as SQLAlchemy's psycopg dialect passes them
    assert secrets == {"password": f"query{SECRET}", "sslpassword": f"ssl{SECRET}"}
    assert split_secrets(make_url(f"postgresql://u:{SECRET}@db/app"))[1] == {"password": SECRET}
    assert split_secrets(make_url("postgresql://u@db/app")) == (make_url("postgresql://u@db/app"), {})
