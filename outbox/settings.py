"""OutboxSettings: the one settings object, read from ``OUTBOX_*`` environment variables
(pydantic-settings), validated when built and never at import time. The CLI builds it
and lays its flags on top.
"""

from __future__ import annotations

import functools
import os
import re
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

#: Longest retention, seconds (100 years): PostgreSQL cannot compute ``now()`` minus much more.
MAX_RETENTION = 100 * 365 * 86_400.0

#: The schema outbox's tables live in when ``OUTBOX_SCHEMA`` is not set.
DEFAULT_SCHEMA = "public"
#: What a schema name may be: a lowercase SQL identifier that never needs quoting, of at most
#: 49 characters, so the NOTIFY channel ``<schema>.outbox_events`` fits PostgreSQL's 63-byte
#: limit on identifiers (PostgreSQL docs, "Identifiers and Key Words": NAMEDATALEN).
SCHEMA_PATTERN = re.compile(r"[a-z_][a-z0-9_]{0,48}")
#: Key words that cannot name a schema unquoted (reserved and "reserved (can be function or
#: type)" ones, ``pg_get_keywords()`` categories R and T of PostgreSQL 15-17).
_SCHEMA_KEYWORDS = frozenset([
    "all", "analyse", "analyze", "and", "any", "array", "as", "asc", "asymmetric", "authorization", "binary",
    "both", "case", "cast", "check", "collate", "collation", "column", "concurrently", "constraint", "create",
    "cross", "current_catalog", "current_date", "current_role", "current_schema", "current_time",
    "current_timestamp", "current_user", "default", "deferrable", "desc", "distinct", "do", "else", "end",
    "except", "false", "fetch", "for", "foreign", "freeze", "from", "full", "grant", "group", "having",
    "ilike", "in", "initially", "inner", "intersect", "into", "is", "isnull", "join", "lateral", "leading",
    "left", "like", "limit", "localtime", "localtimestamp", "natural", "not", "notnull", "null", "offset",
    "on", "only", "or", "order", "outer", "overlaps", "placing", "primary", "references", "returning",
    "right", "select", "session_user", "similar", "some", "symmetric", "table", "tablesample", "then", "to",
    "trailing", "true", "union", "unique", "user", "using", "variadic", "verbose", "when", "where", "window",
    "with",
])


def check_schema_name(value: object) -> str:
    """Validate the name of the schema outbox's tables live in: a lowercase identifier
    (``[a-z_][a-z0-9_]*``) of at most 49 characters that is not a reserved SQL key word and
    does not start with ``pg_`` (reserved for system schemas), so it is written into SQL
    unquoted. Returns it; raises :class:`~outbox.errors.ConfigurationError` naming the
    problem otherwise."""
    from outbox.errors import ConfigurationError

    if not isinstance(value, str) or SCHEMA_PATTERN.fullmatch(value) is None:
        raise ConfigurationError(
            f"schema name {value!r} is not valid: use lowercase letters, digits and _ (not first a digit), "
            "at most 49 characters")
    if value in _SCHEMA_KEYWORDS or value.startswith("pg_") or value == "information_schema":
        raise ConfigurationError(
            f"schema name {value!r} is not valid: it is a reserved SQL key word or system schema name")
    return value


@functools.cache
def default_schema() -> str:
    """The process's default schema: ``OUTBOX_SCHEMA`` from the environment (``public`` when
    unset or empty), read on the first call and remembered; used by :func:`outbox.publish`
    and every other function whose ``schema`` is None. Raises
    :class:`~outbox.errors.ConfigurationError` when it is not a valid schema name
    (:func:`check_schema_name`). ``default_schema.cache_clear()`` forgets it (tests)."""
    from outbox.errors import ConfigurationError

    try:
        return check_schema_name(os.environ.get("OUTBOX_SCHEMA") or DEFAULT_SCHEMA)
    except ConfigurationError as exc:
        raise ConfigurationError(f"OUTBOX_SCHEMA: {exc}") from None


class OutboxSettings(BaseSettings):
    """Configuration of publishing and of the relay process.

    Every field can be set as an environment variable named ``OUTBOX_<FIELD>`` (for
    example ``OUTBOX_DATABASE_URL``, ``OUTBOX_CONCURRENCY``). Durations are seconds.
    Raises :class:`pydantic.ValidationError` naming the field when a value is invalid.
    """

    # populate_by_name: ``schema_name`` is read from OUTBOX_SCHEMA (its alias) and passed by its name.
    model_config = SettingsConfigDict(env_prefix="OUTBOX_", extra="ignore", allow_inf_nan=False,
                                      populate_by_name=True)

    database_url: SecretStr | None = Field(
        default=None,
        description="SQLAlchemy or libpq URL of the database. Default: none; the demo and "
        "the tests then start an embedded PostgreSQL (extra 'embedded').",
    )
    concurrency: int = Field(default=8, ge=1, le=512, description="Worker threads per relay. Default 8, elastic: unset, the pool doubles (up to 128 threads) while jobs wait for a thread and the handlers spend most of their time off the CPU (waiting on I/O), each doubling kept only if the workers' rate rose by half in the next 0.3 s, and a thread beyond 8 ends after 30 s without a job; a registry with transactional handlers keeps 8 (each holds a pool connection). Set, the pool has exactly this many threads (outbox.relay.pacing).")
    dispatchers: int = Field(default=1, ge=1, le=16, description="Dispatcher threads per relay, each on a connection of its own: how many claim-and-complete statements the relay has in flight at once. A second one lets one statement run on the server while the relay handles the other's rows: it helps with large claims (many workers, a large claim_batch, prefetch 0) and slows small ones, whose rounds it splits. Each takes one more pool connection. Default 1; unset, the relay keeps a second one on standby that runs rounds only while claims of 250 come back full (a deep backlog), when the pool has room for its connection (outbox.relay.pacing).")
    claim_batch: int = Field(default=50, ge=1, le=10_000, description="Most jobs claimed per round trip. Unset, it follows the rates of the workers and of the forwarders' brokers: what they finish (acknowledge) in 25 ms, between 50 and 250 (outbox.relay.pacing). Set, always this.")
    prefetch: int = Field(default=50, ge=0, le=10_000, description="Jobs claimed ahead of free workers and held in a local buffer, so claims come in batches; their leases run from the claim and are heartbeated, and SIGTERM releases them at once (a killed relay's buffer waits out the lease). 0 claims only for idle workers. Default 50. Unset, the relay also hands quick handlers' jobs to the worker pool ahead of its threads (what the workers finish in 25 ms, at most 500; not listed, so a kill -9 charges their attempt: outbox.relay.pacing); set (even to 50), it does not.")
    forward_window: int = Field(default=500, ge=1, le=100_000, description="Messages a relay's forwarders have sent to their brokers and not yet seen acknowledged, at most, all forwarders together; each acknowledgement completes its job at once, and a full window is topped up once an eighth of it is free. Counted apart from concurrency (forwarded jobs take no worker thread). Default 500.")
    route_batch: int = Field(default=500, ge=1, le=100_000, description="Most events routed per transaction. Default 500.")
    poll_interval: float = Field(default=1.0, gt=0, le=3600, description="Seconds between polls when no NOTIFY arrives. Default 1.0.")
    wake_cooldown: float = Field(default=0.005, ge=0, le=1, description="Shortest time between the starts of two rounds of the router, and of two rounds of one dispatcher, seconds: wake-ups (a NOTIFY per published event) that come closer together are handled in one round, so a steady stream of events is routed and claimed in batches rather than one transaction each. A round that found a full batch is followed at once. It delays a job by at most twice this; a finished job's outcome never waits for it (an outcome starts the next round at once, so a crash re-runs only jobs whose outcome was being written); large values also add up to twice this to the start and end of a drain. 0 runs a round per wake-up. Default 0.005 (5 ms).")
    listen: bool = Field(default=True, description="Use LISTEN/NOTIFY wake-ups (polling stays on). Default true.")
    default_lease: float = Field(default=30.0, gt=0, le=86_400, description="Lease of a job whose subscriber sets none, seconds. Default 30.")
    reap_interval: float = Field(default=2.0, gt=0, le=3600, description="Seconds between reaper runs. Default 2.")
    shutdown_grace: float = Field(default=10.0, ge=0, le=3600, description="Seconds in-flight jobs get to finish after SIGTERM. Default 10.")
    backoff_base: float = Field(default=1.0, gt=0, le=86_400, description="First retry delay, seconds. Default 1.")
    backoff_cap: float = Field(default=3600.0, gt=0, le=30 * 86_400, description="Longest retry delay, seconds. Default 3600.")
    backoff_jitter: float = Field(default=0.25, ge=0, le=1, description="Share of each delay that is random. Default 0.25.")
    hook_timeout: float = Field(default=30.0, ge=0.1, le=3600, description="Seconds a failure hook (on_dead, on_retry) may run; past it the call counts as failed and is made again later. A relay leases each call for twice this, so a call whose relay died is made by another relay within that. Default 30.")
    retention_done: float = Field(default=86_400.0, ge=0, le=MAX_RETENTION, description="How long done jobs are kept, seconds (at most 100 years); 0 deletes a job in the statement that completes it, so no done row is written and none pruned (`status`, the dashboard and job lookups then show no done jobs; a job cancelled while it ran ends cancelled and stays until the next pruning round; replay --since re-delivers every event in its range). Each relay reads its own: give all the same value. Default 1 day.")
    retention_events: float = Field(default=7 * 86_400.0, ge=0, le=MAX_RETENTION, description="How long fully finished events are kept, seconds (at most 100 years). Default 7 days.")
    intake_retention: float = Field(default=14 * 86_400.0, ge=0, le=MAX_RETENTION, description="How long an intake remembers a message it took in, seconds (at most 100 years): a broker's redelivery or a sender's re-send within it is dropped, one after it is taken in again. Keep it longer than any span over which your brokers deliver a message again (Kafka's retention, a JetStream stream's max age, a sender's longest outage). Rejected messages stay until forgotten (outbox-relay intake forget). Default 14 days.")
    prune_interval: float = Field(default=60.0, gt=0, description="Seconds between pruning runs. Default 60.")
    reconnect_max: float = Field(default=10.0, ge=0.2, le=600, description="Longest wait between reconnect attempts, seconds (the first wait is 0.2). Default 10.")
    schema_name: str = Field(default=DEFAULT_SCHEMA, validation_alias="outbox_schema", description="Environment variable OUTBOX_SCHEMA, flag --schema. PostgreSQL schema that holds outbox's tables, sequence, trigger function and version table (outbox_alembic_version), for migrate, the relay, publish and every command: a lowercase identifier of at most 49 characters; migrate creates it if missing. Default public.")
    log_level: str = Field(default="INFO", description="Python logging level name. Default INFO.")
    pool_size: int | None = Field(default=None, ge=1, le=10_000, description="Connections the relay keeps open in its pool. Default: concurrency + 8, plus one per dispatcher beyond the first (one per worker, each dispatcher, the starter, the heartbeat, the router, the statistics keeper, maintenance and the claim and route look-outs; the scheduler, when schedules are declared, and the failure hooks' runner, when hooks are declared, take one more each from the overflow). pool_size + pool_overflow must be at least that, so no thread waits for the pool; to open fewer connections, lower concurrency. Async transactional handlers use, besides, one connection per worker thread that runs them, outside this pool (an async engine per thread: SQLAlchemy's async pool stays on one event loop).")
    pool_overflow: int | None = Field(default=None, ge=0, le=10_000, description="Connections the relay may open beyond pool_size when every pooled one is in use, closed again when returned. Default: pool_size.")
    pooler: Literal["none", "transaction"] = Field(default="none", description="'transaction' when the database URL goes through a pooler in transaction mode (PgBouncer pool_mode=transaction): psycopg's prepared statements are off on every relay connection, and LISTEN uses listen_url or, without one, is off (polling only). Default none.")
    listen_url: SecretStr | None = Field(default=None, description="URL of a direct (not pooled) connection to the same database for LISTEN, for use with pooler='transaction'. Default: none; LISTEN then uses database_url, or is off with pooler='transaction'.")
    log_format: Literal["text", "json"] = Field(default="text", description="'text': one readable line per record; 'json': one JSON object per line (ts, level, logger, message and the record's structured fields: job_id, event_id, consumer, fence, attempt, duration_seconds, topic, ...). Default text.")
    metrics_port: int | None = Field(default=None, ge=0, le=65_535, description="TCP port the relay serves Prometheus metrics on (GET /metrics; needs the extra 'metrics', prometheus_client); 0 picks a free port (logged). Default: none, no metrics.")
    metrics_host: str = Field(default="127.0.0.1", min_length=1, description="Address the metrics port listens on. Default 127.0.0.1 (this host only); 0.0.0.0 or :: to let a Prometheus elsewhere scrape it.")
    metrics_interval: float = Field(default=5.0, ge=1.0, le=3600, description="Seconds between two readings of the database gauges (ready, running, dead jobs by consumer, lag, unrouted events), taken by one relay at a time. Default 5.")

    dashboard_token: SecretStr | None = Field(default=None, description="Bearer token of `outbox-relay dashboard` (Authorization: Bearer, or typed once into its sign-in page, which keeps a cookie derived from it); required, or dashboard_user and dashboard_password, for a bind to any address but loopback. Never logged. Default: none.")
    dashboard_user: str | None = Field(default=None, description="User name of the dashboard's HTTP basic auth, with dashboard_password. Default: none.")
    dashboard_password: SecretStr | None = Field(default=None, description="Password of the dashboard's HTTP basic auth, with dashboard_user. Never logged. Default: none.")
    dashboard_allowed_hosts: str = Field(default="", description="Host header values the dashboard answers besides localhost and loopback addresses on its own port, comma-separated: `name` (any port) or `name:port`, an IPv6 address in brackets. Without credentials only loopback names may be listed (an SSH tunnel's other port: localhost:9000). With credentials, empty means every Host is answered; set it behind a proxy or on a public address (dash.example.com). Any other Host is answered 400 (DNS rebinding). Default: empty.")

    @field_validator("schema_name")
    @classmethod
    def _schema_valid(cls, value: str) -> str:
        from outbox.errors import ConfigurationError

        try:
            return check_schema_name(value)
        except ConfigurationError as exc:
            raise ValueError(str(exc)) from None

    @field_validator("log_level")
    @classmethod
    def _level_known(cls, value: str) -> str:
        value = value.upper()
        if value not in {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}:
            raise ValueError(f"unknown log level {value!r}")
        return value

    @model_validator(mode="after")
    def _dashboard_basic_auth_whole(self) -> OutboxSettings:
        if (self.dashboard_user is None) != (self.dashboard_password is None):
            raise ValueError("dashboard_user and dashboard_password go together (OUTBOX_DASHBOARD_USER and "
                             "OUTBOX_DASHBOARD_PASSWORD): set both or neither")
        return self

    @model_validator(mode="after")
    def _backoff_ordered(self) -> OutboxSettings:
        if self.backoff_base > self.backoff_cap:
            raise ValueError(f"backoff_base ({self.backoff_base:g}) must not exceed backoff_cap ({self.backoff_cap:g})")
        return self

    @model_validator(mode="after")
    def _pool_large_enough(self) -> OutboxSettings:
        size, overflow = self.pool_limits()
        if size + overflow < self.pool_needed():
            extra = f" + dispatchers - 1 ({self.pool_needed()}" if self.dispatchers > 1 else f" ({self.pool_needed()}"
            raise ValueError(
                f"pool_size + pool_overflow ({size} + {overflow}) must be at least concurrency + 8{extra}: one "
                "connection per worker, each dispatcher, the starter, the heartbeat, the router, the statistics "
                "keeper, maintenance and the claim and route look-outs); lower concurrency to open fewer connections")
        return self

    def pool_needed(self) -> int:
        """Connections the relay's threads hold at once: one per worker, one per dispatcher,
        and the starter, heartbeat, router, statistics keeper, maintenance and the claim and
        route look-outs (:class:`outbox.relay.notify.Lookout`): concurrency + 8 with one
        dispatcher."""
        return self.concurrency + self.dispatchers + 7

    @property
    def keep_done(self) -> bool:
        """Whether a completed job's row stays, ``done``, until the pruner deletes it
        (``retention_done`` > 0), or is deleted by the statement that completes it
        (``retention_done`` = 0)."""
        return self.retention_done > 0

    def url(self) -> str | None:
        """The database URL in clear text, or None when none is configured."""
        return self.database_url.get_secret_value() if self.database_url else None

    def pool_limits(self) -> tuple[int, int]:
        """(pool size, overflow) of the relay's engine: ``pool_size`` (default
        :meth:`pool_needed`: concurrency + 8 with one dispatcher) and ``pool_overflow`` (default the pool size). The relay opens at most their sum
        through its pool, plus its LISTEN connection (:meth:`listen_target`) and, with async
        transactional handlers, one connection per worker thread that runs them."""
        size = self.pool_size if self.pool_size is not None else self.pool_needed()
        return size, self.pool_overflow if self.pool_overflow is not None else size

    def listen_target(self) -> str | None:
        """The URL the relay LISTENs on in clear text, or None for polling only: None when
        ``listen`` is off; ``listen_url`` when set; None behind a transaction pooler without
        one (a LISTEN through a transaction-mode pooler is lost when the server connection
        goes back to the pool: PgBouncer docs, "Feature matrix for pooling modes"); else
        the database URL."""
        if not self.listen:
            return None
        if self.listen_url is not None:
            return self.listen_url.get_secret_value()
        return None if self.pooler == "transaction" else self.url()
