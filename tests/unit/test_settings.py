"""OutboxSettings: OUTBOX_* environment variables, read when built (never at import time),
validated with errors that name the field; the CLI's flags win over the environment."""

from __future__ import annotations

import re

import pytest
from pydantic import ValidationError

from outbox import OutboxSettings
from outbox.backoff import retry_delay
from outbox.ops.cli import _settings, build_parser


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith("OUTBOX_"):
            monkeypatch.delenv(name)


def test_defaults_without_environment():
    s = OutboxSettings()
    assert s.database_url is None and s.url() is None
    assert (s.concurrency, s.claim_batch, s.poll_interval, s.listen, s.default_lease) == (8, 50, 1.0, True, 30.0)
    assert (s.backoff_base, s.backoff_cap, s.backoff_jitter) == (1.0, 3600.0, 0.25)
    assert s.log_level == "INFO"


def test_environment_is_read_when_built_not_at_import(monkeypatch):
    monkeypatch.setenv("OUTBOX_DATABASE_URL", "postgresql://app:s3cretPW@db.internal:5433/shop")
    monkeypatch.setenv("OUTBOX_CONCURRENCY", "3")
    monkeypatch.setenv("OUTBOX_POLL_INTERVAL", "0.25")
    monkeypatch.setenv("OUTBOX_LISTEN", "false")
    monkeypatch.setenv("OUTBOX_LOG_LEVEL", "debug")
    monkeypatch.setenv("OUTBOX_BACKOFF_CAP", "60")
    monkeypatch.setenv("OUTBOX_RETENTION_EVENTS", "0")
    s = OutboxSettings()
    assert s.url() == "postgresql://app:s3cretPW@db.internal:5433/shop"
    assert (s.concurrency, s.poll_interval, s.listen, s.log_level, s.backoff_cap, s.retention_events) == (
        3, 0.25, False, "DEBUG", 60.0, 0.0)


def test_environment_names_are_case_insensitive_and_unknown_ones_ignored(monkeypatch):
    monkeypatch.setenv("outbox_concurrency", "5")
    monkeypatch.setenv("OUTBOX_NO_SUCH_SETTING", "whatever")
    assert OutboxSettings().concurrency == 5


def test_password_is_never_in_repr_or_str(monkeypatch):
    monkeypatch.setenv("OUTBOX_DATABASE_URL", "postgresql://app:s3cretPW@db/shop")
    s = OutboxSettings()
    assert "s3cretPW" not in repr(s)
    assert "s3cretPW" not in str(s)
    assert "s3cretPW" not in s.model_dump_json()


@pytest.mark.parametrize("name, value", [
    ("OUTBOX_CONCURRENCY", "abc"),
    ("OUTBOX_CONCURRENCY", "0"),
    ("OUTBOX_CONCURRENCY", "513"),
    ("OUTBOX_CONCURRENCY", "1.5"),
    ("OUTBOX_CLAIM_BATCH", "0"),
    ("OUTBOX_ROUTE_BATCH", "-1"),
    ("OUTBOX_POLL_INTERVAL", "0"),
    ("OUTBOX_POLL_INTERVAL", "nan"),
    ("OUTBOX_POLL_INTERVAL", "inf"),
    ("OUTBOX_LISTEN", "maybe"),
    ("OUTBOX_DEFAULT_LEASE", "-5"),
    ("OUTBOX_SHUTDOWN_GRACE", "-1"),
    ("OUTBOX_BACKOFF_BASE", "0"),
    ("OUTBOX_BACKOFF_JITTER", "1.5"),
    ("OUTBOX_RETENTION_DONE", "-1"),
    ("OUTBOX_RETENTION_DONE", "inf"),
    ("OUTBOX_RETENTION_EVENTS", "1e12"),
    ("OUTBOX_RECONNECT_MAX", "0.1"),
    ("OUTBOX_LOG_LEVEL", "loud"),
])
def test_invalid_environment_value_names_the_field(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValidationError) as info:
        OutboxSettings()
    field = name.removeprefix("OUTBOX_").lower()
    assert [e["loc"] for e in info.value.errors()] == [(field,)]


def test_backoff_base_above_cap_is_refused():
    # retry_delay() refuses base > cap; the settings must refuse it when built, not when
    # the first job fails.
    with pytest.raises(ValueError):
        retry_delay(1, base=10.0, cap=5.0)
    with pytest.raises(ValidationError, match="backoff_base .* must not exceed backoff_cap"):
        OutboxSettings(backoff_base=10, backoff_cap=5)


def test_smallest_reconnect_max_works_with_the_reconnect_backoff():
    # The relay's reconnect loops call retry_delay(n, base=0.2, cap=reconnect_max).
    s = OutboxSettings(reconnect_max=0.2)
    assert retry_delay(50, base=0.2, cap=s.reconnect_max, jitter=0.5) <= 0.2


def test_cli_flags_override_environment(monkeypatch):
    monkeypatch.setenv("OUTBOX_DATABASE_URL", "postgresql://env@127.0.0.1/env")
    monkeypatch.setenv("OUTBOX_CONCURRENCY", "7")
    monkeypatch.setenv("OUTBOX_CLAIM_BATCH", "9")
    monkeypatch.setenv("OUTBOX_LISTEN", "true")
    monkeypatch.setenv("OUTBOX_LOG_LEVEL", "ERROR")
    args = build_parser().parse_args([
        "run", "--database-url", "postgresql://flag@127.0.0.1/flag", "--concurrency", "3",
        "--no-listen", "--log-level", "warning", "--backoff-cap", "30"])
    s = _settings(args)
    assert s.url() == "postgresql://flag@127.0.0.1/flag"
    assert s.concurrency == 3
    assert s.listen is False
    assert s.log_level == "WARNING"
    assert s.backoff_cap == 30.0
    assert s.claim_batch == 9  # not given as a flag: the environment's value stays


def test_cli_flag_values_are_validated_like_the_environment(monkeypatch):
    args = build_parser().parse_args(["run", "--concurrency", "0"])
    with pytest.raises(ValidationError) as info:
        _settings(args)
    assert [e["loc"] for e in info.value.errors()] == [("concurrency",)]


def test_pool_defaults_follow_concurrency_and_can_be_set(monkeypatch):
    assert OutboxSettings().pool_limits() == (16, 16)  # concurrency 8: 8 + 8, overflow = pool size
    assert OutboxSettings(concurrency=16).pool_limits() == (24, 24)
    monkeypatch.setenv("OUTBOX_POOL_SIZE", "12")
    monkeypatch.setenv("OUTBOX_POOL_OVERFLOW", "4")
    assert OutboxSettings().pool_limits() == (12, 4)
    s = _settings(build_parser().parse_args(["run", "--pool-size", "5", "--pool-overflow", "11"]))
    assert s.pool_limits() == (5, 11)


def test_a_pool_too_small_for_the_relays_threads_is_refused():
    """A worker each, the dispatcher, the starter, the heartbeat, the router, the statistics
    keeper, maintenance and the two look-outs may hold a connection at once: fewer would make
    them wait for one another."""
    assert OutboxSettings(concurrency=8, pool_size=16, pool_overflow=0).pool_limits() == (16, 0)
    with pytest.raises(ValidationError, match=r"pool_size \+ pool_overflow \(8 \+ 7\) must be at least concurrency \+ 8 \(16"):
        OutboxSettings(concurrency=8, pool_size=8, pool_overflow=7)
    # Each dispatcher beyond the first holds one more.
    assert OutboxSettings(concurrency=8, dispatchers=3).pool_limits() == (18, 18)
    assert OutboxSettings(concurrency=8, dispatchers=2, pool_size=17, pool_overflow=0).pool_limits() == (17, 0)
    with pytest.raises(ValidationError, match=r"at least concurrency \+ 8 \+ dispatchers - 1 \(17"):
        OutboxSettings(concurrency=8, dispatchers=2, pool_size=16, pool_overflow=0)


def test_listen_target_behind_a_transaction_pooler(monkeypatch):
    """LISTEN through a transaction-mode pooler would be lost with its server connection:
    behind one the relay LISTENs on OUTBOX_LISTEN_URL, or polls only."""
    direct, pooled = "postgresql://app@db:5432/shop", "postgresql://app@bouncer:6432/shop"
    assert OutboxSettings(database_url=direct).listen_target() == direct
    assert OutboxSettings(database_url=direct, listen=False).listen_target() is None
    assert OutboxSettings(database_url=pooled, pooler="transaction").listen_target() is None
    monkeypatch.setenv("OUTBOX_POOLER", "transaction")
    monkeypatch.setenv("OUTBOX_LISTEN_URL", direct)
    s = _settings(build_parser().parse_args(["run", "--database-url", pooled]))
    assert (s.pooler, s.listen_target()) == ("transaction", direct)
    assert "s3cret" not in repr(OutboxSettings(listen_url="postgresql://a:s3cret@db/x"))
    with pytest.raises(ValidationError):
        OutboxSettings(pooler="session")


#: What a setting's description may not hold: a measurement (a speed-up such as "1.21x", a
#: rate, "measured", a benchmark) or a pointer into the performance history ("lever 14",
#: "finding 1", "issue 14", the performance page). Descriptions state behaviour, unit and
#: default; the measurements behind a default belong in the performance notes.
MEASUREMENT = re.compile(r"\b\d+(?:\.\d+)?x\b|\blevers?\b|\bmeasur\w*|\bbench\w*|\bjobs/s\b|performance\.md"
                         r"|\bfinding \d|\bissue \d", re.IGNORECASE)


def test_descriptions_state_behaviour_unit_and_default_not_measurements():
    offenders = {name: match[0] for name, field in OutboxSettings.model_fields.items()
                 for match in MEASUREMENT.finditer(field.description or "")}
    assert offenders == {}
    assert all(field.description for field in OutboxSettings.model_fields.values())


@pytest.mark.parametrize("text", [
    "it pays with large claims (1.21x measured)", "0.79x at concurrency 32", "docs/performance.md, lever 14",
    "levers 13-15", "the benchmark shows", "in bench runs", "28,896 jobs/s", "performance notes, finding 1",
    "since issue 14", "Measurements say"])
def test_the_measurement_pattern_catches_what_it_is_for(text):
    assert MEASUREMENT.search(text)


@pytest.mark.parametrize("text", [
    "Worker threads per relay. Default 8.", "Default 0.005 (5 ms).", "at most 100 years", "concurrency + 8",
    "0 picks a free port", "Python logging level name. Default INFO.", "a round per wake-up"])
def test_the_measurement_pattern_lets_behaviour_units_and_defaults_pass(text):
    assert not MEASUREMENT.search(text)
