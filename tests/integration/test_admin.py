"""The operator's API and commands (outbox.admin; ``outbox-relay status``, ``relays``,
``cancel``, ``retry``, ``replay``, ``purge``, ``prune``) against seeded databases, each
checked against the rows it should have changed."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from outbox import Job, Outbox, admin, publish
from outbox.db.jobs import claim_jobs, complete_jobs, fail_jobs
from outbox.db.retention import prune
from outbox.errors import AdminError
from outbox.ops.cli import main
from outbox.relay.maintenance import reap_expired
from outbox.relay.outcomes import Failure
from outbox.relay.router import route_all
from outbox.testing import wait_for

from .helpers import expire_lease, job_row, publish_events, running_relay, subscribe


def _url(db_url) -> list[str]:
    return ["--database-url", db_url.render_as_string(hide_password=False)]


def _statuses(engine: sa.Engine, consumer: str) -> dict[int, str]:
    with engine.connect() as c:
        return dict(c.execute(sa.text("SELECT id, status FROM outbox_jobs WHERE consumer = :c ORDER BY id"),
                              {"c": consumer}).all())


def _cli_json(capsys, *argv: str) -> object:
    capsys.readouterr()
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


# --------------------------------------------------------------------------- status


def test_status_counts_lag_blocked_keys_and_unsubscribed_topics(engine, db_url, capsys):
    subscribe(engine, "order.placed", ["mail", "bill"])
    publish_events(engine, "order.placed", [{"n": i} for i in range(6)])
    publish_events(engine, "order.plcaed", [{"n": 1}, {"n": 2}])  # a misspelled topic
    route_all(engine)
    publish_events(engine, "order.placed", [{"n": 99}])  # left unrouted
    with engine.begin() as c:
        ids = list(c.execute(sa.text("SELECT id FROM outbox_jobs WHERE consumer = 'mail' ORDER BY id")).scalars())
        c.execute(sa.text("UPDATE outbox_jobs SET status = 'done', finished_at = now() WHERE id = ANY(:i)"),
                  {"i": ids[:2]})
        c.execute(sa.text("UPDATE outbox_jobs SET status = 'dead', finished_at = now(), ordering_key = 'k' "
                          "WHERE id = :i"), {"i": ids[2]})
        c.execute(sa.text("UPDATE outbox_jobs SET run_at = now() - interval '90 seconds' WHERE consumer = 'bill'"))
    capsys.readouterr()
    state = _cli_json(capsys, "status", "--json", *_url(db_url))
    by = {c["consumer"]: c for c in state["consumers"]}
    assert {k: by["mail"][k] for k in ("ready", "running", "dead", "done", "blocked_keys", "subscribed")} == {
        "ready": 3, "running": 0, "dead": 1, "done": 2, "blocked_keys": 1, "subscribed": True}
    assert by["bill"]["ready"] == 6 and by["bill"]["lag_seconds"] >= 90
    assert state["unrouted"] == 1 and state["unrouted_oldest_seconds"] >= 0
    assert [(t["topic"], t["events"]) for t in state["unsubscribed"]] == [("order.plcaed", 2)]
    assert state["done_exact"] is True and state["unsubscribed_complete"] is True
    assert main(["status", *_url(db_url)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("unrouted events: 1") and "no subscription for topic 'order.plcaed': 2" in out
    assert out.splitlines()[2].split()[:7] == ["bill", "6", "0", "0", "0", "0", "0"]


# --------------------------------------------------------------------------- cancel


def test_cancel_ready_jobs_by_id_and_by_consumer_then_pruned_like_done(engine, db_url, capsys):
    subscribe(engine, "t", ["a", "b"])
    publish_events(engine, "t", [{"n": i} for i in range(4)])
    route_all(engine)
    a = sorted(_statuses(engine, "a"))
    assert main(["cancel", str(a[0]), str(a[1]), "999999", *_url(db_url)]) == 0
    out = capsys.readouterr().out
    assert f"cancelled 2 jobs: [{a[0]}, {a[1]}]" in out and "not cancelled (no such job, or finished): [999999]" in out
    assert list(_statuses(engine, "a").values()) == ["cancelled", "cancelled", "ready", "ready"]
    assert main(["cancel", str(a[0]), *_url(db_url)]) == 1  # already cancelled: nothing matched
    assert "no job cancelled" in capsys.readouterr().err
    result = _cli_json(capsys, "cancel", "--consumer", "b", "--status", "ready", "--json", *_url(db_url))
    assert len(result["cancelled"]) == 4 and result["requested"] == []
    assert set(_statuses(engine, "b").values()) == {"cancelled"}
    with engine.begin() as c:  # cancelled jobs are pruned like done ones
        jobs, _ = prune(c, done_older_than=0, events_older_than=3600)
    assert jobs == 6 and list(_statuses(engine, "a").values()) == ["ready", "ready"]


def test_cancelling_an_ordered_head_lets_the_next_job_of_its_key_go(engine):
    subscribe(engine, "o", ["ord"], ordered=True)
    with Session(engine) as s, s.begin():
        for i in range(3):
            publish(s, "o", {"n": i}, key="k")
    route_all(engine)
    ids = sorted(_statuses(engine, "ord"))
    assert list(_statuses(engine, "ord").values()) == ["ready", "pending", "pending"]
    result = admin.cancel(engine, [ids[0]])
    assert result.cancelled == [ids[0]] and result.promoted == [ids[1]]
    assert list(_statuses(engine, "ord").values()) == ["cancelled", "ready", "pending"]


def test_cancel_of_a_running_job_reaches_its_handler_and_records_cancelled(engine, settings, capsys, db_url):
    seen: list[Job] = []
    saw: list[bool] = []
    started = threading.Event()

    ob = Outbox()

    @ob.subscriber("slow", consumer="slow", lease=1.5)
    def slow(job: Job) -> None:
        seen.append(job)
        started.set()
        deadline = time.monotonic() + 30
        while not job.cancel_requested and time.monotonic() < deadline:
            job.wait_lease_lost(0.05)
        saw.append(job.cancel_requested)  # then returns normally: the outcome is a completion

    publish_events(engine, "slow", [{"n": 1}])
    with running_relay(ob, settings(concurrency=1, prefetch=0)):
        assert started.wait(30)
        job_id = seen[0].id
        assert main(["cancel", "--consumer", "slow", *_url(db_url)]) == 0
        assert f"asked 1 running job to stop (cancelled when the attempt ends): [{job_id}]" in capsys.readouterr().out
        assert job_row(engine, job_id)["status"] == "running"  # the claim is the worker's until it reports
        wait_for(lambda: job_row(engine, job_id)["status"] == "cancelled", timeout=30, what="outcome cancelled")
    assert saw == [True]  # the handler learnt it from the heartbeat
    row = job_row(engine, job_id)
    assert row["cancel_requested"] and row["finished_at"] is not None and row["attempts"] == 1
    with engine.begin() as c:  # a stale worker's completion afterwards changes nothing
        assert complete_jobs(c, [seen[0]]) == set()
    assert job_row(engine, job_id)["status"] == "cancelled"


def test_a_running_job_cancelled_then_reaped_ends_cancelled_and_its_old_claim_is_stale(engine):
    subscribe(engine, "t", ["a"])
    publish_events(engine, "t", [{"n": 1}])
    route_all(engine)
    with engine.begin() as c:
        [job] = claim_jobs(c, {"a": 30.0}, 1, "w1")
    assert admin.cancel(engine, [job.id]).requested == [job.id]
    with engine.begin() as c:
        expire_lease(c, job.id)
    with engine.begin() as c:
        reap_expired(c)
    assert job_row(engine, job.id)["status"] == "cancelled"
    with engine.begin() as c:  # the worker that lost the lease reports a failure: nothing changes
        assert fail_jobs(c, [(job, Failure(delay=0.0, permanent=False, error="x"))]) == {}
    assert job_row(engine, job.id)["status"] == "cancelled"


# ---------------------------------------------------------------------------- retry


def test_retry_makes_jobs_in_backoff_due_now(engine, db_url, capsys):
    subscribe(engine, "t", ["a"])
    publish_events(engine, "t", [{"n": i} for i in range(3)])
    route_all(engine)
    ids = sorted(_statuses(engine, "a"))
    with engine.begin() as c:
        c.execute(sa.text("UPDATE outbox_jobs SET attempts = 1, run_at = now() + interval '1 hour' WHERE id = ANY(:i)"),
                  {"i": ids[:2]})
        c.execute(sa.text("UPDATE outbox_jobs SET run_at = now() + interval '1 hour' WHERE id = :i"), {"i": ids[2]})
    result = _cli_json(capsys, "retry", "--consumer", "a", "--json", *_url(db_url))
    assert result == {"ids": ids[:2], "unchanged": []}  # the delayed publish (attempts 0) keeps its run_at
    with engine.connect() as c:
        due = c.execute(sa.text("SELECT id FROM outbox_jobs WHERE run_at <= now() ORDER BY id")).scalars().all()
    assert due == ids[:2] and job_row(engine, ids[0])["attempts"] == 1
    assert main(["retry", "--consumer", "a", *_url(db_url)]) == 1
    assert "no job made due" in capsys.readouterr().err
    assert main(["retry", str(ids[2]), *_url(db_url)]) == 0  # named: a delayed job too
    assert main(["retry", *_url(db_url)]) == 2


# --------------------------------------------------------------------------- replay


def _replay_seed(engine: sa.Engine, n: int) -> list[int]:
    """``n`` events on ``t`` routed while only ``old`` subscribed, then ``late`` subscribes."""
    subscribe(engine, "t", ["old"])
    ids = publish_events(engine, "t", [{"n": i} for i in range(n)])
    route_all(engine)
    subscribe(engine, "t", ["old", "late"])
    return ids


def test_replay_creates_the_missing_jobs_once_even_run_twice_at_the_same_time(engine, db_url, capsys):
    ids = _replay_seed(engine, 600)
    results: list[admin.ReplayResult] = []
    barrier = threading.Barrier(2)

    def run() -> None:
        barrier.wait()
        results.append(admin.replay(engine, "late", from_event=ids[0], batch=50))

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sum(r.created for r in results) == 600 and all(r.scanned == 600 for r in results)
    with engine.connect() as c:
        per_event = c.execute(sa.text("SELECT count(*), count(DISTINCT event_id) FROM outbox_jobs "
                                      "WHERE consumer = 'late'")).one()
    assert tuple(per_event) == (600, 600)
    again = _cli_json(capsys, "replay", "--consumer", "late", "--since", "1h", "--json", *_url(db_url))
    assert (again["created"], again["scanned"]) == (0, 600)


def test_replay_window_and_topic(engine):
    ids = _replay_seed(engine, 10)
    result = admin.replay(engine, "late", from_event=ids[2], until_event=ids[4], batch=2)
    assert (result.created, result.scanned) == (3, 3)
    with engine.connect() as c:
        got = c.execute(sa.text("SELECT event_id FROM outbox_jobs WHERE consumer = 'late' ORDER BY 1")).scalars().all()
    assert got == ids[2:5]
    with pytest.raises(AdminError, match="does not subscribe to topic 'u'"):
        admin.replay(engine, "late", from_event=ids[0], topic="u")
    with pytest.raises(AdminError, match="has no subscription"):
        admin.replay(engine, "nobody", from_event=ids[0])


def test_replay_after_pruning_is_refused(engine, db_url, capsys):
    publish_events(engine, "t", [{"n": i} for i in range(5)])  # routed with no subscriber: no job
    route_all(engine)
    with engine.begin() as c:
        assert prune(c, done_older_than=0, events_older_than=0) == (0, 5)
    kept = publish_events(engine, "t", [{"n": 9}])
    subscribe(engine, "t", ["late"])
    route_all(engine)
    assert main(["replay", "--consumer", "late", "--from-event", "1", *_url(db_url)]) == 2
    err = capsys.readouterr().err
    assert f"events from 1 to {kept[0] - 1} are no longer retained (pruned)" in err and len(err.splitlines()) == 1
    assert main(["replay", "--consumer", "late", "--since", "1h", *_url(db_url)]) == 2
    assert "earlier events existed: they were pruned" in capsys.readouterr().err
    assert main(["replay", "--consumer", "late", "--since", "30d", *_url(db_url)]) == 2
    assert "older than the events retention" in capsys.readouterr().err
    with engine.connect() as c:
        assert c.execute(sa.text("SELECT count(*) FROM outbox_jobs")).scalar_one() == 1  # the router's, nothing more


def test_replay_to_an_ordered_consumer_is_refused(engine):
    ids = publish_events(engine, "t", [{"n": 1}])
    route_all(engine)
    subscribe(engine, "t", ["ord"], ordered=True)
    with pytest.raises(AdminError, match="is ordered on t"):
        admin.replay(engine, "ord", from_event=ids[0])


# ----------------------------------------------------------------------------- jobs


def _jobs_seed(engine: sa.Engine) -> dict[str, list[int]]:
    """Jobs of consumers ``mail`` and ``bill`` for events with keys ``k1`` (3), ``k2`` (2) and
    none (1); ``mail``'s second job dead, its third done; ``bill``'s first two created two
    hours ago. Returns each consumer's job ids in id order."""
    subscribe(engine, "order.placed", ["mail", "bill"])
    with Session(engine) as s, s.begin():
        for key in ("k1", "k1", "k2", "k1", "k2", None):
            publish(s, "order.placed", {"key": key}, key=key)
    route_all(engine)
    ids = {c: list(_statuses(engine, c)) for c in ("mail", "bill")}
    with engine.begin() as c:
        c.execute(sa.text("UPDATE outbox_jobs SET status = 'dead', finished_at = now(), last_error = 'E: boom\nline 2' "
                          "WHERE id = :i"), {"i": ids["mail"][1]})
        c.execute(sa.text("UPDATE outbox_jobs SET status = 'done', finished_at = now() WHERE id = :i"),
                  {"i": ids["mail"][2]})
        c.execute(sa.text("UPDATE outbox_jobs SET created_at = now() - interval '2 hours' WHERE id = ANY(:i)"),
                  {"i": ids["bill"][:2]})
    return ids


def test_list_jobs_by_every_filter(engine):
    ids = _jobs_seed(engine)
    mail, bill = ids["mail"], ids["bill"]

    def listed(**filters) -> list[int]:
        with engine.connect() as c:
            page = admin.list_jobs(c, **filters)
        assert page.next_after is None
        return [j.id for j in page.jobs]

    assert listed() == sorted(mail + bill)
    assert listed(consumer="mail") == mail
    assert listed(statuses=["dead"]) == [mail[1]]
    assert listed(statuses=["dead", "done"]) == [mail[1], mail[2]]
    assert listed(consumer="bill", statuses=["dead"]) == []
    assert listed(key="k2") == sorted([mail[2], mail[4], bill[2], bill[4]])
    assert listed(key="k2", consumer="bill") == [bill[2], bill[4]]
    with engine.connect() as c:
        event = c.execute(sa.text("SELECT event_id FROM outbox_jobs WHERE id = :i"), {"i": mail[3]}).scalar_one()
    assert listed(event_id=event) == sorted([mail[3], bill[3]])
    assert listed(older_than=3600) == bill[:2]
    assert listed(newer_than=3600) == sorted(mail + bill[2:])
    assert listed(older_than=60, newer_than=3 * 3600) == bill[:2]
    assert listed(after=mail[4]) == [j for j in sorted(mail + bill) if j > mail[4]]
    with engine.connect() as c:
        [dead] = admin.list_jobs(c, statuses=["dead"]).jobs
    assert (dead.consumer, dead.status, dead.topic, dead.key, dead.last_error) == (
        "mail", "dead", "order.placed", "k1", "E: boom\nline 2")


def test_list_jobs_refuses_bad_arguments_naming_them(engine):
    with engine.connect() as c:
        for arguments, fragment in [
            ({"statuses": ["deadd"]}, "status must be among"), ({"statuses": []}, "status must be among"),
            ({"consumer": ""}, "consumer must be"), ({"key": "a\x00b"}, "key must be"),
            ({"event_id": 0}, "event_id must be an id"), ({"after": 2**63}, "after must be an id"),
            ({"older_than": -1}, "older_than must be"), ({"newer_than": float("nan")}, "newer_than must be"),
            ({"older_than": float("inf")}, "older_than must be"),
            ({"older_than": 60, "newer_than": 60}, "no job is both older than 60 s and newer than 60 s"),
            ({"limit": 0}, "limit must be between 1 and 1000"), ({"limit": 1001}, "limit must be"),
        ]:
            with pytest.raises(AdminError, match=fragment):
                admin.list_jobs(c, **arguments)


def test_jobs_command_pages_without_gaps_or_repeats_while_new_jobs_arrive(engine, db_url, capsys):
    subscribe(engine, "t", ["a", "b"])
    publish_events(engine, "t", [{"n": i} for i in range(9)])
    route_all(engine)
    seen: list[int] = []
    after: list[str] = []
    pages = 0
    while True:
        page = _cli_json(capsys, "jobs", "--consumer", "a", "--limit", "4", "--json", *after, *_url(db_url))
        assert set(page) == {"jobs", "next_after"} and len(page["jobs"]) <= 4
        assert all(j["consumer"] == "a" and j["topic"] == "t" for j in page["jobs"])
        seen += [j["id"] for j in page["jobs"]]
        pages += 1
        if pages <= 3:  # new jobs arrive while the operator pages
            publish_events(engine, "t", [{"n": 100 + pages}, {"n": 200 + pages}])
            route_all(engine)
        if page["next_after"] is None:
            break
        assert page["next_after"] == seen[-1]
        after = ["--after", str(page["next_after"])]
    assert seen == sorted(set(seen)) == list(_statuses(engine, "a"))  # every job once, in order
    assert len(seen) == 15 and pages == 4


def test_jobs_command_text_table_cursor_and_nothing_matched(engine, db_url, capsys):
    ids = _jobs_seed(engine)
    capsys.readouterr()
    assert main(["jobs", "--consumer", "mail", "--limit", "2", *_url(db_url)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:5] == ["job", "event", "consumer", "status", "attempts"]
    assert [line.split()[0] for line in lines[1:3]] == [str(i) for i in ids["mail"][:2]]
    assert lines[2].split()[2:5] == ["mail", "dead", "0/5"] and lines[2].endswith("k1                       E: boom")
    assert lines[3] == f"next page: --after {ids['mail'][1]}" and len(lines) == 4
    assert main(["jobs", "--status", "dead", "--status", "done", "--older-than", "0", "--newer-than", "1h",
                 *_url(db_url)]) == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:]] == [str(i) for i in ids["mail"][1:3]]
    assert main(["jobs", "--key", "k2", "--older-than", "90m", *_url(db_url)]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err == "outbox-relay: no job matches\n"
    assert main(["jobs", "--consumer", "mail", "--after", str(ids["mail"][-1]), "--json", *_url(db_url)]) == 1
    assert capsys.readouterr().err == f"outbox-relay: no job matches after job {ids['mail'][-1]}\n"


# ---------------------------------------------------------------------------- purge


def test_purge_needs_yes_and_no_subscription(engine, db_url, capsys):
    subscribe(engine, "t", ["gone", "kept"])
    publish_events(engine, "t", [{"n": i} for i in range(3)])
    route_all(engine)
    assert main(["purge", "gone", "--yes", *_url(db_url)]) == 2
    assert "still subscribes to t" in capsys.readouterr().err
    assert main(["unsubscribe", "gone", *_url(db_url)]) == 0
    assert main(["purge", "gone", *_url(db_url)]) == 2
    assert "add --yes" in capsys.readouterr().err
    assert _cli_json(capsys, "purge", "gone", "--yes", "--json", *_url(db_url)) == {
        "consumer": "gone", "deleted": 3, "running": 0}
    assert _statuses(engine, "gone") == {} and len(_statuses(engine, "kept")) == 3
    assert main(["purge", "gone", "--yes", *_url(db_url)]) == 1


# ----------------------------------------------------------------------- prune, cli


def test_prune_now_and_the_command_words(engine, db_url, capsys):
    subscribe(engine, "t", ["a"])
    publish_events(engine, "t", [{"n": 1}, {"n": 2}])
    route_all(engine)
    with engine.begin() as c:
        c.execute(sa.text("UPDATE outbox_jobs SET status = 'done', finished_at = now() - interval '1 hour'"))
    assert _cli_json(capsys, "prune", "--retention-done", "60", "--retention-events", "0", "--json",
                     *_url(db_url)) == {"jobs": 2, "events": 2, "relays": 0}
    assert main(["blocked-keys", *_url(db_url)]) == 2
    assert "unknown command 'blocked-keys'" in capsys.readouterr().err
    assert main(["redrive", "--all", *_url(db_url)]) == 1
    assert capsys.readouterr().err.strip() == "outbox-relay: no job redriven: no dead job"


@pytest.mark.skipif(shutil.which("psql") is None, reason="psql is not installed")
def test_psql_passes_its_arguments(db_url):
    result = subprocess.run([sys.executable, "-m", "outbox.ops.cli", "psql", *_url(db_url), "-At", "-c", "select 40 + 2"],
                            capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout.strip()) == (0, "42"), result.stderr


# --------------------------------------------------------------------------- relays

APP = '''
from outbox import Outbox

ob = Outbox()


@ob.subscriber("t", consumer="first")
def first(job):
    pass


@ob.subscriber("t", consumer="second")
def second(job):
    pass
'''


def test_relays_registry_shows_a_killed_relay_gone(engine, db_url, tmp_path: Path, capsys):
    (tmp_path / "regapp.py").write_text(textwrap.dedent(APP))
    environ = {**os.environ, "OUTBOX_DATABASE_URL": db_url.render_as_string(hide_password=False)}
    environ.pop("OUTBOX_TEST_DATABASE_URL", None)
    log = open(tmp_path / "relay.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "outbox.ops.cli", "run", "--app", "regapp:ob", "--concurrency", "3"],
                            cwd=tmp_path, env=environ, stdout=log, stderr=subprocess.STDOUT)
    try:
        def registered() -> list[admin.RelayStatus]:
            with engine.connect() as c:
                return [r for r in admin.relays(c) if r.pid == proc.pid]

        [live] = wait_for(registered, timeout=30, what="the relay's row")
        assert (live.consumers, live.concurrency, live.gone) == (["first", "second"], 3, False)
        assert live.version and live.version != "unknown"
        listed = _cli_json(capsys, "relays", "--json", *_url(db_url))
        assert [r["pid"] for r in listed] == [proc.pid] and listed[0]["gone"] is False
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

        def shown_gone() -> bool:
            capsys.readouterr()
            assert main(["relays", "--gone-after", "1", "--json", *_url(db_url)]) == 0
            rows = json.loads(capsys.readouterr().out)
            return [(r["pid"], r["gone"]) for r in rows] == [(proc.pid, True)]

        wait_for(shown_gone, timeout=30, what="the killed relay shown gone")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()
    assert main(["relays", "--gone-after", "1", *_url(db_url)]) == 0
    assert " gone " in capsys.readouterr().out
    with engine.begin() as c:  # the pruner forgets it once it was gone long enough (here: at once)
        c.execute(sa.text("UPDATE outbox_relays SET last_seen_at = now() - interval '1 hour'"))
    assert admin.prune_now(engine, done_older_than=3600, events_older_than=3600).relays == 1
    assert main(["relays", *_url(db_url)]) == 1


# ------------------------------------------------------------------------- job and event ids

BIGINT_MAX = 2**63 - 1


def test_every_id_argument_takes_the_bigint_range_and_refuses_beyond_it_alike(engine, db_url, capsys):
    """Ids are bigint: cancel, retry, redrive, skip and replay's --from-event / --until-event
    accept any id up to 2**63 - 1 (a big one matches nothing: status 1, or replay's own
    refusal), and refuse 0, -1 and 2**64-sized ids with the same argparse range error (status
    2) before any statement runs (before, redrive sent 2**66 to the database: "bigint out of
    range")."""
    _replay_seed(engine, 2)
    big = str(3_000_000_000)
    for command in (["cancel", big], ["retry", big], ["redrive", big], ["cancel", str(BIGINT_MAX)]):
        capsys.readouterr()
        assert main([*command, *_url(db_url)]) == 1, command
        assert "Traceback" not in capsys.readouterr().err
    assert main(["replay", "--consumer", "late", "--from-event", big, *_url(db_url)]) == 2
    assert "no event from 3000000000 on" in capsys.readouterr().err
    assert _cli_json(capsys, "replay", "--consumer", "late", "--from-event", "1", "--until-event", str(BIGINT_MAX),
                     "--json", *_url(db_url))["created"] == 2
    for bad in ("0", "-1", str(BIGINT_MAX + 1), "99999999999999999999"):
        for command in (["cancel", bad], ["retry", bad], ["redrive", bad], ["skip", bad],
                        ["replay", "--consumer", "late", "--from-event", bad],
                        ["replay", "--consumer", "late", "--from-event", "1", "--until-event", bad]):
            capsys.readouterr()
            with pytest.raises(SystemExit) as exited:
                main([*command, *_url(db_url)])
            err = capsys.readouterr().err
            assert exited.value.code == 2, command
            assert f"must be between 1 and {BIGINT_MAX}, got {bad}" in err, (command, err)
            assert "Traceback" not in err and "bigint" not in err
    assert set(_statuses(engine, "old").values()) == {"ready"}  # nothing was changed


@pytest.mark.parametrize("since", ["9999999999h", "99999999999999999999d", "1" * 400 + "s"])
def test_replay_since_an_age_beyond_any_date_is_one_line(db_url, capsys, since):
    capsys.readouterr()
    assert main(["replay", "--consumer", "x", "--since", since, *_url(db_url)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("outbox-relay: error: --since: ") and "reaches before the year 1" in err
