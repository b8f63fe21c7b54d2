"""The dashboard's guards as pure logic: which Host values it answers (DNS rebinding), which
Origin a POST must carry, the hold on wrong credentials (with a clock the test moves), and
the access log's query redaction. Their HTTP and browser behaviour is in
tests/integration/test_dashboard_http.py and test_dashboard_browser.py."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("starlette", reason="the dashboard's extra [dashboard] (starlette) is not installed")

from outbox.errors import ConfigurationError  # noqa: E402
from outbox.ops.dashboard.accesslog import QueryRedactor, redact_target  # noqa: E402
from outbox.ops.dashboard.origin import HostPolicy, parse_host, same_origin  # noqa: E402
from outbox.ops.dashboard.throttle import LoginThrottle, client_key, retry_after  # noqa: E402

# ----------------------------------------------------------------------------- Host


@pytest.mark.parametrize(("value", "parsed"), [
    ("127.0.0.1:8000", ("127.0.0.1", 8000)), ("LocalHost:8000", ("localhost", 8000)), ("localhost", ("localhost", None)),
    ("[::1]:8000", ("::1", 8000)), ("[::1]", ("::1", None)), ("::1", ("::1", None)),
    ("dash.example.com", ("dash.example.com", None)), ("dash.example.com:443", ("dash.example.com", 443)),
    ("", None), (":8000", None), ("localhost:", None), ("localhost:0", None), ("localhost:65536", None),
    ("localhost:80x", None), ("[::1", None), ("[::1]x", None), ("[example.com]:80", None), ("a::b::c", None),
    ("http://localhost:8000", None), ("localhost/x", None), ("user@localhost", None), ("local host", None),
    ("localhost:８０", None), ("löcalhost", None),
])
def test_parse_host(value, parsed):
    assert parse_host(value) == parsed


def test_without_credentials_only_loopback_names_on_the_own_port_are_answered():
    hosts = HostPolicy.build([], authenticated=False)
    for host in ("127.0.0.1:8000", "localhost:8000", "LOCALHOST:8000", "[::1]:8000", "127.0.0.2:8000"):
        assert hosts.allows(host, 8000), host
    for host in ("rebind.attacker.example:8000", "rebind.attacker.example", "127.0.0.1.nip.io:8000",
                 "localhost.:8000", "app.localhost:8000", "127.0.0.1:8001", "localhost", "10.0.0.1:8000",
                 "[::ffff:127.0.0.1]:8001", "0.0.0.0:8000", "", "[::1"):
        assert not hosts.allows(host, 8000), host
    assert not hosts.allows(None, 8000)
    assert hosts.allows("localhost", 80) and hosts.allows("127.0.0.1", 80)  # port 80: browsers send no port
    assert not hosts.allows("localhost", 8080)


def test_allowed_hosts_entries():
    tunnel = HostPolicy.build(["localhost:9000", "[::1]"], authenticated=False)
    assert tunnel.allows("localhost:9000", 8000) and tunnel.allows("[::1]:1234", 8000)
    assert not tunnel.allows("localhost:9001", 8000) and tunnel.allows("localhost:8000", 8000)
    proxy = HostPolicy.build([" Dash.Example.com ", "other.example:8443"], authenticated=True)
    assert proxy.allows("dash.example.com", 8000) and proxy.allows("DASH.example.com:443", 8000)
    assert proxy.allows("other.example:8443", 8000) and not proxy.allows("other.example", 8000)
    assert not proxy.allows("rebind.attacker.example:8000", 8000) and proxy.allows("127.0.0.1:8000", 8000)
    assert HostPolicy.build([], authenticated=True).allows("anything.example:1", 8000)
    assert not HostPolicy.build([], authenticated=True).allows("bad host", 8000)


@pytest.mark.parametrize("entry", ["dash.example.com", "outbox.local:8000", "10.0.0.5", "0.0.0.0"])
def test_a_non_loopback_allowed_host_needs_credentials(entry):
    with pytest.raises(ConfigurationError, match="not a loopback name.*DNS rebinding"):
        HostPolicy.build([entry], authenticated=False)
    assert HostPolicy.build([entry], authenticated=True).allows(entry, 1)


@pytest.mark.parametrize("entry", ["https://dash.example.com", "dash.example.com/", "dash:port", "*"])
def test_an_allowed_host_that_is_no_host_is_refused(entry):
    with pytest.raises(ConfigurationError, match="is not a host"):
        HostPolicy.build([entry], authenticated=True)


# --------------------------------------------------------------------------- Origin


@pytest.mark.parametrize(("origin", "referer", "host", "same"), [
    ("http://127.0.0.1:8000", None, "127.0.0.1:8000", True),
    ("http://LOCALHOST:8000", None, "localhost:8000", True),
    ("http://[::1]:8000", None, "[::1]:8000", True),
    ("https://dash.example.com", None, "dash.example.com", True),     # behind a proxy that ends TLS
    ("https://dash.example.com", None, "dash.example.com:443", True),
    ("http://dash.example.com:80", None, "dash.example.com", True),
    (None, "http://127.0.0.1:8000/confirm?action=pause&consumer=a", "127.0.0.1:8000", True),
    ("http://rebind.attacker.example:8000", None, "127.0.0.1:8000", False),
    ("http://rebind.attacker.example:8000", None, "rebind.attacker.example:8001", False),
    ("http://127.0.0.1:8001", None, "127.0.0.1:8000", False),         # same site, another origin
    ("http://localhost:8000", None, "127.0.0.1:8000", False),
    ("null", "http://127.0.0.1:8000/", "127.0.0.1:8000", False),      # Origin decides when present
    ("http://127.0.0.1:8000", None, None, False),
    (None, None, "127.0.0.1:8000", False),
    (None, "http://evil.example/x", "127.0.0.1:8000", False),
    ("ftp://127.0.0.1:8000", None, "127.0.0.1:8000", False),
    ("http://user@127.0.0.1:8000", None, "127.0.0.1:8000", False),
    ("http://127.0.0.1:99999", None, "127.0.0.1:8000", False),
    ("http://127.0.0.1", None, "127.0.0.1:8000", False),
])
def test_same_origin(origin, referer, host, same):
    assert same_origin(origin, referer, host) is same


# ------------------------------------------------------------------------- throttle


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_wrong_credentials_hold_their_address_for_a_doubling_time():
    clock = Clock()
    throttle = LoginThrottle(clock=clock)
    assert [throttle.failed("a") for _ in range(5)] == [0.0] * 5  # the free ones
    assert throttle.wait("a") == 0.0
    holds = []
    for _ in range(12):
        holds.append(throttle.failed("a"))
        assert throttle.wait("a") == holds[-1]
        clock.now += holds[-1]  # waits out each hold, then fails again
        assert throttle.wait("a") == 0.0
    assert holds == [1, 2, 4, 8, 16, 32, 64, 128, 256, 300, 300, 300]
    assert throttle.wait("b") == 0.0  # per address
    throttle.failed("a")
    clock.now += 10
    assert throttle.wait("a") == 290.0  # held, right or wrong: the caller does not look at credentials
    throttle.succeeded("a")
    assert throttle.wait("a") == 0.0 and throttle.failed("a") == 0.0  # forgotten after the right ones


def test_failures_are_forgotten_after_an_hour_and_memory_is_bounded():
    clock = Clock()
    throttle = LoginThrottle(clock=clock, max_clients=3)
    for _ in range(6):
        throttle.failed("a")
    assert throttle.wait("a") == 1.0
    clock.now += 3601
    assert throttle.wait("a") == 0.0 and throttle.failed("a") == 0.0  # a fresh start
    for client in ("b", "c", "d"):
        for _ in range(6):
            throttle.failed(client)
    assert throttle.wait("a") == 0.0 and throttle.wait("b") == 1.0 and throttle.wait("d") == 1.0


def test_client_keys():
    assert client_key("192.0.2.7") == "192.0.2.7"
    assert client_key("2001:db8:1:2:3:4:5:6") == client_key("2001:db8:1:2:ffff::1") == "2001:db8:1:2::/64"
    assert client_key("::ffff:192.0.2.7") == "192.0.2.7"
    assert client_key(None) == "unknown" and client_key("testclient") == "testclient"
    assert retry_after(0.2) == "1" and retry_after(2.01) == "3" and retry_after(300) == "300"


# ------------------------------------------------------------------------ access log


@pytest.mark.parametrize(("target", "logged"), [
    ("/", "/"), ("/?token=s3cret", "/?***"), ("/?s3cret", "/?***"),
    ("/consumers/mail?status=dead&before=12", "/consumers/mail?status=dead&before=12"),
    ("/relays?access_token=s3cret&status=x&Authorization=Bearer%20s3cret", "/relays?***&status=x&***"),
    ("/events?key=order%3A1&id=", "/events?key=order%3A1&id="),
    ("/?%74oken=s3cret", "/?***"),
])
def test_redact_target(target, logged):
    assert redact_target(target) == logged


def test_the_access_line_is_written_without_the_unknown_parameters():
    """A record as uvicorn writes it (``'%s - "%s %s HTTP/%s" %d'``) formats without them."""
    record = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
                               ("127.0.0.1:5000", "GET", "/relays?token=s3cret&status=dead", "1.1", 401), None)
    assert QueryRedactor().filter(record) is True
    assert record.getMessage() == '127.0.0.1:5000 - "GET /relays?***&status=dead HTTP/1.1" 401'
