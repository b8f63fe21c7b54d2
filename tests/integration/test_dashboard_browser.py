"""The dashboard in a real browser: playwright (Python) drives Debian's chromium
(``/usr/bin/chromium``, or ``$OUTBOX_CHROMIUM``) against a dashboard served by uvicorn on a
seeded database, and each action is checked in the database afterwards.

Skipped, saying why, where playwright is not importable or no chromium is installed.
With ``OUTBOX_SCREENSHOTS=1`` the tests write a screenshot of each page into docs/img
(dashboard-*.png, shown in docs/dashboard.md); without it they write nothing, so a test run
leaves the work tree as it was.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import sqlalchemy as sa

from outbox.db.engine import make_engine
from tests.acceptance.proxy import TcpProxy, database_target, through

from .dashboard_helpers import HOSTILE, HOSTILE_ERROR, Clock, attempted, paused, seed, served, statuses

playwright_sync = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (extra dev)")
pytest.importorskip("starlette", reason="the dashboard's extra [dashboard] is not installed")

CHROMIUM = os.environ.get("OUTBOX_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium installed (apt-get install chromium; .ci/run "
                                                         "installs it), or set OUTBOX_CHROMIUM")
SHOTS = Path(__file__).resolve().parents[2] / "docs" / "img"
#: A name the browser resolves to 127.0.0.1, as a DNS-rebinding site's name does once re-pointed.
REBIND = "rebind.attacker.example"
#: Longest wait for anything the page shows, milliseconds (a deadline, not a pause).
WAIT_MS = 15_000


@pytest.fixture(scope="module")
def browser():
    playwright_sync.expect.set_options(timeout=WAIT_MS)
    with playwright_sync.sync_playwright() as p:
        args = ["--no-sandbox"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []  # root has no sandbox
        args.append(f"--host-resolver-rules=MAP {REBIND} 127.0.0.1")
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=args)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser):
    """A fresh browser context (its own cookies) and page; ``page.dialogs`` lists every
    alert, confirm or prompt the page opened (each is dismissed)."""
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    tab = context.new_page()
    tab.set_default_timeout(WAIT_MS)
    tab.dialogs = []

    def on_dialog(dialog):
        tab.dialogs.append(dialog.message)
        dialog.dismiss()

    tab.on("dialog", on_dialog)
    yield tab
    context.close()


def shot(page, name: str) -> None:
    """Screenshot of the page into docs/img/dashboard-<name>.png, only with OUTBOX_SCREENSHOTS=1."""
    if os.environ.get("OUTBOX_SCREENSHOTS") == "1":
        page.screenshot(path=str(SHOTS / f"dashboard-{name}.png"), full_page=True)


def expect(locator):
    return playwright_sync.expect(locator)


def cell(page, consumer: str, count: str):
    return page.locator(f'#consumers tr[data-consumer="{consumer}"] td[data-count="{count}"]')


def test_overview_shows_the_seeded_counts_and_refreshes_itself(engine, page):
    seed(engine)
    with served(engine, refresh_seconds=1.0) as base:
        page.goto(base + "/")
        expected = {"mail": {"ready": "1", "running": "1", "dead": "2", "done": "2"},
                    "bill": {"ready": "5", "running": "0", "dead": "1", "done": "0"},
                    "ship": {"ready": "6", "running": "0", "dead": "0", "done": "0"}}
        for consumer, counts in expected.items():
            for name, value in counts.items():
                expect(cell(page, consumer, name)).to_have_text(value)
        expect(page.locator("#unrouted strong")).to_have_text("0")
        expect(page.locator("#live-relays strong")).to_have_text("1")
        bars = page.locator('#consumers tr[data-consumer="mail"] svg.chart rect')
        expect(bars).to_have_count(10)
        assert bars.last.get_attribute("class") != "zero"  # mail's 2 done jobs in the current minute
        shot(page, "overview")
        with engine.begin() as c:  # a bill job dies and a ship job finishes, behind the page's back
            c.execute(sa.text("UPDATE outbox_jobs SET status = 'dead', attempts = max_attempts, finished_at = now() "
                              "WHERE id = (SELECT min(id) FROM outbox_jobs WHERE consumer = 'bill' AND status = 'ready')"))
            c.execute(sa.text("UPDATE outbox_consumers SET paused_at = now() WHERE consumer = 'ship'"))
        expect(cell(page, "bill", "dead")).to_have_text("2")  # no reload: htmx swapped it in
        expect(page.locator('#consumers tr[data-consumer="ship"] .tag.paused')).to_have_count(1)
        assert page.dialogs == []


def test_redrive_a_dead_job_from_the_consumer_page(engine, page):
    s = seed(engine)
    job, other = s.jobs["mail"]["dead"]
    with served(engine) as base:
        page.goto(base + "/consumers/mail")
        expect(page.locator("#jobs tr[data-job]")).to_have_count(2)
        page.locator(f'tr[data-job="{job}"] details summary').click()  # the folded traceback opens
        expect(page.locator(f'tr[data-job="{job}"] pre.traceback')).to_contain_text("Traceback (most recent call last)")
        shot(page, "consumer")
        page.locator(f'tr[data-job="{job}"] a[data-action="redrive"]').click()
        expect(page.locator("h1")).to_contain_text(f"Redrive job {job} of mail?")
        assert statuses(engine, [job]) == ["dead"]  # the confirmation step has changed nothing yet
        shot(page, "confirm")
        page.locator("#confirm").click()
        expect(page.locator("#flash")).to_contain_text(f"redriven 1 job(s) of mail: [{job}]")
        assert statuses(engine, [job, other]) == ["ready", "dead"]
        expect(page.locator("#jobs tr[data-job]")).to_have_count(1)
        # and "Back, do nothing" on a confirmation page leaves the job alone
        page.locator(f'tr[data-job="{other}"] a[data-action="redrive"]').click()
        page.locator("#back").click()
        expect(page.locator("h1")).to_contain_text("Consumer mail")
        assert statuses(engine, [other]) == ["dead"]
    with engine.connect() as c:
        assert c.execute(sa.text("SELECT attempts FROM outbox_jobs WHERE id = :i"), {"i": job}).scalar_one() == 0


def test_cancel_retry_pause_and_resume_from_the_consumer_page(engine, page):
    s = seed(engine)
    ready = s.jobs["bill"]["ready"][0]
    backoff = s.jobs["ship"]["backoff"][0]
    with served(engine) as base:
        page.goto(base + "/consumers/bill?status=ready")
        page.locator(f'tr[data-job="{ready}"] a[data-action="cancel"]').click()
        page.locator("#confirm").click()
        expect(page.locator("#flash")).to_have_text(f"cancelled job {ready}")
        assert statuses(engine, [ready]) == ["cancelled"]

        page.locator('#pause-state a[data-action="pause"]').click()
        expect(page.locator(".explain")).to_contain_text("No relay claims this consumer's jobs")
        page.locator("#confirm").click()
        expect(page.locator("#pause-state .tag.paused")).to_contain_text("paused since")
        assert paused(engine, "bill")
        page.locator('#pause-state a[data-action="resume"]').click()
        page.locator("#confirm").click()
        expect(page.locator("#flash")).to_have_text("resumed consumer bill")
        assert not paused(engine, "bill")

        page.goto(base + "/consumers/ship?status=ready")
        page.locator(f'tr[data-job="{backoff}"] a[data-action="retry"]').click()
        page.locator("#confirm").click()
        expect(page.locator("#flash")).to_contain_text(f"due now: 1 job(s): [{backoff}]")
    with engine.connect() as c:
        assert c.execute(sa.text("SELECT run_at <= now() FROM outbox_jobs WHERE id = :i"), {"i": backoff}).scalar_one()


def test_the_event_page_shows_one_job_per_consumer(engine, page):
    s = seed(engine)
    with served(engine) as base:
        page.goto(base + "/")
        page.fill('nav input[name="key"]', "order:1")
        page.locator("nav form.lookup button").click()
        page.locator(f'#key-events a[href="/events/{s.events[0]}"]').click()
        expect(page.locator("h1")).to_have_text(f"Event {s.events[0]}")
        rows = page.locator("#event-jobs tbody tr[data-consumer]")
        expect(rows).to_have_count(3)
        seen = {rows.nth(i).get_attribute("data-consumer"): rows.nth(i).locator(".status").inner_text()
                for i in range(3)}
        assert seen == {"bill": "dead", "mail": "done", "ship": "ready"}
        expect(page.locator("#topic")).to_have_text("order.placed")
        expect(page.locator("#payload")).to_contain_text('"total_cents": 100')
        expect(page.locator("#headers")).to_contain_text('"trace": "t-1"')
        shot(page, "event")
        page.fill('nav input[name="id"]', str(s.events[4]))
        page.locator("nav form.lookup button").click()
        expect(page.locator("h1")).to_have_text(f"Event {s.events[4]}")
        running = page.locator('#event-jobs tr[data-consumer="mail"]')
        expect(running).to_contain_text("running")
        expect(running).to_contain_text("host-a:1:x")  # the relay holding its lease


def test_the_event_page_shows_the_attempts_of_each_job_and_a_hostile_error_is_text(engine, page):
    s = seed(engine)
    attempted(engine, "mail", HOSTILE_ERROR)
    with served(engine) as base:
        page.goto(base + f"/events/{s.hostile_event}")
        attempts = page.locator('table.attempts[data-consumer="mail"] tbody tr')
        expect(attempts).to_have_count(2)
        expect(attempts.nth(0).locator(".status")).to_have_text("failed")
        expect(attempts.nth(0)).to_contain_text("host-b:2:y")
        expect(attempts.nth(0).locator(".error-line")).to_have_text("ValueError: <img src=x onerror=alert(2)> refused")
        expect(attempts.nth(1).locator(".status")).to_have_text("done")
        expect(page.locator('table.attempts[data-consumer="bill"]')).to_contain_text("no attempt yet")
        assert page.locator("main img").count() == 0
        attempts.nth(0).locator("summary").click()  # the traceback, opened: text as well
        expect(attempts.nth(0).locator("pre.traceback")).to_contain_text("raise ValueError(...)")
        assert page.locator("main img").count() == 0
    assert page.dialogs == []


def test_a_hostile_payload_is_text_and_never_runs(engine, page):
    s = seed(engine)
    with served(engine) as base:
        page.goto(base + f"/events/{s.hostile_event}")
        expect(page.locator("#payload")).to_contain_text(HOSTILE)
        expect(page.locator("#headers")).to_contain_text(HOSTILE)
        page.goto(base + "/consumers/mail?status=dead")
        expect(page.locator("#jobs")).to_contain_text("<img src=x onerror=alert(2)> refused")
        assert page.locator("main img").count() == 0
        assert page.locator("script").count() == 1  # htmx only
        page.goto(base + "/events?key=" + "%3Cscript%3Ealert(3)%3C%2Fscript%3E")
        expect(page.locator("h2")).to_contain_text("<script>alert(3)</script>")
        page.reload()
        page.wait_for_load_state("load")
    assert page.dialogs == []


def test_an_action_without_the_csrf_token_is_refused(engine, page):
    seed(engine)
    with served(engine) as base:
        page.goto(base + "/confirm?action=pause&consumer=bill")
        page.evaluate("document.querySelector('#confirm-form input[name=csrf]').remove()")
        with page.expect_response(lambda r: "/actions/pause" in r.url) as answer:
            page.locator("#confirm").click()
        assert answer.value.status == 403
        expect(page.locator("#error")).to_contain_text("CSRF token is missing")
        assert not paused(engine, "bill")
        page.goto(base + "/confirm?action=pause&consumer=bill")
        page.evaluate("document.querySelector('#confirm-form input[name=csrf]').value = '00ff'")
        page.locator("#confirm").click()
        expect(page.locator("h1")).to_have_text("Refused")
        assert not paused(engine, "bill")
        status = page.evaluate("""async () => (await fetch('/actions/pause', {method: 'POST',
            body: new URLSearchParams({consumer: 'bill'})})).status""")
        assert status == 403
        assert not paused(engine, "bill")


def test_read_only_hides_and_refuses_actions(engine, page):
    s = seed(engine)
    dead = s.jobs["mail"]["dead"]
    with served(engine, read_only=True) as base:
        page.goto(base + "/consumers/mail")
        expect(page.locator("#read-only")).to_be_visible()
        expect(page.locator("#jobs tr[data-job]")).to_have_count(2)
        assert page.locator("a.action").count() == 0
        page.goto(base + f"/confirm?action=redrive&consumer=mail&job={dead[0]}")
        expect(page.locator("#error")).to_contain_text("read-only")
        status = page.evaluate(f"""async () => (await fetch('/actions/redrive', {{method: 'POST',
            body: new URLSearchParams({{consumer: 'mail', job: '{dead[0]}'}})}})).status""")
        assert status == 403
    assert statuses(engine, dead) == ["dead", "dead"]


def test_relays_page_lists_the_registry(engine, page):
    seed(engine)
    with served(engine) as base:
        page.goto(base + "/relays")
        row = page.locator('#relays tr[data-relay="host-a:1:x"]')
        expect(row).to_contain_text("host-a")
        expect(row).to_contain_text("bill, mail, ship")
        shot(page, "relays")


def test_the_overview_says_the_database_is_down_and_recovers(db_url, page):
    proxy = TcpProxy(database_target(db_url))
    proxy.start()
    engine = make_engine(through(db_url, proxy))  # the embedded server too: not around the proxy by its socket
    try:
        seed(engine)
        with served(engine, refresh_seconds=0.5) as base:
            page.goto(base + "/")
            expect(cell(page, "mail", "dead")).to_have_text("2")
            proxy.stop()
            expect(page.locator("#db-down")).to_contain_text("cannot reach the database")
            proxy.start()
            expect(cell(page, "mail", "dead")).to_have_text("2")  # the same page, polling on
            expect(page.locator("#db-down")).to_have_count(0)
    finally:
        proxy.stop()
        engine.dispose()


def test_a_rebinding_name_gets_the_wrong_address_page(engine, page):
    """Issue 26, item 4: a site whose name resolves to 127.0.0.1 (here by the browser's
    resolver rules) got the dashboard's pages, cookie and CSRF token, and could act. Now its
    pages are a 400 "Wrong address" page with no cookie, and its script's POST is refused."""
    s = seed(engine)
    job = s.jobs["bill"]["ready"][0]
    with served(engine) as base:
        port = base.rsplit(":", 1)[1]
        attacker = f"http://{REBIND}:{port}"
        answer = page.goto(f"{attacker}/confirm?action=cancel&consumer=bill&job={job}")
        assert answer is not None and answer.status == 400
        expect(page.locator("h1")).to_have_text("Wrong address")
        expect(page.locator("#error")).to_contain_text(f"127.0.0.1:{port}")
        assert page.locator("input[name=csrf]").count() == 0
        assert page.context.cookies(attacker) == []
        answer = page.goto(f"{attacker}/events/{s.events[0]}")
        assert answer is not None and answer.status == 400
        expect(page.locator("main")).not_to_contain_text("total_cents")
        status = page.evaluate(f"""async () => (await fetch('/actions/cancel', {{method: 'POST',
            body: new URLSearchParams({{consumer: 'bill', job: '{job}'}})}})).status""")
        assert status == 400
        assert statuses(engine, [job]) == ["ready"]
        page.goto(base + "/")  # the dashboard's own address still serves
        expect(page.locator("h1")).to_have_text("Overview")
    assert page.dialogs == []


def test_a_form_posted_from_another_origin_is_refused(engine, page):
    """A page of another origin on the same site (another port of 127.0.0.1: the session
    cookie, SameSite=Strict, goes along), holding a valid CSRF token as a rebinding attack
    would have read it, posts the pause form: 403, nothing paused. The same form from the
    dashboard's own page works (the browser sends its Origin; ``Referrer-Policy:
    same-origin``, as ``no-referrer`` made it send ``Origin: null``)."""
    seed(engine)
    with served(engine) as base:
        page.goto(base + "/confirm?action=pause&consumer=bill")
        token = page.locator("#confirm-form input[name=csrf]").get_attribute("value")
        other = "http://127.0.0.1:9/attack"  # never listened on: the test's route answers it
        page.route(other, lambda route: route.fulfill(content_type="text/html", body=f"""<!doctype html>
            <form method="post" action="{base}/actions/pause"><input type="hidden" name="consumer" value="bill">
            <input type="hidden" name="csrf" value="{token}"><button id="go">win a prize</button></form>"""))
        page.goto(other)
        with page.expect_response(lambda r: r.url == f"{base}/actions/pause") as answer:
            page.locator("#go").click()
        assert answer.value.status == 403
        expect(page.locator("#error")).to_contain_text("was not sent from the dashboard")
        assert not paused(engine, "bill")
        page.goto(base + "/confirm?action=pause&consumer=bill")
        page.locator("#confirm").click()
        expect(page.locator("#pause-state .tag.paused")).to_contain_text("paused since")
        assert paused(engine, "bill")


def test_wrong_tokens_hold_the_sign_in_then_the_right_one_signs_in(engine, page):
    """With a token: six wrong ones typed into the sign-in page are refused, the next
    attempt, and then the right token, are held ("Too many wrong sign-ins", no cookie); once
    the hold is over (the test moves the hold's clock) the right token signs in, and actions
    (same-origin POSTs) and sign-out work."""
    from pydantic import SecretStr

    from outbox.ops.dashboard import DashboardAuth
    from outbox.ops.dashboard.throttle import LoginThrottle

    seed(engine)
    secret = "0123456789abcdef-browser"
    clock = Clock()
    with served(engine, auth=DashboardAuth(token=SecretStr(secret)), throttle=LoginThrottle(clock=clock)) as base:
        page.goto(base + "/")
        for i in range(6):
            page.fill("#login input[name=token]", f"wrong-{i}-0123456789abcdef")
            with page.expect_response(lambda r: r.url == f"{base}/login" and r.request.method == "POST") as answer:
                page.locator("#login button").click()
            assert answer.value.status == 401
            expect(page.locator("#wrong")).to_be_visible()
        page.fill("#login input[name=token]", "wrong-7-0123456789abcdef")
        page.locator("#login button").click()
        expect(page.locator("#held")).to_contain_text("Too many wrong sign-ins from your address: try again in 1 s")
        page.fill("#login input[name=token]", secret)
        with page.expect_response(lambda r: r.url == f"{base}/login" and r.request.method == "POST") as answer:
            page.locator("#login button").click()
        assert answer.value.status == 429
        expect(page.locator("#held")).to_be_visible()
        assert [c for c in page.context.cookies(base) if c["name"] == "outbox_auth"] == []
        clock.now += 1
        page.fill("#login input[name=token]", secret)
        page.locator("#login button").click()
        expect(page.locator("h1")).to_have_text("Overview")
        page.goto(base + "/confirm?action=pause&consumer=ship")
        page.locator("#confirm").click()
        expect(page.locator("#pause-state .tag.paused")).to_contain_text("paused since")
        assert paused(engine, "ship")
        page.locator("header form.logout button").click()
        expect(page.locator("#login")).to_be_visible()
        assert page.goto(base + "/relays").status == 401
