"""Retry policy per subscriber (outbox.retry): the delays of a Backoff filled from the
settings stay within [(1 - jitter) * d, d], d = min(cap, base * 2**(n-1)), for every attempt
up to 10**6 and every Backoff a declaration accepts, never overflowing; the bound grows with
the attempt; which exceptions are dead at once and what their error says; declarations
refused with the option named."""

from __future__ import annotations

import random

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from outbox import (
    Backoff,
    ConfigurationError,
    ForwardingError,
    HandlerTimeoutError,
    JetStream,
    LeaseLostError,
    Outbox,
    OutboxSettings,
    PermanentError,
    Snooze,
    UndeliverableError,
)
from outbox.retry import MAX_BACKOFF_SECONDS, RetryPolicy, policy_of
from tests.hypothesis_profiles import examples
from tests.unit.test_backoff import MAX_ATTEMPT, assert_within, exact_undelayed

attempts = st.integers(min_value=1, max_value=MAX_ATTEMPT)
seconds = st.floats(min_value=1e-3, max_value=MAX_BACKOFF_SECONDS)
maybe_seconds = st.none() | seconds
maybe_jitter = st.none() | st.floats(min_value=0.0, max_value=1.0)
# The settings' own ranges (backoff_base <= 86400, backoff_cap <= 30 days, base <= cap).
setting_pairs = st.tuples(st.floats(min_value=1e-3, max_value=86_400), st.floats(min_value=1e-3, max_value=30 * 86_400))


def S(**overrides: object) -> OutboxSettings:
    return OutboxSettings(_env_file=None, **overrides)


@st.composite
def backoffs(draw: st.DrawFn) -> Backoff:
    """Any Backoff a declaration accepts: each field given or left to the settings."""
    base, cap = draw(maybe_seconds), draw(maybe_seconds)
    if base is not None and cap is not None and base > cap:
        base, cap = cap, base
    return Backoff(base=base, cap=cap, jitter=draw(maybe_jitter))


def filled(backoff: Backoff, s: OutboxSettings) -> RetryPolicy | None:
    try:
        return policy_of(s, backoff)
    except ConfigurationError:
        # Only a Backoff whose base is above the settings' cap (or cap below their base) is refused.
        base = s.backoff_base if backoff.base is None else backoff.base
        cap = s.backoff_cap if backoff.cap is None else backoff.cap
        assert base > cap
        return None


@settings(max_examples=examples(400), deadline=None)
@given(attempt=attempts, backoff=backoffs(), pair=setting_pairs, jitter=st.floats(0.0, 1.0), seed=st.integers(0, 2**32))
@example(attempt=MAX_ATTEMPT, backoff=Backoff(base=1e-3, cap=MAX_BACKOFF_SECONDS, jitter=0.0), pair=(1.0, 3600.0),
         jitter=0.25, seed=0)
@example(attempt=MAX_ATTEMPT, backoff=Backoff(base=MAX_BACKOFF_SECONDS, cap=MAX_BACKOFF_SECONDS, jitter=1.0),
         pair=(1.0, 3600.0), jitter=0.25, seed=1)
@example(attempt=3, backoff=Backoff(), pair=(1.0, 3600.0), jitter=0.25, seed=2)
def test_every_delay_is_within_the_bound_of_the_filled_policy(attempt, backoff, pair, jitter, seed):
    base_setting, cap_setting = min(pair), max(pair)
    s = S(backoff_base=base_setting, backoff_cap=cap_setting, backoff_jitter=jitter)
    policy = filled(backoff, s)
    if policy is None:
        return
    assert policy.base == (base_setting if backoff.base is None else backoff.base)
    assert policy.cap == (cap_setting if backoff.cap is None else backoff.cap)
    assert policy.jitter == (jitter if backoff.jitter is None else backoff.jitter)
    delay = policy.delay(attempt, rng=random.Random(seed))
    assert_within(delay, attempt, policy.base, policy.cap, policy.jitter)


@settings(max_examples=examples(200), deadline=None)
@given(attempt=st.integers(1, MAX_ATTEMPT - 1), step=st.integers(1, 5000), backoff=backoffs(), seed=st.integers(0, 2**32))
def test_the_bound_grows_with_the_attempt_and_jitter_never_goes_below_it(attempt, step, backoff, seed):
    policy = filled(backoff, S())
    if policy is None:
        return
    later = min(attempt + step, MAX_ATTEMPT)
    assert exact_undelayed(attempt, policy.base, policy.cap) <= exact_undelayed(later, policy.base, policy.cap)
    without_jitter = RetryPolicy(base=policy.base, cap=policy.cap, jitter=0.0)
    assert without_jitter.delay(attempt) <= without_jitter.delay(later)
    # the jittered delay of the later attempt is never below (1 - jitter) of the earlier bound
    assert policy.delay(later, rng=random.Random(seed)) >= (1 - policy.jitter) * without_jitter.delay(attempt) * (1 - 1e-12)


def test_a_subscriber_without_backoff_takes_the_settings():
    ob = Outbox()
    ob.subscriber("t", consumer="plain")(lambda job: None)
    ob.subscriber("t", consumer="own", backoff=Backoff(base=10, cap=600))(lambda job: None)
    ob.subscriber("t", consumer="half", backoff=Backoff(jitter=0))(lambda job: None)
    policies = ob.retry_policies(S(backoff_base=2, backoff_cap=100, backoff_jitter=0.5))
    assert (policies["plain"].base, policies["plain"].cap, policies["plain"].jitter) == (2, 100, 0.5)
    assert (policies["own"].base, policies["own"].cap, policies["own"].jitter) == (10, 600, 0.5)
    assert (policies["half"].base, policies["half"].cap, policies["half"].jitter) == (2, 100, 0)
    assert policies["own"].delay(3) <= 40 and policies["own"].delay(3) >= 20


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"base": 0}, "base must be seconds"),
    ({"base": -1}, "base must be seconds"),
    ({"base": float("nan")}, "base must be seconds"),
    ({"cap": float("inf")}, "cap must be seconds"),
    ({"cap": MAX_BACKOFF_SECONDS * 2}, "cap must be seconds"),
    ({"base": True}, "base must be seconds"),
    ({"base": "1"}, "base must be seconds"),
    ({"jitter": 1.5}, "jitter must be a share"),
    ({"jitter": -0.1}, "jitter must be a share"),
    ({"base": 10, "cap": 5}, r"base \(10\) must not exceed cap \(5\)"),
])
def test_a_bad_backoff_is_refused_naming_the_field(kwargs, match):
    with pytest.raises(ConfigurationError, match=match):
        Backoff(**kwargs)


def test_a_backoff_that_does_not_fit_the_settings_is_refused_at_relay_start_naming_the_consumer():
    ob = Outbox()
    ob.subscriber("t", consumer="slow", backoff=Backoff(base=7200))(lambda job: None)
    with pytest.raises(ConfigurationError, match=r"subscriber 'slow': backoff base 7200 s exceeds the setting "
                                                  r"backoff_cap \(3600 s\): give Backoff a cap too"):
        ob.retry_policies(S())
    ob2 = Outbox()
    ob2.subscriber("t", consumer="fast", backoff=Backoff(cap=0.5))(lambda job: None)
    with pytest.raises(ConfigurationError, match="subscriber 'fast': backoff cap 0.5 s is below the setting backoff_base"):
        ob2.retry_policies(S())


@pytest.mark.parametrize(("options", "match"), [
    ({"backoff": 5}, "subscriber 'x': backoff must be a Backoff"),
    ({"retry_on": ValueError()}, "subscriber 'x': retry_on must be an exception type or a non-empty tuple"),
    ({"retry_on": ()}, "retry_on must be an exception type or a non-empty tuple of them, got an empty tuple"),
    ({"dead_on": (ValueError, "KeyError")}, "dead_on must be an exception type"),
    ({"dead_on": int}, "dead_on must be an exception type"),
    ({"retry_on": PermanentError}, "retry_on cannot name PermanentError: a PermanentError is always dead at once"),
    ({"retry_on": UndeliverableError}, "retry_on cannot name UndeliverableError"),
    ({"retry_on": Snooze}, "retry_on cannot name Snooze: it is not a failed attempt"),
    ({"dead_on": LeaseLostError}, "dead_on cannot name LeaseLostError"),
    ({"dead_on": HandlerTimeoutError}, "dead_on cannot name HandlerTimeoutError: a timeout is retried until max_attempts"),
    ({"retry_on": (OSError, ValueError), "dead_on": [ValueError]}, "ValueError is in both retry_on and dead_on"),
])
def test_a_bad_policy_declaration_is_refused_naming_the_option(options, match):
    ob = Outbox()
    with pytest.raises(ConfigurationError, match=match):
        ob.subscriber("t", consumer="x", **options)(lambda job: None)
    assert ob.consumers == []


def test_forward_and_periodic_take_the_policy_too():
    ob = Outbox()
    ob.forward("t", to=JetStream("nats://127.0.0.1:1", stream="s"), consumer="fwd", backoff=Backoff(base=2, cap=20),
               dead_on=ForwardingError)
    assert ob["fwd"].backoff == Backoff(base=2, cap=20) and ob["fwd"].dead_on == (ForwardingError,)
    with pytest.raises(ConfigurationError, match="subscriber 'fwd2': retry_on must be"):
        ob.forward("t", to=JetStream("nats://127.0.0.1:1", stream="s"), consumer="fwd2", retry_on="OSError")
    pytest.importorskip("croniter")
    ob.periodic("* * * * *", topic="tick", backoff=Backoff(jitter=0), retry_on=[ConnectionError])(lambda job: None)
    assert ob["tick"].retry_on == (ConnectionError,) and ob["tick"].backoff == Backoff(jitter=0)


class Flaky(ConnectionError):
    pass


def test_which_failures_are_dead_at_once_and_what_the_rule_says():
    policy = RetryPolicy(base=1, cap=10, jitter=0, retry_on=(OSError, TimeoutError), dead_on=(FileNotFoundError,))
    assert policy.dead_at_once(Flaky("x")) is None  # a subclass of a retry_on type is retried
    assert policy.dead_at_once(TimeoutError()) is None
    assert policy.dead_at_once(FileNotFoundError("gone")) == (
        "dead at once: FileNotFoundError is in dead_on (FileNotFoundError)")  # dead_on wins over retry_on (OSError)
    assert policy.dead_at_once(ValueError("bad")) == "dead at once: ValueError is not in retry_on (OSError, TimeoutError)"
    # PermanentError is dead anyway (its error unchanged); timeouts are retried until max_attempts
    assert policy.dead_at_once(PermanentError("p")) is None
    assert policy.dead_at_once(HandlerTimeoutError(3.0)) is None
    everything = RetryPolicy(base=1, cap=10, jitter=0)
    assert everything.dead_at_once(ValueError()) is None
    assert RetryPolicy(base=1, cap=10, jitter=0, dead_on=(KeyError,)).dead_at_once(ValueError()) is None


# ---------------------------------------------------------------- failure hooks: declarations


def test_hooks_are_declared_for_named_consumers_or_all_of_them():
    ob = Outbox()
    ob.subscriber("t", consumer="a")(lambda job: None)
    ob.subscriber("t", consumer="b")(lambda job: None)

    def alert(failure):
        return None

    async def page(failure):
        return None

    assert ob.on_dead("a")(alert) is alert
    ob.on_retry(["a", "b"])(page)
    ob.on_dead()(alert)  # every consumer, those declared later too
    ob.subscriber("t", consumer="c")(lambda job: None)
    assert [ob.hooks_of(c) for c in ("a", "b", "c")] == [("dead", "retry"), ("dead", "retry"), ("dead",)]
    name = f"{__name__}.test_hooks_are_declared_for_named_consumers_or_all_of_them.<locals>.alert"
    # the hook for every consumer first, then the named ones; a name met again gets #2
    assert [n for n, _ in ob.hooks_for("a", "dead")] == [name, f"{name}#2"]
    assert [n for n, _ in ob.hooks_for("c", "dead")] == [name]
    assert ob.hooks_for("c", "retry") == []


@pytest.mark.parametrize(("consumer", "hook", "match"), [
    ("nobody", lambda f: None, "on_dead: consumer 'nobody' is not declared in this registry"),
    ([], lambda f: None, "on_dead: consumer must be a consumer name, a non-empty list of them or None"),
    (["a", 3], lambda f: None, "on_dead: consumer must be a consumer name"),
    ("a", "not callable", "on_dead: the hook must be callable"),
    ("a", lambda: None, r"on_dead: hook .* must accept \(failure\)"),
    ("a", lambda f, g: None, r"on_dead: hook .* must accept \(failure\)"),
])
def test_a_bad_hook_declaration_is_refused(consumer, hook, match):
    ob = Outbox()
    ob.subscriber("t", consumer="a")(lambda job: None)
    with pytest.raises(ConfigurationError, match=match):
        ob.on_dead(consumer)(hook)
    assert ob.hooks_of("a") == ()
