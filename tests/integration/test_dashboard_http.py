"""The dashboard over HTTP (Starlette's TestClient, and a real ``outbox-relay dashboard``
process): authentication and the refusal to listen off loopback without it, CSRF, read-only,
bad input as 400/404 pages, the database going away and coming back, escaping, keyset pages;
and the :mod:`outbox.admin` queries the dashboard reads through, on a seeded database."""

from __future__ import annotations

import base64
import http.client
import math
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from outbox import admin, publish
from outbox.db.engine import make_engine
from outbox.ops.cli import main
from outbox.relay.router import route_all
from outbox.settings import OutboxSettings
from outbox.testing import wait_for
from tests.acceptance.proxy import TcpProxy, database_target, through

from .dashboard_helpers import HOSTILE, HOSTILE_ERROR, Clock, attempted, paused, seed, statuses
from .helpers import subscribe

pytest.importorskip("starlette", reason="the dashboard's extra [dashboard] (starlette) is not installed")
pytest.importorskip("httpx", reason="starlette's TestClient needs httpx")

from pydantic import SecretStr  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from outbox.errors import AdminError, ConfigurationError  # noqa: E402
from outbox.ops.dashboard import DashboardAuth, check_bind, create_app  # noqa: E402
from outbox.ops.dashboard.throttle import LoginThrottle  # noqa: E402

#: Where the TestClient's requests go (its Host header and port), and the Origin its POSTs carry.
BASE = "http://127.0.0.1:8000"


def _client(engine: sa.Engine, settings: OutboxSettings | None = None, **options) -> TestClient:
    """A TestClient of the dashboard at :data:`BASE`, sending ``Origin: BASE`` as a browser
    does from the dashboard's own pages."""
    app = create_app(engine, settings or OutboxSettings(_env_file=None), **options)
    return TestClient(app, base_url=BASE, headers={"origin": BASE}, follow_redirects=False)


def _csrf(client: TestClient, query: str) -> str:
    page = client.get(f"/confirm?{query}")
    assert page.status_code == 200, page.text
    return re.search(r'name="csrf" value="([0-9a-f]+)"', page.text).group(1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------ binding, auth


def test_a_non_loopback_bind_without_credentials_refuses_to_start(db_url, capsys):
    port = _free_port()
    url = db_url.render_as_string(hide_password=False)
    env = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("OUTBOX_DASHBOARD_")}
    try:
        code = main(["dashboard", "--host", "0.0.0.0", "--port", str(port), "--database-url", url])
    finally:
        os.environ.update(env)
    err = capsys.readouterr().err
    assert code == 2
    assert "refusing to listen on 0.0.0.0 without authentication" in err and "OUTBOX_DASHBOARD_TOKEN" in err
    with socket.socket() as s:  # nothing listens there
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_which_binds_need_credentials():
    """Only a literal loopback address goes without credentials; a name, ``localhost``
    included, needs them (a resolver or /etc/hosts decides where it points)."""
    for host in ("127.0.0.1", "127.0.0.2", "::1", "[::1]"):
        check_bind(host, None)
    for host in ("0.0.0.0", "::", "192.168.1.5", "dashboard.example", "", "localhost", "localhost.", "LOCALHOST"):
        with pytest.raises(ConfigurationError, match="refusing to listen"):
            check_bind(host, None)
    check_bind("0.0.0.0", DashboardAuth(token=SecretStr("t")))


def test_settings_want_basic_auth_whole():
    with pytest.raises(ValueError, match="dashboard_user and dashboard_password go together"):
        OutboxSettings(_env_file=None, dashboard_user="ops")
    assert DashboardAuth.from_settings(OutboxSettings(_env_file=None)) is None


WEAK_CREDENTIALS = [
    ({"OUTBOX_DASHBOARD_TOKEN": ""}, "OUTBOX_DASHBOARD_TOKEN is too short"),
    ({"OUTBOX_DASHBOARD_TOKEN": " "}, "OUTBOX_DASHBOARD_TOKEN is too short"),
    ({"OUTBOX_DASHBOARD_TOKEN": "  tooshort-0123  "}, "OUTBOX_DASHBOARD_TOKEN is too short"),  # 15 once stripped
    ({"OUTBOX_DASHBOARD_USER": "ops", "OUTBOX_DASHBOARD_PASSWORD": ""}, "OUTBOX_DASHBOARD_PASSWORD is blank"),
    ({"OUTBOX_DASHBOARD_USER": "ops", "OUTBOX_DASHBOARD_PASSWORD": " \t"}, "OUTBOX_DASHBOARD_PASSWORD is blank"),
    ({"OUTBOX_DASHBOARD_USER": " ", "OUTBOX_DASHBOARD_PASSWORD": "pw-secret-value"}, "OUTBOX_DASHBOARD_USER is blank"),
]


@pytest.mark.parametrize(("env", "fragment"), WEAK_CREDENTIALS)
def test_weak_credentials_are_refused(monkeypatch, env, fragment):
    """A token under 16 characters (surrounding whitespace not counted), or a blank user or
    password, is refused by name, never quoting the value (before, ``ops`` with an empty
    password started and let ``ops:`` in)."""
    for name in [n for n in os.environ if n.startswith("OUTBOX_DASHBOARD_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigurationError, match=fragment) as refused:
        DashboardAuth.from_settings(OutboxSettings(_env_file=None))
    assert "pw-secret-value" not in str(refused.value) and "tooshort" not in str(refused.value)


@pytest.mark.parametrize(("env", "fragment"), WEAK_CREDENTIALS[1::2])
def test_a_dashboard_with_weak_credentials_does_not_start(db_url, env, fragment):
    """The process exits 2 with one line naming the variable, the secret in no line, nothing listening."""
    port = _free_port()
    environ = {**{k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")},
               "OUTBOX_DATABASE_URL": db_url.render_as_string(hide_password=False), **env}
    result = subprocess.run([sys.executable, "-m", "outbox.ops.cli", "dashboard", "--host", "0.0.0.0", "--port", str(port)],
                            env=environ, capture_output=True, text=True, timeout=30)
    assert result.returncode == 2, result.stderr
    assert result.stdout == "" and result.stderr.count("\n") == 1 and fragment in result.stderr
    assert "pw-secret-value" not in result.stderr and "tooshort" not in result.stderr


def test_a_stripped_token_is_the_one_compared(engine):
    auth = DashboardAuth.from_settings(OutboxSettings(_env_file=None, dashboard_token="  0123456789abcdef \n"))
    assert auth is not None and auth.token is not None and auth.token.get_secret_value() == "0123456789abcdef"
    client = _client(engine, auth=auth)
    assert client.get("/relays", headers={"Authorization": "Bearer 0123456789abcdef"}).status_code == 200


def _serve(args: list[str], db_url, tmp_path, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, object]:
    environ = {**{k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")},
               "OUTBOX_DATABASE_URL": db_url.render_as_string(hide_password=False), **(env or {})}
    log = tmp_path / "dashboard.log"
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, "-m", "outbox.ops.cli", "dashboard", *args], env=environ, stdout=out,
                                   stderr=subprocess.STDOUT)
    return process, log


@pytest.mark.parametrize("host", ["[::1]", "::1"])
def test_the_ipv6_loopback_serves_without_credentials(db_url, tmp_path, host):
    """``--host [::1]`` (as in a URL) and ``--host ::1`` listen on the IPv6 loopback (before,
    ``[::1]`` logged its start line, then died: Errno -2, exit 3)."""
    with socket.socket(socket.AF_INET6) as probe:
        try:
            probe.bind(("::1", 0))
        except OSError:
            pytest.skip("this host has no IPv6 loopback")
        port = probe.getsockname()[1]
    process, log = _serve(["--host", host, "--port", str(port)], db_url, tmp_path)

    def answers() -> int:
        assert process.poll() is None, log.read_text()
        try:
            with urllib.request.urlopen(f"http://[::1]:{port}/relays", timeout=10) as response:
                return response.status
        except OSError:
            return 0

    try:
        assert wait_for(answers, timeout=30, what="the dashboard on [::1]") == 200
    finally:
        process.terminate()
        process.wait(20)
    assert "dashboard on http://[::1]:" in log.read_text()


@pytest.mark.parametrize(("host", "fragment"), [("no-such-host.invalid", "cannot listen on --host 'no-such-host.invalid'"),
                                                ("192.0.2.1", "cannot listen on 192.0.2.1 port")])
def test_a_host_it_cannot_listen_on_is_one_line(db_url, tmp_path, host, fragment):
    """A name that does not resolve, or an address not on this host: exit 2, one line, before
    the start line (before: the start line, then a uvicorn error, exit 3)."""
    process, log = _serve(["--host", host, "--port", str(_free_port())], db_url, tmp_path,
                          {"OUTBOX_DASHBOARD_TOKEN": "0123456789abcdef-token"})
    assert process.wait(30) == 2
    lines = log.read_text().splitlines()
    assert len(lines) == 1 and lines[0].startswith("outbox-relay: error: dashboard: ") and fragment in lines[0], lines


def test_dashboard_process_on_all_interfaces_wants_the_token_and_never_logs_it(db_url, tmp_path):
    """A real ``outbox-relay dashboard --host 0.0.0.0`` with a token: every page answers 401
    without it or with a wrong one, 200 with it (bearer, or the sign-in cookie); the token
    is in no line the process writes."""
    port = _free_port()
    secret = "s3cret-token-for-the-test-" + os.urandom(6).hex()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")},
           "OUTBOX_DATABASE_URL": db_url.render_as_string(hide_password=False), "OUTBOX_DASHBOARD_TOKEN": secret}
    log = tmp_path / "dashboard.log"
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, "-m", "outbox.ops.cli", "dashboard", "--host", "0.0.0.0", "--port",
                                    str(port)], env=env, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"

    def get(path: str, headers: dict[str, str] | None = None, data: bytes | None = None) -> tuple[int, str, object]:
        origin = {"Origin": base} if data is not None else {}
        request = urllib.request.Request(base + path, headers={**origin, **(headers or {})}, data=data)
        try:
            with urllib.request.build_opener(_NoRedirect).open(request, timeout=10) as response:
                return response.status, response.read().decode(), response.headers
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode(), exc.headers

    def up() -> bool:
        assert process.poll() is None, log.read_text()
        try:
            return get("/")[0] > 0
        except OSError:
            return False

    try:
        wait_for(up, timeout=30, what="the dashboard process to answer")
        status, body, _ = get("/")
        assert status == 401 and 'name="token"' in body
        assert get("/consumers/x", {"Authorization": "Bearer wrong"})[0] == 401
        assert get("/static/style.css")[0] == 200  # assets are public, pages are not
        status, body, _ = get("/", {"Authorization": f"Bearer {secret}"})
        assert status == 200 and "<h1>Overview</h1>" in body
        assert get("/login", data=b"token=wrong")[0] == 401
        status, _, headers = get("/login", data=f"token={secret}".encode())
        assert status == 303
        cookie = headers.get("set-cookie").split(";")[0]
        assert secret not in cookie
        assert get("/relays", {"Cookie": cookie})[0] == 200
        assert get("/relays", {"Cookie": "outbox_auth=forged"})[0] == 401
    finally:
        process.terminate()
        process.wait(20)
    text = log.read_text()
    assert "auth: bearer token" in text, text
    assert secret not in text


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None


def test_basic_auth_wrong_password_is_401_with_a_challenge(engine):
    auth = DashboardAuth(user="ops", password=SecretStr("pw"))
    client = _client(engine, auth=auth)
    wrong = "Basic " + base64.b64encode(b"ops:nope").decode()
    response = client.get("/", headers={"Authorization": wrong})
    assert response.status_code == 401
    assert response.headers["www-authenticate"].startswith("Basic ")
    assert client.get("/", headers={"Authorization": "Basic !!!"}).status_code == 401
    right = "Basic " + base64.b64encode(b"ops:pw").decode()
    assert client.get("/", headers={"Authorization": right}).status_code == 200


# ---------------------------------- Host, Origin, wrong credentials, access log (issue 26)

REBIND = "rebind.attacker.example:8000"


def test_a_rebinding_host_gets_a_400_page_and_nothing_else(engine):
    """Issue 26, item 4: a site whose name points to 127.0.0.1 (DNS rebinding) got the
    confirmation page with a session cookie and its CSRF token, an event's payload, and
    cancelled a job with them. Without credentials only loopback Host values on the
    dashboard's port are answered; anything else is a short 400 page with no cookie."""
    s = seed(engine)
    job = s.jobs["bill"]["ready"][0]
    client = _client(engine)
    attacker = {"host": REBIND, "origin": f"http://{REBIND}"}
    confirm = client.get(f"/confirm?action=cancel&consumer=bill&job={job}", headers=attacker)
    assert confirm.status_code == 400, confirm.text
    assert "set-cookie" not in confirm.headers and 'name="csrf"' not in confirm.text
    assert "Wrong address" in confirm.text and "rebind.attacker.example" in confirm.text
    assert confirm.headers["content-security-policy"].startswith("default-src 'self'")
    event = client.get(f"/events/{s.events[0]}", headers=attacker)
    assert event.status_code == 400 and "total_cents" not in event.text
    token = _csrf(client, f"action=cancel&consumer=bill&job={job}")  # even with a real session and token
    cancel = client.post("/actions/cancel", data={"consumer": "bill", "job": str(job), "csrf": token}, headers=attacker)
    assert cancel.status_code == 400 and statuses(engine, [job]) == ["ready"]
    for host in ("rebind.attacker.example", "127.0.0.1.nip.io:8000", "localhost.:8000", "127.0.0.1:8001",
                 "0.0.0.0:8000"):
        assert client.get("/relays", headers={"host": host}).status_code == 400, host
    for host in ("127.0.0.1:8000", "localhost:8000", "LOCALHOST:8000", "[::1]:8000", "127.0.0.2:8000"):
        assert client.get("/relays", headers={"host": host}).status_code == 200, host
    cancelled = client.post("/actions/cancel", data={"consumer": "bill", "job": str(job), "csrf": token})
    assert cancelled.status_code == 303 and statuses(engine, [job]) == ["cancelled"]


@pytest.mark.parametrize("headers", [
    {"origin": f"http://{REBIND}"},
    {"origin": "http://127.0.0.1:8001"},        # same site (another port): the session cookie goes along
    {"origin": "http://localhost:8000"},
    {"origin": "null"},                         # a sandboxed frame, a data: page
    {"origin": "null", "referer": f"{BASE}/confirm"},
    {"origin": "", "referer": "http://evil.example/attack"},
    {"origin": ""},                             # neither header
], ids=["rebind", "other-port", "other-name", "null", "null-with-referer", "other-referer", "none"])
def test_a_post_from_another_origin_is_refused(engine, headers):
    """Every POST needs an Origin (or, without one, a Referer) naming the dashboard itself:
    another origin is refused (403) even with the right session cookie and CSRF token."""
    seed(engine)
    client = _client(engine)
    token = _csrf(client, "action=pause&consumer=bill")
    if headers.get("origin") == "":
        client.headers.pop("origin")
        headers = {k: v for k, v in headers.items() if k != "origin"}
    refused = client.post("/actions/pause", data={"consumer": "bill", "csrf": token}, headers=headers)
    assert refused.status_code == 403 and "was not sent from the dashboard" in refused.text
    assert "set-cookie" not in refused.headers
    assert not paused(engine, "bill")
    client.headers.pop("origin", None)
    same = client.post("/actions/pause", data={"consumer": "bill", "csrf": token}, headers={"referer": f"{BASE}/confirm"})
    assert same.status_code == 303 and paused(engine, "bill")


def test_sign_in_and_sign_out_from_another_origin_are_refused(engine):
    secret = "0123456789abcdef-sign-in"
    client = _client(engine, auth=DashboardAuth(token=SecretStr(secret)))
    evil = {"origin": "http://evil.example"}
    refused = client.post("/login", data={"token": secret}, headers=evil)
    assert refused.status_code == 403 and "set-cookie" not in refused.headers
    signed_in = client.post("/login", data={"token": secret})
    assert signed_in.status_code == 303 and "outbox_auth=" in signed_in.headers["set-cookie"]
    page = client.get("/relays")
    token = re.search(r'name="csrf" value="([0-9a-f]+)"', page.text).group(1)
    assert client.post("/logout", data={"csrf": token}, headers=evil).status_code == 403
    assert client.get("/relays").status_code == 200  # still signed in
    assert client.post("/logout", data={"csrf": token}).status_code == 303


def test_allowed_hosts_behind_a_proxy(engine):
    """With credentials, OUTBOX_DASHBOARD_ALLOWED_HOSTS names the Host values answered (a
    proxy's public name): others get 400; a form posted from https://<name> through a proxy
    that ends TLS passes the Origin check. With credentials and no entries, any Host."""
    s = seed(engine)
    secret = "0123456789abcdef-proxy"
    auth = DashboardAuth(token=SecretStr(secret))
    bearer = {"authorization": f"Bearer {secret}"}
    settings = OutboxSettings(_env_file=None, dashboard_allowed_hosts="dash.example.com, ops.example.com:8443")
    client = _client(engine, settings, auth=auth)
    public = {**bearer, "host": "dash.example.com", "origin": "https://dash.example.com"}
    page = client.get("/confirm?action=pause&consumer=ship", headers=public)
    assert page.status_code == 200
    token = re.search(r'name="csrf" value="([0-9a-f]+)"', page.text).group(1)
    assert client.post("/actions/pause", data={"consumer": "ship", "csrf": token}, headers=public).status_code == 303
    assert paused(engine, "ship")
    assert client.get("/relays", headers={**bearer, "host": "ops.example.com:8443"}).status_code == 200
    assert client.get("/relays", headers={**bearer, "host": "ops.example.com"}).status_code == 400
    assert client.get("/relays", headers={**bearer, "host": REBIND}).status_code == 400
    assert client.get("/relays", headers=bearer).status_code == 200  # 127.0.0.1:8000, always answered
    anywhere = _client(engine, auth=auth)
    assert anywhere.get(f"/events/{s.events[0]}", headers={**bearer, "host": "any.example"}).status_code == 200


def test_a_non_loopback_allowed_host_without_credentials_refuses_to_start(db_url, capsys, monkeypatch):
    for name in [n for n in os.environ if n.startswith("OUTBOX_DASHBOARD_")]:
        monkeypatch.delenv(name)
    port = _free_port()
    code = main(["dashboard", "--port", str(port), "--allowed-hosts", "localhost:9000,outbox.local",
                 "--database-url", db_url.render_as_string(hide_password=False)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "'outbox.local', which is not a loopback name" in err and "DNS rebinding" in err
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_wrong_tokens_are_held_and_the_right_one_waits_out_the_hold(engine):
    """200 wrong tokens in a row from one address (before: 200 x 401, and the right one let
    in at once): the first 6 get 401, the rest 429 with Retry-After; the right token, typed
    or as a bearer, waits out the hold too; a signed-in browser's cookie is not held; once
    the hold is over the right token signs in and clears the failures. The hold's clock is
    the test's (it does not move during the burst, however slow the machine)."""
    secret = "0123456789abcdef-throttle"
    clock = Clock()
    app_client = _client(engine, auth=DashboardAuth(token=SecretStr(secret)), throttle=LoginThrottle(clock=clock))
    assert app_client.post("/login", data={"token": secret}).status_code == 303  # signed in before the burst
    client = TestClient(app_client.app, base_url=BASE, headers={"origin": BASE}, follow_redirects=False)
    answers = [client.post("/login", data={"token": f"wrong-{i:04d}-0123456789"}) for i in range(200)]
    assert [a.status_code for a in answers] == [401] * 6 + [429] * 194
    assert "Too many wrong sign-ins" in answers[-1].text and answers[-1].headers["retry-after"] == "1"
    right = client.post("/login", data={"token": secret})
    assert right.status_code == 429 and "set-cookie" not in right.headers
    assert client.get("/relays", headers={"authorization": f"Bearer {secret}"}).status_code == 429
    assert app_client.get("/relays").status_code == 200  # the sign-in cookie passes
    clock.now += 0.9
    assert client.post("/login", data={"token": secret}).status_code == 429
    clock.now += 0.1
    assert client.post("/login", data={"token": secret}).status_code == 303
    assert client.post("/login", data={"token": "wrong-again-0123456789"}).status_code == 401  # failures cleared


def test_wrong_bearer_and_basic_credentials_are_held_too(engine):
    clock = Clock()
    auth = DashboardAuth(token=SecretStr("0123456789abcdef-bearer"), user="ops", password=SecretStr("pw-1"))
    client = _client(engine, auth=auth, throttle=LoginThrottle(clock=clock))
    wrong_basic = {"authorization": "Basic " + base64.b64encode(b"ops:nope").decode()}
    right_basic = {"authorization": "Basic " + base64.b64encode(b"ops:pw-1").decode()}
    codes = [client.get("/relays", headers=wrong_basic).status_code for _ in range(4)]
    codes += [client.get("/relays", headers={"authorization": "Bearer nope"}).status_code for _ in range(4)]
    assert codes == [401] * 6 + [429] * 2
    held = client.get("/relays", headers=right_basic)
    assert held.status_code == 429 and "www-authenticate" not in held.headers and held.headers["retry-after"] == "1"
    assert client.get("/relays").status_code == 401  # no credentials presented: the sign-in page, not held
    clock.now += 1
    assert client.get("/relays", headers=right_basic).status_code == 200


def test_the_dashboard_process_holds_wrong_tokens_in_real_time(db_url, tmp_path):
    """A real ``outbox-relay dashboard`` with a token, on the real clock: a burst of 200 wrong
    tokens gets 401 for the first 6 and 429 (with Retry-After) for nearly all the rest (a
    401 only where a hold had ended: at most one per doubling of the burst's duration); the
    right token signs in once the hold is over; the log says so without the token."""
    port = _free_port()
    secret = "0123456789abcdef-" + os.urandom(6).hex()
    process, log = _serve(["--port", str(port)], db_url, tmp_path, {"OUTBOX_DASHBOARD_TOKEN": secret})
    base = f"http://127.0.0.1:{port}"

    def sign_in(token: str) -> tuple[int, str | None]:
        request = urllib.request.Request(base + "/login", data=f"token={token}".encode(), headers={"Origin": base})
        try:
            with urllib.request.build_opener(_NoRedirect).open(request, timeout=10) as response:
                return response.status, None
        except urllib.error.HTTPError as exc:
            return exc.code, exc.headers.get("retry-after")

    def up() -> bool:
        assert process.poll() is None, log.read_text()
        try:
            return _http(port, "/static/style.css", f"127.0.0.1:{port}") == 200
        except OSError:
            return False

    try:
        wait_for(up, timeout=30, what="the dashboard process to answer")
        started = time.monotonic()
        answers = [sign_in(f"wrong-{i:04d}-0123456789") for i in range(200)]
        elapsed = time.monotonic() - started
        codes = [code for code, _ in answers]
        assert codes[:6] == [401] * 6 and set(codes) == {401, 429}, codes
        assert codes.count(401) - 6 <= math.log2(elapsed + 1) + 1, (codes.count(401), elapsed)
        assert all(after is not None and int(after) >= 1 for code, after in answers if code == 429)
        wait_for(lambda: sign_in(secret)[0] == 303, timeout=30, interval=0.1, what="the right token to sign in")
    finally:
        process.terminate()
        process.wait(20)
    text = log.read_text()
    assert "6 wrong credentials in a row from 127.0.0.1; its sign-ins wait 1 s" in text
    assert secret not in text


def _http(port: int, path: str, host: str, method: str = "GET") -> int:
    """The status of ``method path`` sent to 127.0.0.1:``port`` with this ``Host`` header."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request(method, path, headers={"Host": host})
        return connection.getresponse().status
    finally:
        connection.close()


def test_the_dashboard_process_refuses_a_rebinding_host(db_url, tmp_path):
    """A real ``outbox-relay dashboard`` without credentials (the issue's case): a request
    naming another host gets 400, one naming a loopback name and its port 200."""
    port = _free_port()
    process, log = _serve(["--port", str(port)], db_url, tmp_path)

    def up() -> bool:
        assert process.poll() is None, log.read_text()
        try:
            return _http(port, "/relays", f"127.0.0.1:{port}") == 200
        except OSError:
            return False

    try:
        wait_for(up, timeout=30, what="the dashboard process to answer")
        assert _http(port, "/relays", f"rebind.attacker.example:{port}") == 400
        assert _http(port, "/confirm?action=pause&consumer=x", f"rebind.attacker.example:{port}") == 400
        assert _http(port, "/relays", f"localhost:{port}") == 200
        assert _http(port, "/actions/pause", f"127.0.0.1:{port}", "POST") == 403  # no Origin, no Referer
    finally:
        process.terminate()
        process.wait(20)


@pytest.mark.parametrize("credentials", [False, True], ids=["loopback", "token"])
def test_a_token_in_the_query_string_is_not_in_the_access_log(db_url, tmp_path, credentials):
    """The dashboard takes no credentials from a URL (401 with credentials configured), and
    its access log writes the line with every query parameter but its own as ``***``
    (before: ``"GET /?token=<the token> HTTP/1.1" 401`` in the log)."""
    port = _free_port()
    secret = "s3cret-in-a-url-" + os.urandom(6).hex()
    env = {"OUTBOX_DASHBOARD_TOKEN": secret} if credentials else {}
    process, log = _serve(["--port", str(port)], db_url, tmp_path, env)
    host = f"127.0.0.1:{port}"

    def up() -> bool:
        assert process.poll() is None, log.read_text()
        try:
            return _http(port, "/static/style.css", host) == 200
        except OSError:
            return False

    try:
        wait_for(up, timeout=30, what="the dashboard process to answer")
        expected = 401 if credentials else 200
        assert _http(port, f"/?token={secret}", host) == expected
        assert _http(port, f"/consumers/mail?status=dead&access_token={secret}&before=5", host) in (expected, 404)
        assert _http(port, f"/relays?{secret}", host) == expected
        wait_for(lambda: log.read_text().count("uvicorn.access") >= 4, timeout=10, what="the access lines")
    finally:
        process.terminate()
        process.wait(20)
    text = log.read_text()
    assert secret not in text
    assert f'"GET /?*** HTTP/1.1" {expected}' in text
    assert '"GET /consumers/mail?status=dead&***&before=5 HTTP/1.1"' in text
    assert '"GET /relays?*** HTTP/1.1"' in text


# ----------------------------------------------------------------------- CSRF, read-only


def test_an_action_needs_the_csrf_token_of_its_own_session(engine):
    seed(engine)
    client = _client(engine)
    token = _csrf(client, "action=pause&consumer=bill")
    assert client.post("/actions/pause", data={"consumer": "bill"}).status_code == 403
    other = _client(engine)
    foreign = _csrf(other, "action=pause&consumer=bill")
    assert client.post("/actions/pause", data={"consumer": "bill", "csrf": foreign}).status_code == 403
    assert not paused(engine, "bill")
    response = client.post("/actions/pause", data={"consumer": "bill", "csrf": token})
    assert response.status_code == 303 and response.headers["location"].startswith("/consumers/bill?")
    assert paused(engine, "bill")


def test_read_only_shows_no_action_and_refuses_them(engine):
    s = seed(engine)
    client = _client(engine, read_only=True)
    page = client.get("/consumers/mail")
    assert page.status_code == 200 and "read-only" in page.text
    assert "data-action" not in page.text and "/confirm?" not in page.text
    assert client.get("/confirm?action=redrive&consumer=mail").status_code == 403
    writer = _client(engine)
    token = _csrf(writer, "action=redrive&consumer=mail")
    client.cookies.update(writer.cookies)  # even with a valid session and token
    dead = s.jobs["mail"]["dead"]
    assert client.post("/actions/redrive", data={"consumer": "mail", "job": str(dead[0]), "csrf": token}).status_code == 403
    assert statuses(engine, dead) == ["dead", "dead"]


# ---------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(("path", "status"), [
    ("/events/abc", 400), ("/events/0", 400), ("/events/99999999999999999999", 400), ("/events/%C2%B2", 400),
    ("/events/123456", 404), ("/events?id=x1", 400), ("/consumers/nobody", 404), ("/consumers/mail?status=bogus", 400),
    ("/consumers/mail?before=-3", 400), ("/confirm?action=drop&consumer=mail", 400),
    ("/confirm?action=cancel&consumer=mail", 400), ("/confirm?action=pause&consumer=nobody", 404),
    ("/nowhere", 404), ("/events?key=%00", 400), ("/events?key=order%00:1", 400),
    ("/confirm?action=pause&consumer=bill%00", 400),
    ("/jobs?status=bogus", 400), ("/jobs?older_than=ten", 400), ("/jobs?event=0", 400), ("/jobs?after=x", 400),
    ("/jobs?key=a%00b", 400), ("/jobs?consumer=%00", 400),
])
def test_bad_input_is_a_page_never_a_traceback(engine, path, status):
    seed(engine)
    response = _client(engine).get(path)
    assert response.status_code == status, response.text
    assert "<h1>" in response.text and "Traceback" not in response.text


def test_an_unknown_action_post_is_400(engine):
    seed(engine)
    client = _client(engine)
    token = _csrf(client, "action=pause&consumer=bill")
    assert client.post("/actions/drop", data={"consumer": "bill", "csrf": token}).status_code == 400
    assert client.post("/actions/cancel", data={"consumer": "bill", "job": "x", "csrf": token}).status_code == 400


@pytest.mark.parametrize(("action", "wrong", "owner", "kind", "before"), [
    ("redrive", "bill", "mail", "dead", "dead"), ("cancel", "bill", "ship", "ready", "ready"),
    ("retry", "mail", "ship", "backoff", "ready")])
def test_an_action_on_a_job_of_another_consumer_is_refused_and_changes_nothing(engine, action, wrong, owner, kind,
                                                                                before):
    """consumer=A&job=<a job of B>: 404 on the confirmation page and on the POST, and the job
    is untouched (the action's statement is scoped to A; before, B's job was changed and A
    reported)."""
    s = seed(engine)
    job = s.jobs[owner][kind][0]
    with engine.connect() as c:
        row_before = c.execute(sa.text("SELECT status, run_at, updated_at FROM outbox_jobs WHERE id = :i"),
                               {"i": job}).one()
    client = _client(engine)
    assert client.get(f"/confirm?action={action}&consumer={wrong}&job={job}").status_code == 404
    token = _csrf(client, f"action=pause&consumer={wrong}")
    response = client.post(f"/actions/{action}", data={"consumer": wrong, "job": str(job), "csrf": token})
    assert response.status_code == 404 and f"job {job} is not a job of consumer" in response.text
    with engine.connect() as c:
        assert c.execute(sa.text("SELECT status, run_at, updated_at FROM outbox_jobs WHERE id = :i"),
                         {"i": job}).one() == row_before
    assert row_before.status == before
    missing = client.post(f"/actions/{action}", data={"consumer": wrong, "job": "999999", "csrf": token})
    assert missing.status_code == 404 and "no such job" in missing.text
    right = client.post(f"/actions/{action}", data={"consumer": owner, "job": str(job), "csrf": token})
    assert right.status_code == 303  # its own consumer's: done
    with engine.connect() as c:
        assert c.execute(sa.text("SELECT status, run_at, updated_at FROM outbox_jobs WHERE id = :i"),
                         {"i": job}).one() != row_before


def test_only_the_dashboards_own_status_messages_are_shown(engine):
    """A link's ``?msg=`` shows nothing unless sealed by this dashboard: a crafted warning,
    or a real message's seal on other text, shows no message."""
    s = seed(engine)
    client = _client(engine)
    fake = "WARNING: the database is compromised, sign in at evil.example"
    assert fake not in client.get("/consumers/mail", params={"msg": fake}).text
    token = _csrf(client, "action=redrive&consumer=mail")
    done = client.post("/actions/redrive", data={"consumer": "mail", "job": str(s.jobs["mail"]["dead"][0]),
                                                 "csrf": token})
    assert done.status_code == 303
    page = client.get(done.headers["location"])
    assert 'id="flash"' in page.text and "redriven 1 job(s) of mail" in page.text
    seal = re.search(r"seal=([0-9a-f]+)", done.headers["location"]).group(1)
    forged = client.get("/consumers/mail", params={"msg": fake, "seal": seal})
    assert forged.status_code == 200 and fake not in forged.text and 'id="flash"' not in forged.text
    assert 'id="flash"' not in _client(engine).get(done.headers["location"]).text  # another process's key


# ------------------------------------------------------------------ database down, back


def test_database_down_is_a_503_page_and_the_dashboard_recovers(db_url):
    proxy = TcpProxy(database_target(db_url))
    proxy.start()
    engine = make_engine(through(db_url, proxy))  # the embedded server too: not around the proxy by its socket
    try:
        client = _client(engine)
        assert client.get("/").status_code == 200
        proxy.stop()
        page = client.get("/")
        assert page.status_code == 503
        assert "Database unavailable" in page.text and "cannot reach the database" in page.text
        assert 'http-equiv="refresh"' in page.text  # it reloads itself
        part = client.get("/overview")
        assert part.status_code == 503 and 'id="db-down"' in part.text and 'hx-get="/overview"' in part.text
        assert client.get("/consumers/mail").status_code == 503
        proxy.start()
        wait_for(lambda: client.get("/").status_code == 200, timeout=30, what="the dashboard to recover")
        assert client.get("/overview").status_code == 200
    finally:
        proxy.stop()
        engine.dispose()


def test_missing_tables_are_a_503_naming_migrate(empty_db_url):
    engine = make_engine(empty_db_url)
    try:
        page = _client(engine).get("/relays")
        assert page.status_code == 503 and "outbox-relay migrate" in page.text
    finally:
        engine.dispose()


# ------------------------------------------------------------------ escaping, headers


def test_hostile_payloads_and_errors_are_escaped(engine):
    s = seed(engine)
    client = _client(engine)
    event = client.get(f"/events/{s.hostile_event}")
    assert event.status_code == 200
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in event.text and HOSTILE not in event.text
    dead = client.get("/consumers/mail?status=dead").text
    assert "&lt;img src=x onerror=alert(2)&gt;" in dead and "<img" not in dead
    assert "script-src 'self'" in event.headers["content-security-policy"]
    assert event.headers["x-frame-options"] == "DENY"


def test_the_event_page_shows_each_job_s_attempts_escaped(engine):
    s = seed(engine)
    job_id = attempted(engine, "mail", HOSTILE_ERROR)  # mail's ready job: the hostile event's
    body = _client(engine).get(f"/events/{s.hostile_event}").text
    tables = dict(re.findall(r'<table class="attempts" data-consumer="(\w+)" data-job="\d+">(.*?)</table>', body,
                             re.S))
    assert set(tables) == {"bill", "mail", "ship"}
    assert re.findall(r'<tr data-outcome="([a-z ]+)">', tables["mail"]) == ["failed", "done"]
    assert "host-b:2:y" in tables["mail"] and "host-c:3:z" in tables["mail"] and f"job {job_id}" in body
    assert "&lt;img src=x onerror=alert(2)&gt;" in tables["mail"] and "<img" not in body
    assert "no attempt yet" in tables["bill"] and "no attempt yet" in tables["ship"]


# -------------------------------------------------------------------- keyset pages


def test_consumer_pages_are_keyset_pages_covering_every_job_once(engine):
    subscribe(engine, "t", ["many"])
    with Session(engine) as s, s.begin():
        for i in range(120):
            publish(s, "t", {"i": i})
    route_all(engine)
    client = _client(engine)
    seen: list[int] = []
    path = "/consumers/many?status=ready"
    pages = 0
    while path:
        body = client.get(path).text
        seen += [int(i) for i in re.findall(r'<tr data-job="(\d+)"', body)]
        older = re.search(r'href="\?([^"]+)" id="older"', body)
        path = f"/consumers/many?{older.group(1).replace('&amp;', '&')}" if older else ""
        pages += 1
    assert pages == 3
    assert len(seen) == 120 and seen == sorted(seen, reverse=True)
    with engine.connect() as c:
        assert set(seen) == set(c.execute(sa.text("SELECT id FROM outbox_jobs")).scalars())


def test_the_jobs_page_filters_and_pages_like_outbox_relay_jobs(engine):
    s = seed(engine)
    subscribe(engine, "t", ["many"])
    with Session(engine) as session, session.begin():
        for i in range(60):
            publish(session, "t", {"i": i}, key="k" if i % 2 else None)
    route_all(engine)
    client = _client(engine)

    def listed(path: str) -> list[int]:
        return [int(i) for i in re.findall(r'<tr data-job="(\d+)"', client.get(path).text)]

    assert listed("/jobs?consumer=mail&status=dead") == sorted(s.jobs["mail"]["dead"])
    with engine.connect() as c:
        keyed = list(c.execute(sa.text("SELECT j.id FROM outbox_jobs j JOIN outbox_events e ON e.id = j.event_id "
                                       "WHERE e.key = 'k' AND j.consumer = 'many' ORDER BY j.id")).scalars())
        every = list(c.execute(sa.text("SELECT id FROM outbox_jobs WHERE consumer = 'many' ORDER BY id")).scalars())
    assert listed("/jobs?consumer=many&key=k") == keyed and len(keyed) == 30
    assert listed("/jobs?consumer=many&older_than=1h") == []
    assert "no job matches" in client.get("/jobs?consumer=many&older_than=1h").text
    seen: list[int] = []
    path, pages = "/jobs?consumer=many", 0
    while path:
        body = client.get(path).text
        seen += [int(i) for i in re.findall(r'<tr data-job="(\d+)"', body)]
        following = re.search(r'href="\?([^"]+)" id="next"', body)
        path = f"/jobs?{following.group(1).replace('&amp;', '&')}" if following else ""
        pages += 1
    assert pages == 2 and seen == every


# ---------------------------------------------------------- admin queries it reads through


def test_admin_event_trace_throughput_and_pages(engine):
    s = seed(engine)
    with engine.begin() as conn:
        trace = admin.event_trace(conn, s.events[0])
        assert trace is not None and [j.consumer for j in trace.jobs] == ["bill", "mail", "ship"]
        assert [j.status for j in trace.jobs] == ["dead", "done", "ready"] and trace.unrouted_consumers == []
        assert trace.payload == {"order_id": 1, "total_cents": 100} and trace.headers == {"trace": "t-1"}
        assert admin.event_trace(conn, 10**9) is None
        assert [t.id for t in admin.events_by_key(conn, "order:3")] == [s.events[2]]
        rate = admin.throughput(conn, minutes=5)
        assert rate == {"mail": [0, 0, 0, 0, 2]}
        page = admin.jobs_page(conn, "mail", "dead", limit=1)
        assert [j.id for j in page.jobs] == [max(s.jobs["mail"]["dead"])] and page.next_before == page.jobs[0].id
        rest = admin.jobs_page(conn, "mail", "dead", before=page.next_before, limit=1)
        assert [j.id for j in rest.jobs] == [min(s.jobs["mail"]["dead"])] and rest.next_before is None
        with pytest.raises(AdminError):
            admin.jobs_page(conn, "mail", "exploded")
        assert admin.pause(conn, "ship").was_paused_at is None
        assert admin.pause(conn, "ship").was_paused_at is not None
        assert admin.resume(conn, "ship").was_paused_at is not None
        assert admin.resume(conn, "nobody").known is False
        assert admin.redrive(conn, consumer="mail") == sorted(s.jobs["mail"]["dead"])
    with pytest.raises(AdminError):
        with engine.begin() as conn:
            admin.redrive(conn)
