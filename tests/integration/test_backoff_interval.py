"""The retry delay at the largest attempt count and the largest settings is a value
PostgreSQL turns into an interval, as the fail statement does (``make_interval(secs => ...)``)."""

from __future__ import annotations

import datetime as dt

import pytest
import sqlalchemy as sa

from outbox import OutboxSettings
from outbox.backoff import retry_delay


@pytest.mark.parametrize("overrides", [
    {},
    {"backoff_base": 86_400.0, "backoff_cap": 30 * 86_400.0, "backoff_jitter": 0.0},
    {"backoff_base": 1e-9, "backoff_cap": 30 * 86_400.0, "backoff_jitter": 1.0},
])
def test_delay_at_attempt_one_million_is_a_postgres_interval(engine, overrides):
    s = OutboxSettings(_env_file=None, **overrides)
    delay = retry_delay(10**6, base=s.backoff_base, cap=s.backoff_cap, jitter=s.backoff_jitter)
    with engine.connect() as conn:
        interval, later = conn.execute(
            sa.text("SELECT make_interval(secs => CAST(:d AS float8)), now() + make_interval(secs => CAST(:d AS float8)) > now()"),
            {"d": delay}).one()
    assert isinstance(interval, dt.timedelta)
    assert abs(interval.total_seconds() - delay) < 1e-5
    assert later or delay < 1e-6
