"""retry_delay: capped exponential backoff with jitter, within bounds for every attempt up
to 10**6 and every valid base/cap/jitter, never overflowing."""

from __future__ import annotations

import math
import random
from fractions import Fraction

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from outbox.backoff import retry_delay
from tests.hypothesis_profiles import examples

MAX_ATTEMPT = 10**6

attempts = st.integers(min_value=1, max_value=MAX_ATTEMPT)
# Any positive finite float, from the smallest subnormal to the largest double.
positive = st.floats(min_value=5e-324, max_value=1.7976931348623157e308, allow_nan=False, allow_infinity=False)
jitters = st.floats(min_value=0.0, max_value=1.0)
# The ranges the settings allow: base 0..86400 s, cap 0..30 days.
practical_base = st.floats(min_value=1e-3, max_value=86_400)
practical_cap = st.floats(min_value=1e-3, max_value=30 * 86_400)


def exact_undelayed(attempt: int, base: float, cap: float) -> Fraction:
    """d = min(cap, base * 2**(attempt - 1)), in exact arithmetic (no float overflow)."""
    return min(Fraction(cap), Fraction(base) * (1 << (attempt - 1)))


def base_cap(draw_base: float, draw_cap: float) -> tuple[float, float]:
    return min(draw_base, draw_cap), max(draw_base, draw_cap)


def assert_within(delay: float, attempt: int, base: float, cap: float, jitter: float) -> None:
    assert isinstance(delay, float)
    assert math.isfinite(delay)
    d = exact_undelayed(attempt, base, cap)
    # Slack for float rounding: relative, plus the spacing of subnormal floats (a delay
    # of 5e-324 seconds times 0.25 rounds to 0).
    tolerance, subnormal = Fraction(1, 10**12), Fraction(2) ** -1070
    assert Fraction(delay) <= d * (1 + tolerance) + subnormal, (delay, float(d))
    assert Fraction(delay) >= (1 - Fraction(jitter)) * d * (1 - tolerance) - subnormal, (delay, float(d), jitter)
    assert delay <= cap
    assert delay >= 0


@settings(max_examples=examples(400), deadline=None)
@given(attempt=attempts, b=practical_base, c=practical_cap, jitter=jitters, seed=st.integers(0, 2**32))
@example(attempt=MAX_ATTEMPT, b=1.0, c=3600.0, jitter=0.25, seed=0)
@example(attempt=1025, b=1.0, c=30 * 86_400.0, jitter=0.0, seed=0)
def test_delay_within_bounds_for_practical_settings(attempt, b, c, jitter, seed):
    base, cap = base_cap(b, c)
    delay = retry_delay(attempt, base=base, cap=cap, jitter=jitter, rng=random.Random(seed))
    assert_within(delay, attempt, base, cap, jitter)


@settings(max_examples=examples(400), deadline=None)
@given(attempt=attempts, b=positive, c=positive, jitter=jitters, seed=st.integers(0, 2**32))
@example(attempt=MAX_ATTEMPT, b=5e-324, c=1.7976931348623157e308, jitter=0.0, seed=0)
@example(attempt=2000, b=5e-324, c=1e308, jitter=0.5, seed=1)
@example(attempt=MAX_ATTEMPT, b=1e-300, c=1e300, jitter=1.0, seed=2)
@example(attempt=1, b=1.7976931348623157e308, c=1.7976931348623157e308, jitter=0.0, seed=0)
@example(attempt=1, b=1.0, c=5e-324, jitter=0.75, seed=0)
def test_delay_never_overflows_for_any_finite_base_and_cap(attempt, b, c, jitter, seed):
    base, cap = base_cap(b, c)
    delay = retry_delay(attempt, base=base, cap=cap, jitter=jitter, rng=random.Random(seed))
    assert_within(delay, attempt, base, cap, jitter)


@settings(max_examples=examples(200), deadline=None)
@given(attempt=st.integers(1, MAX_ATTEMPT - 1), step=st.integers(1, 2000), b=practical_base, c=practical_cap)
def test_monotone_without_jitter(attempt, step, b, c):
    base, cap = base_cap(b, c)
    later = min(attempt + step, MAX_ATTEMPT)
    assert retry_delay(attempt, base=base, cap=cap, jitter=0) <= retry_delay(later, base=base, cap=cap, jitter=0)


def test_without_jitter_the_delay_doubles_then_stays_at_cap():
    delays = [retry_delay(n, base=1.0, cap=60.0, jitter=0) for n in range(1, 10)]
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0, 60.0]
    assert retry_delay(MAX_ATTEMPT, base=1.0, cap=60.0, jitter=0) == 60.0


def test_jitter_spreads_delays_below_the_undelayed_value():
    rng = random.Random(7)
    delays = {retry_delay(3, base=1.0, cap=60.0, jitter=0.5, rng=rng) for _ in range(200)}
    assert len(delays) > 100
    assert min(delays) >= 2.0 and max(delays) <= 4.0
    assert min(delays) < 2.5 and max(delays) > 3.5


@pytest.mark.parametrize("kwargs", [
    dict(attempt=0),
    dict(attempt=-1),
    dict(attempt=-(10**9)),
    dict(attempt=1, base=0.0),
    dict(attempt=1, base=-1.0),
    dict(attempt=1, base=math.nan),
    dict(attempt=1, base=math.inf, cap=math.inf),
    dict(attempt=1, cap=math.inf),
    dict(attempt=1, cap=math.nan),
    dict(attempt=1, base=10.0, cap=1.0),
    dict(attempt=1, cap=0.0),
    dict(attempt=1, jitter=-0.01),
    dict(attempt=1, jitter=1.01),
    dict(attempt=1, jitter=math.nan),
    dict(attempt=1.5),
])
def test_invalid_arguments_raise_value_error(kwargs):
    attempt = kwargs.pop("attempt")
    with pytest.raises(ValueError):
        retry_delay(attempt, **kwargs)


@settings(max_examples=examples(100), deadline=None)
@given(attempt=st.integers(max_value=0), jitter=jitters)
def test_any_attempt_below_one_is_refused(attempt, jitter):
    with pytest.raises(ValueError, match="attempt"):
        retry_delay(attempt, jitter=jitter)
