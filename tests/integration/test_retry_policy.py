"""Retry policy per subscriber on a real PostgreSQL, through the relay's executor and fail
statement (drain, and a running relay): a failure in ``retry_on`` goes back to ready at
``now() + the policy's delay``; one not in it, or in ``dead_on``, is dead at attempt 1 with
the rule named in ``last_error``; two consumers of one topic wait their own delays;
PermanentError and a payload that does not validate stay dead at once; a timeout is
retried whatever ``retry_on`` says."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import sqlalchemy as sa
from pydantic import BaseModel

from outbox import Backoff, Outbox, PermanentError
from outbox.testing import drain, wait_for
from tests.integration.helpers import job_row, publish_events, running_relay


class Flaky(ConnectionError):
    """A subclass of a retry_on type: retried."""


def jobs_of(engine: sa.Engine, consumer: str) -> list[dict]:
    with engine.connect() as c:
        return [dict(r) for r in c.execute(sa.text(
            "SELECT id, status, attempts, run_at - updated_at AS wait, last_error FROM outbox_jobs "
            "WHERE consumer = :c ORDER BY id"), {"c": consumer}).mappings()]


def raising(exc: BaseException):
    def handler(job) -> None:
        raise exc
    return handler


def test_a_failure_in_retry_on_waits_the_policys_delay(engine, settings):
    ob = Outbox()
    ob.subscriber("t", consumer="retried", retry_on=ConnectionError, backoff=Backoff(base=100, cap=1000, jitter=0))(
        raising(Flaky("refused")))
    publish_events(engine, "t", [{}])
    [result] = drain(engine, ob, settings=settings())
    assert result.outcome == "retried"
    [job] = jobs_of(engine, "retried")
    # run_at = now() + delay and updated_at = now() in the one fail statement: the delay exactly
    assert (job["status"], job["attempts"], job["wait"]) == ("ready", 1, timedelta(seconds=100))
    assert job["last_error"].startswith("Flaky: refused")


def test_a_failure_not_in_retry_on_is_dead_at_attempt_one_naming_the_rule(engine, settings):
    ob = Outbox()
    ob.subscriber("t", consumer="picky", retry_on=(ConnectionError, TimeoutError), max_attempts=5)(
        raising(ValueError("bad input")))
    publish_events(engine, "t", [{}])
    [result] = drain(engine, ob, settings=settings())
    assert (result.outcome, result.attempt) == ("dead", 1)
    [job] = jobs_of(engine, "picky")
    assert (job["status"], job["attempts"]) == ("dead", 1)
    first, second = job["last_error"].splitlines()[:2]
    assert first == "dead at once: ValueError is not in retry_on (ConnectionError, TimeoutError)"
    assert second == "ValueError: bad input"


def test_dead_on_is_dead_at_once_and_wins_over_retry_on(engine, settings):
    ob = Outbox()
    ob.subscriber("t", consumer="strict", retry_on=OSError, dead_on=FileNotFoundError, max_attempts=5)(
        raising(FileNotFoundError("no such file")))
    ob.subscriber("t", consumer="loose", dead_on=KeyError, max_attempts=5,
                  backoff=Backoff(base=50, cap=50, jitter=0))(raising(FileNotFoundError("no such file")))
    publish_events(engine, "t", [{}])
    drain(engine, ob, settings=settings())
    [strict] = jobs_of(engine, "strict")
    assert (strict["status"], strict["attempts"]) == ("dead", 1)
    assert strict["last_error"].startswith(
        "dead at once: FileNotFoundError is in dead_on (FileNotFoundError)\nFileNotFoundError: no such file")
    [loose] = jobs_of(engine, "loose")  # not in its dead_on: retried, with its own backoff
    assert (loose["status"], loose["attempts"], loose["wait"]) == ("ready", 1, timedelta(seconds=50))


def test_two_consumers_of_one_topic_wait_their_own_delays(engine, settings):
    ob = Outbox()
    ob.subscriber("t", consumer="quick", backoff=Backoff(base=10, cap=10_000, jitter=0))(raising(RuntimeError("a")))
    ob.subscriber("t", consumer="patient", backoff=Backoff(base=1000, cap=10_000, jitter=0))(raising(RuntimeError("b")))
    ob.subscriber("t", consumer="default")(raising(RuntimeError("c")))  # the settings': base 0.05 s, cap 0.2 s
    publish_events(engine, "t", [{}])
    drain(engine, ob, settings=settings(backoff_jitter=0.0))
    assert jobs_of(engine, "quick")[0]["wait"] == timedelta(seconds=10)
    assert jobs_of(engine, "patient")[0]["wait"] == timedelta(seconds=1000)
    assert jobs_of(engine, "default")[0]["wait"] == timedelta(seconds=0.05)
    with engine.begin() as c:  # the second attempt of each doubles its own base
        c.execute(sa.text("UPDATE outbox_jobs SET run_at = now()"))
    drain(engine, ob, settings=settings(backoff_jitter=0.0))
    assert [jobs_of(engine, c)[0]["wait"] for c in ("quick", "patient", "default")] == [
        timedelta(seconds=20), timedelta(seconds=2000), timedelta(seconds=0.1)]


def test_jitter_takes_at_most_its_share_off(engine, settings):
    ob = Outbox()
    ob.subscriber("t", consumer="jittery", backoff=Backoff(base=100, cap=100, jitter=0.5))(raising(RuntimeError()))
    publish_events(engine, "t", [{} for _ in range(20)])
    drain(engine, ob, settings=settings())
    waits = [j["wait"].total_seconds() for j in jobs_of(engine, "jittery")]
    assert len(waits) == 20 and all(50 <= w <= 100 for w in waits), waits
    assert len(set(waits)) > 1


class Order(BaseModel):
    order_id: int


def test_permanent_error_and_an_invalid_payload_stay_dead_at_once_whatever_retry_on_says(engine, settings):
    ob = Outbox()
    ob.subscriber("t", consumer="permanent", retry_on=Exception, max_attempts=5)(raising(PermanentError("never")))
    ob.subscriber("t", consumer="typed", retry_on=Exception, max_attempts=5, payload=Order)(lambda job: None)
    publish_events(engine, "t", [{"order_id": "not a number"}])
    drain(engine, ob, settings=settings())
    [permanent] = jobs_of(engine, "permanent")
    assert (permanent["status"], permanent["attempts"]) == ("dead", 1)
    assert permanent["last_error"].startswith("PermanentError: never")  # the error as before: no rule line
    [typed] = jobs_of(engine, "typed")
    assert (typed["status"], typed["attempts"]) == ("dead", 1)
    assert "does not validate as Order" in typed["last_error"].splitlines()[0]


def test_a_timeout_is_retried_whatever_retry_on_says(engine, settings):
    ob = Outbox()

    @ob.subscriber("t", consumer="slow", retry_on=ValueError, timeout=0.1, max_attempts=3,
                   backoff=Backoff(base=30, cap=30, jitter=0))
    async def slow(job) -> None:
        await asyncio.sleep(5)

    publish_events(engine, "t", [{}])
    [result] = drain(engine, ob, settings=settings())
    assert result.outcome == "retried"
    [job] = jobs_of(engine, "slow")
    assert (job["status"], job["attempts"], job["wait"]) == ("ready", 1, timedelta(seconds=30))
    assert job["last_error"].startswith("HandlerTimeoutError")


def test_a_running_relay_applies_each_subscribers_policy(engine, settings):
    ob = Outbox()
    ob.subscriber("t", consumer="retried", retry_on=ConnectionError, backoff=Backoff(base=100, cap=1000, jitter=0))(
        raising(Flaky("refused")))
    ob.subscriber("t", consumer="dead", dead_on=ValueError, max_attempts=5)(raising(ValueError("bad")))
    ob.subscriber("t", consumer="other", retry_on=ConnectionError, max_attempts=5)(raising(KeyError("k")))
    [event] = publish_events(engine, "t", [{}])
    with running_relay(ob, settings()):
        wait_for(lambda: [j["attempts"] for c in ("retried", "dead", "other") for j in jobs_of(engine, c)] == [1, 1, 1]
                 and jobs_of(engine, "retried")[0]["status"] == "ready", timeout=20, what="one attempt of each")
    assert jobs_of(engine, "retried")[0]["wait"] == timedelta(seconds=100)
    [dead] = jobs_of(engine, "dead")
    assert dead["status"] == "dead" and dead["last_error"].startswith("dead at once: ValueError is in dead_on (ValueError)")
    [other] = jobs_of(engine, "other")
    assert other["status"] == "dead"
    assert other["last_error"].startswith("dead at once: KeyError is not in retry_on (ConnectionError)\nKeyError: 'k'")
    assert job_row(engine, other["id"])["event_id"] == event
