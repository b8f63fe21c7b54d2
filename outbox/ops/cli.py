"""``outbox-relay``: the command line.

Commands: ``run`` (the default: ``outbox-relay --app module:attr`` runs router, workers,
reaper and pruner), ``migrate``, ``demo``, ``psql``, ``catalog`` (:mod:`outbox.ops.catalog`), ``grants`` (the relay and publisher
roles: :mod:`outbox.ops.grants`), ``dashboard`` (the web dashboard, :mod:`outbox.ops.dashboard`,
extra ``[dashboard]``), and the operator's commands, each a call of :mod:`outbox.admin` that
this module only parses and prints: ``status``, ``dead``, ``redrive``, ``blocked``, ``skip``
(ordered keys held by a dead job: architecture notes, "Ordering"), ``subscriptions``,
``unsubscribe``, ``pause``, ``resume`` (architecture notes, "Flow control"), ``relays``,
``jobs`` (``jobs show ID``: one job with its attempt history), ``cancel``, ``retry``,
``replay``, ``purge``, ``prune``. Only ``run`` imports the relay (:mod:`outbox.relay.relay`). Settings come from ``OUTBOX_*`` environment variables
(:class:`~outbox.settings.OutboxSettings`); flags given on the command line win.

Errors a user can cause (a bad ``--app``, an unreachable database, missing migrations, an
invalid setting) and any statement the database refuses (a missing privilege, say;
translated by :func:`outbox.db.engine.translate_errors`) print one line
``outbox-relay: error: ...`` and exit with status 2; never a traceback, never a password. A
command that matched nothing (no such job, nothing to redrive, cancel, retry or replay)
prints one line ``outbox-relay: ...`` and exits with status 1. An unknown command word is
refused (status 2); only options (``outbox-relay --app x:ob``) mean ``run``.
``migrate`` may run from many processes at once: they take turns (an advisory lock,
:mod:`outbox.db.migrate`), and all but the first find the schema at head.

Every command works on the outbox in schema ``--schema`` (default ``$OUTBOX_SCHEMA``, else
``public``): ``migrate`` creates it there, ``run`` routes and runs its events only, and the
inspecting commands read and change its tables only.
"""

from __future__ import annotations

import argparse
import base64
import importlib
import json
import logging
import os
import sys
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from outbox.errors import ConfigurationError, OutboxError
from outbox.settings import OutboxSettings

if TYPE_CHECKING:
    from pathlib import Path

    from sqlalchemy.engine import URL, Connection, Engine

log = logging.getLogger(__name__)

COMMANDS: tuple[str, ...] = ("run", "migrate", "demo", "status", "dead", "redrive", "blocked", "skip", "subscriptions", "unsubscribe",
            "pause", "resume", "psql", "grants", "catalog")
#: The operator's commands (:mod:`outbox.admin`).
ADMIN_COMMANDS = ("relays", "jobs", "cancel", "retry", "replay", "purge", "prune")
COMMANDS += ADMIN_COMMANDS
#: The web dashboard (extra ``[dashboard]``; :mod:`outbox.ops.dashboard`).
COMMANDS += ("dashboard",)
#: The inbox (:mod:`outbox.intake`): rejected messages, and the webhook server (extra ``[dashboard]``).
COMMANDS += ("intake", "intake-http")
#: Exit status of a command that matched nothing (bad input and errors exit 2).
NOTHING_MATCHED = 1

#: run flags -> settings fields
_RUN_FLAGS = {
    "concurrency": int, "dispatchers": int, "claim_batch": int, "prefetch": int, "route_batch": int, "poll_interval": float,
    "wake_cooldown": float,
    "default_lease": float, "reap_interval": float, "shutdown_grace": float,
    "retention_done": float, "retention_events": float, "intake_retention": float, "prune_interval": float,
    "backoff_base": float, "backoff_cap": float, "backoff_jitter": float, "reconnect_max": float,
    "pool_size": int, "pool_overflow": int, "pooler": str, "listen_url": str,
    "metrics_port": int, "metrics_host": str, "metrics_interval": float,
}


class UsageError(OutboxError):
    """A command-line mistake; printed as one line."""


def load_app(spec: str) -> Any:
    """Import ``module:attribute`` and return the :class:`~outbox.Outbox` it names.

    Raises :class:`UsageError` saying which part failed: malformed spec, module not found,
    module raised on import, attribute missing, or not an ``Outbox``.
    """
    from outbox.registry import Outbox

    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"--app must look like 'package.module:attribute', got {spec!r}")
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")  # like `python -m`: the current directory is importable
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            raise UsageError(f"--app {spec!r}: no module named {exc.name!r}") from None
        raise UsageError(f"--app {spec!r}: importing {module_name} failed: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - the user's module may raise anything
        raise UsageError(f"--app {spec!r}: importing {module_name} raised {type(exc).__name__}: {exc}") from None
    target: Any = module
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise UsageError(f"--app {spec!r}: module {module_name} has no attribute {attr!r}") from None
    if callable(target) and not isinstance(target, Outbox):
        try:
            target = target()  # a factory returning the registry
        except Exception as exc:  # noqa: BLE001 - the user's factory may raise anything
            raise UsageError(f"--app {spec!r}: calling {attr} raised {type(exc).__name__}: {exc}") from None
    if not isinstance(target, Outbox):
        raise UsageError(f"--app {spec!r} is a {type(target).__name__}, not an outbox.Outbox")
    return target


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``outbox-relay``: one subcommand per command in COMMANDS."""
    parser = argparse.ArgumentParser(
        prog="outbox-relay",
        description="PostgreSQL outbox relay: routes events to consumers' jobs and runs them.",
        epilog="Without a command, `run` is assumed: outbox-relay --app myapp.jobs:ob",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def add(name: str, help_: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_, description=help_)
        p.add_argument("--database-url", help="database URL (default: $OUTBOX_DATABASE_URL)")
        p.add_argument("--log-level", help="DEBUG, INFO, WARNING or ERROR (default: $OUTBOX_LOG_LEVEL or INFO)")
        p.add_argument("--log-format", choices=("text", "json"),
                       help="text lines, or one JSON object per line with structured fields "
                            "(default: $OUTBOX_LOG_FORMAT or text)")
        p.add_argument("--schema", help="schema of outbox's tables (default: $OUTBOX_SCHEMA or public)")
        return p

    run = add("run", "Run the router, the workers of --app's consumers, the reaper and the pruner.")
    run.description = (f"{run.description} SIGTERM or SIGINT drains: in-flight jobs get --shutdown-grace "
                       "seconds, the rest are released for other relays; exit status 0. Errors before "
                       "start (bad --app, unreachable database, missing migrations): one line, status 2.")
    run.add_argument("--app", help="module:attribute naming the outbox.Outbox registry (or a function "
                                   "returning one), imported with the current directory on sys.path; "
                                   "omit to run routing and maintenance only")
    run.add_argument("--no-listen", action="store_true", help="poll only; do not LISTEN")
    run.add_argument("--no-route", action="store_true", help="do not route events in this process")
    run.add_argument("--no-maintain", action="store_true", help="do not reap or prune in this process")
    run.add_argument("--no-schedule", action="store_true", help="do not publish --app's schedules in this process")
    for flag, kind in _RUN_FLAGS.items():
        run.add_argument("--" + flag.replace("_", "-"), type=kind,
                         help=f"{OutboxSettings.model_fields[flag].description} Env: OUTBOX_{flag.upper()}.")

    add("migrate", "Create or upgrade outbox's tables in --schema (alembic, version table outbox_alembic_version "
                   "in the same schema); the schema is created if missing (needs CREATE on the database).")

    demo = add("demo", "Run the order-processing demo on real data: relays are killed and paused on purpose.")
    from outbox.demo.run import add_arguments as add_demo_arguments

    add_demo_arguments(demo)

    status = add("status", "Per consumer: ready, running, pending, dead, cancelled, done and superseded jobs, lag "
                           "(how long its oldest due job has waited), blocked keys, paused; unrouted events and the "
                           "oldest's age; retained events on topics nobody subscribes to; flow control and "
                           "schedules. Done and superseded jobs are counted only on a small table (else done is "
                           "estimated), and unsubscribed topics "
                           "looked for among the latest 100,000 events, unless --exact.")
    status.add_argument("--exact", action="store_true", help="count done jobs and scan every retained event "
                                                             "(reads the whole tables)")
    status.add_argument("--json", action="store_true", help="one JSON object")
    _add_admin_commands(add)
    dead = add("dead", "List dead-lettered jobs with their last error.")
    dead.add_argument("--consumer", help="only this consumer's dead jobs")
    dead.add_argument("--limit", type=_positive_int, default=50, help="most jobs listed, oldest first (default 50)")
    dead.add_argument("--json", action="store_true", help="one JSON object per line")
    redrive = add("redrive", "Put dead jobs back to ready with a fresh attempt budget.")
    redrive.add_argument("ids", nargs="*", type=_row_id, metavar="JOB_ID", help="job ids (default: all dead jobs of --consumer, or --all)")
    redrive.add_argument("--consumer", help="every dead job of this consumer")
    redrive.add_argument("--all", action="store_true", help="redrive every dead job")
    blocked = add("blocked", "List the ordered keys a dead job blocks (on_dead='block'): consumer, key, the dead "
                             "job, since when, and how many jobs wait behind it.")
    blocked.add_argument("--consumer", help="only this consumer's blocked keys")
    blocked.add_argument("--limit", type=_positive_int, default=100, help="most keys listed, longest blocked first "
                                                                         "(default 100)")
    skip = add("skip", "Let a blocked key go on: the dead job JOB_ID stops holding its key (it stays dead) and "
                       "the key's next job becomes ready. Redrive it instead to run it first.")
    skip.add_argument("job_id", type=_row_id, metavar="JOB_ID", help="the dead job that blocks its key (see `blocked`)")
    add("subscriptions", "List the (topic, consumer) subscriptions routing uses.")
    unsubscribe = add("unsubscribe", "Remove a consumer's subscriptions (new events stop producing its jobs).")
    unsubscribe.add_argument("consumer")
    pause = add("pause", "Pause a consumer on every relay: no new claim takes its jobs (routing goes on, they wait as "
                         "ready); jobs already claimed finish. Lasts across relay restarts, until `resume`.")
    pause.add_argument("consumer")
    resume = add("resume", "Resume a paused consumer: every relay claims its jobs again at once.")
    resume.add_argument("consumer")
    dashboard = add("dashboard", "Serve the web dashboard (extra [dashboard]): consumers' health, dead letters, "
                                 "an event's path through its fan-out, the relays; redrive, retry, cancel, pause and "
                                 "resume, each confirmed. Any --host but a loopback address (127.0.0.1, ::1; a name "
                                 "such as localhost is not one) needs OUTBOX_DASHBOARD_TOKEN (16 characters or more) "
                                 "or OUTBOX_DASHBOARD_USER and OUTBOX_DASHBOARD_PASSWORD (not blank), and is "
                                 "refused without. Without credentials only localhost and loopback addresses on its "
                                 "port are answered as Host (400 otherwise, against DNS rebinding).")
    dashboard.add_argument("--host", default="127.0.0.1", help="address or name to listen on; an IPv6 address "
                                                                "bare or in brackets (default 127.0.0.1)")
    dashboard.add_argument("--port", type=_port, default=8000, help="TCP port (default 8000)")
    dashboard.add_argument("--read-only", action="store_true", help="show no action and refuse every one (403)")
    dashboard.add_argument("--allowed-hosts", dest="dashboard_allowed_hosts", metavar="HOSTS",
                           help="Host values answered besides localhost and loopback addresses on its port, "
                                "comma-separated, name or name:port (OUTBOX_DASHBOARD_ALLOWED_HOSTS; without "
                                "credentials loopback names only)")
    psql = add("psql", "Open psql on the configured database, or on the embedded server's when none is configured; "
                       "other arguments go to psql (outbox-relay psql -c 'select 1').")
    psql.add_argument("--db-name", help="database on that server (default: the URL's, or postgres)")
    psql.add_argument("--pgdata", help="data folder of the embedded server (default ./.outbox/pgdata)")
    catalog = add("catalog", "Describe --app's topics, consumers, forwarders (with their destinations) and payload "
                             "schemas (pydantic models declared by subscribers) as an AsyncAPI 3.0.0 document, "
                             "JSON or markdown; reads no database.")
    catalog.add_argument("--app", required=True, help="module:attribute naming the outbox.Outbox registry")
    catalog.add_argument("--format", choices=("asyncapi", "json", "markdown"), default="asyncapi",
                         help="asyncapi (default), json or markdown")
    catalog.add_argument("--title", default="outbox application", help="the document's title")
    intake = add("intake", "The inbox: `intake rejected` lists messages intakes rejected (why, their first bytes); "
                           "`intake forget SOURCE [IDENTITY...]` forgets rejected ones (all of SOURCE's without "
                           "identities), so a redelivery is taken in again.")
    intake.add_argument("action", choices=("rejected", "forget"))
    intake.add_argument("source", nargs="?", help="the intake's name (rejected: only its messages; forget: required)")
    intake.add_argument("identities", nargs="*", help="forget: these identities only")
    intake.add_argument("--limit", type=_positive_int, default=50, help="rejected: most messages listed (default 50)")
    intake.add_argument("--json", action="store_true", help="rejected: one JSON object per line, body as base64")
    intake_http = add("intake-http", "Serve --app's webhook intakes (Standard Webhooks signatures) at "
                                     "POST /webhooks/<name>; answers after the commit (extra [dashboard]).")
    intake_http.add_argument("--app", required=True, help="module:attribute naming the outbox.Outbox registry")
    intake_http.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    intake_http.add_argument("--port", type=_port, default=8080, help="TCP port (default 8080)")
    grants = add("grants", "Print (or --apply) the GRANTs of a relay role and a publisher role on --schema's outbox: "
                           "DML for relays, publish() only for the application; create the roles first.")
    from outbox.ops.grants import add_arguments as add_grants_arguments

    add_grants_arguments(grants)
    return parser


def _add_admin_commands(add: Any) -> None:
    """The operator's commands (:mod:`outbox.admin`)."""
    from outbox.admin import JOB_STATUSES, LIST_LIMIT

    relays = add("relays", "The relay registry: each relay running handlers, its host, pid, version, consumers, "
                           "concurrency, started and last seen; one silent for --gone-after seconds is shown gone "
                           "(the pruner forgets it later).")
    relays.add_argument("--gone-after", type=float, default=None, help="seconds without a sign of life after which a "
                                                                       "relay is shown gone (default 90)")
    relays.add_argument("--json", action="store_true", help="one JSON array")
    jobs = add("jobs", "List jobs by consumer, status, event key, event id and age, in ascending id order, one "
                       "page at a time: the last line names the --after of the next page. `jobs show ID`: one job "
                       "with its attempt history (each attempt's start, end, relay, outcome and error). Nothing "
                       "matched: status 1.")
    jobs.add_argument("action", nargs="?", choices=("show",), help="show: one job and its attempts (jobs show ID)")
    jobs.add_argument("job_id", nargs="?", type=_row_id, metavar="ID", help="the job to show")
    jobs.add_argument("--consumer", help="only this consumer's jobs")
    jobs.add_argument("--status", action="append", choices=JOB_STATUSES,
                      help="only jobs in this status (repeatable: any of them)")
    jobs.add_argument("--key", help="only jobs of events with this key")
    jobs.add_argument("--event", type=_row_id, metavar="ID", help="only the jobs of this event")
    jobs.add_argument("--older-than", metavar="AGE", help="only jobs created at least AGE ago: seconds, or a number "
                                                          "with s, m, h or d (10m, 2h; database clock)")
    jobs.add_argument("--newer-than", metavar="AGE", help="only jobs created at most AGE ago (as --older-than)")
    jobs.add_argument("--after", type=_row_id, metavar="ID", help="the page after job ID (the cursor the previous "
                                                                  "page printed)")
    jobs.add_argument("--limit", type=_whole_number_to(LIST_LIMIT), default=50,
                      help=f"jobs per page, 1 to {LIST_LIMIT} (default 50)")
    jobs.add_argument("--json", action="store_true", help="one JSON object: jobs, next_after (show: the job, its "
                                                          "attempts in history, oldest first)")
    cancel = add("cancel", "Cancel jobs: ready and pending ones become cancelled (kept, then pruned, like done "
                           "ones); a running one is asked to stop (job.cancel_requested) and its attempt's outcome "
                           "records cancelled.")
    cancel.add_argument("ids", nargs="*", type=_row_id, metavar="JOB_ID", help="job ids")
    cancel.add_argument("--consumer", help="every job of this consumer (with --status: those only)")
    cancel.add_argument("--status", action="append", choices=("ready", "pending", "running"),
                        help="only jobs in this status (repeatable; default all three)")
    cancel.add_argument("--json", action="store_true", help="one JSON object")
    retry = add("retry", "Make ready jobs waiting out a retry's backoff due now (JOB_IDs: also a delayed "
                         "publish's jobs); attempts are not touched.")
    retry.add_argument("ids", nargs="*", type=_row_id, metavar="JOB_ID", help="job ids")
    retry.add_argument("--consumer", help="every job of this consumer in backoff")
    retry.add_argument("--json", action="store_true", help="one JSON object")
    replay = add("replay", "Create the missing jobs of --consumer for retained events of its topics, in batches; "
                           "each job once (a second replay at the same time creates none twice). Refused for "
                           "events already pruned and for ordered consumers.")
    replay.add_argument("--consumer", required=True)
    start = replay.add_mutually_exclusive_group(required=True)
    start.add_argument("--since", help="events created from TIME: ISO 8601 with offset, or an age such as 2h, 30m, "
                                       "7d (database clock)")
    start.add_argument("--from-event", type=_row_id, metavar="ID", help="events from this id on")
    replay.add_argument("--until", help="events created before TIME (as --since)")
    replay.add_argument("--until-event", type=_row_id, metavar="ID", help="events up to this id")
    replay.add_argument("--topic", help="only this topic of the consumer's")
    replay.add_argument("--batch", type=_positive_int, default=1000, help="events per transaction (default 1000)")
    replay.add_argument("--retention-events", type=float, help="the relays' events retention, seconds: --since "
                                                               "may not go further back (default: "
                                                               "$OUTBOX_RETENTION_EVENTS or 7 days)")
    replay.add_argument("--json", action="store_true", help="one JSON object")
    purge = add("purge", "Delete the jobs (all but running ones) of a consumer that has no subscription left.")
    purge.add_argument("consumer")
    purge.add_argument("--yes", action="store_true", help="really delete them")
    purge.add_argument("--json", action="store_true", help="one JSON object")
    prune = add("prune", "Prune now, by the relay's pruner's rules: done, cancelled and superseded jobs older than "
                         "--retention-done, finished events older than --retention-events, relays gone for 10 "
                         "minutes.")
    prune.add_argument("--retention-done", type=float, help="seconds (default $OUTBOX_RETENTION_DONE)")
    prune.add_argument("--retention-events", type=float, help="seconds (default $OUTBOX_RETENTION_EVENTS)")
    prune.add_argument("--json", action="store_true", help="one JSON object")


def _port(text: str) -> int:
    """An argparse type: a TCP port, 1 to 65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be between 1 and 65535, got {value}")
    return value


def _whole_number_to(high: int) -> Any:
    """An argparse type: a whole number from 1 to ``high``; the command-line options that
    take a count or an id use one of these, so all refuse alike."""
    def whole_number(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text[:40]!r}") from None
        if not 1 <= value <= high:
            raise argparse.ArgumentTypeError(f"must be between 1 and {high}, got {text[:40]}")
        return value

    return whole_number


#: An argparse type: a whole number from 1 to 2**31 - 1 (a PostgreSQL ``LIMIT`` in range).
_positive_int = _whole_number_to(2**31 - 1)

#: The largest job or event id: the id columns are bigint.
MAX_ROW_ID = 2**63 - 1

#: An argparse type: a job or event id, a whole number from 1 to ``MAX_ROW_ID``.
_row_id = _whole_number_to(MAX_ROW_ID)


def _settings(args: argparse.Namespace) -> OutboxSettings:
    overrides: dict[str, Any] = {}
    if getattr(args, "database_url", None) == "":
        raise UsageError("--database-url is empty (leave it out to use OUTBOX_DATABASE_URL)")
    if getattr(args, "database_url", None):
        overrides["database_url"] = args.database_url
    if getattr(args, "log_level", None):
        overrides["log_level"] = args.log_level
    if getattr(args, "log_format", None):
        overrides["log_format"] = args.log_format
    if getattr(args, "schema", None) is not None:
        overrides["schema_name"] = args.schema
    for flag in _RUN_FLAGS:
        value = getattr(args, flag, None)
        if value is not None:
            overrides[flag] = value
    if getattr(args, "no_listen", False):
        overrides["listen"] = False
    if getattr(args, "dashboard_allowed_hosts", None) is not None:
        overrides["dashboard_allowed_hosts"] = args.dashboard_allowed_hosts
    return OutboxSettings(**overrides)


#: The database ``outbox-relay demo`` creates on the embedded server (its ``--db-name`` default).
DEMO_DATABASE = "outbox_demo"


def _engine(settings: OutboxSettings, *, demo_fallback: bool = False) -> Engine:
    """An engine on the configured database; with none configured and ``demo_fallback``, on
    the demo's database of the embedded server in ``./.outbox/pgdata`` (started if needed,
    and said so on stderr), so ``outbox-relay status`` works after ``outbox-relay demo``."""
    from outbox.db.engine import make_engine, parse_url

    url: str | URL | None = settings.url()
    if url is None and demo_fallback:
        from outbox.db.embedded import DEFAULT_DATA_DIR, start_embedded

        if (DEFAULT_DATA_DIR / "PG_VERSION").exists():
            url = parse_url(start_embedded(DEFAULT_DATA_DIR)).set(database=DEMO_DATABASE)
            print(f"outbox-relay: no database configured; using the demo's ({DEMO_DATABASE} on the embedded "
                  f"server in {DEFAULT_DATA_DIR})", file=sys.stderr)
    if url is None:
        raise ConfigurationError("no database configured: set OUTBOX_DATABASE_URL or pass --database-url")
    return make_engine(url)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``outbox-relay``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv = ["run", *argv]  # only options: `outbox-relay --app myapp.jobs:ob`
    elif argv[0] not in COMMANDS and argv[0] not in ("-h", "--help"):
        return _fail(f"unknown command {argv[0]!r}; commands: {', '.join(COMMANDS)} (outbox-relay --help)")
    parser = build_parser()
    if argv[0] == "psql":  # the rest goes to psql itself: outbox-relay psql -c "select 1"
        args, extra = parser.parse_known_args(argv)
        args.psql_args = extra
    else:
        args = parser.parse_args(argv)
    try:
        settings = _settings(args)
    except ValidationError as exc:
        return _fail("; ".join(_setting_error(e) for e in exc.errors()))
    except UsageError as exc:
        return _fail(str(exc))
    from outbox.telemetry.logs import configure

    configure(settings.log_level, settings.log_format)
    # alembic announces every plugin it loads at INFO: noise before a one-line error.
    logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)
    try:
        return _dispatch(args, settings)
    except OutboxError as exc:
        return _fail(str(exc))
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `outbox-relay status | head`: the reader left; say nothing more
        # Python docs, "Note on SIGPIPE": point stdout at devnull so the flush at exit is quiet.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


#: Most lines of an error's message ``dead`` prints (the first beside the job, the rest indented).
ERROR_LINES_SHOWN = 12


def _error_message(last_error: str | None) -> list[str]:
    """The lines of ``last_error``'s message, without the traceback that follows it, at most
    ``ERROR_LINES_SHOWN`` (the last then says how many more there were)."""
    lines: list[str] = []
    for line in (last_error or "").splitlines():
        if line.startswith("Traceback (most recent call last):"):
            break
        lines.append(line)
    while lines and not lines[-1].strip():
        lines.pop()
    if len(lines) > ERROR_LINES_SHOWN:
        lines = [*lines[:ERROR_LINES_SHOWN - 1], f"... {len(lines) - ERROR_LINES_SHOWN + 1} more lines (dead --json)"]
    return lines


def _setting_error(error: Any) -> str:
    field = ".".join(map(str, error["loc"]))
    message = str(error["msg"]).removeprefix("Value error, ")  # pydantic's wrapping of our own ValueError
    if field in ("outbox_schema", "schema_name"):  # read from OUTBOX_SCHEMA
        return f"schema (OUTBOX_SCHEMA or --schema): {message}"
    if not field:
        return f"settings: {message}"
    return f"{field} (OUTBOX_{field.upper()} or --{field.replace('_', '-')}): {message}"


def _nothing(message: str) -> int:
    """A command matched nothing: one line on stderr, exit status ``NOTHING_MATCHED``."""
    print(f"outbox-relay: {' / '.join(line.strip() for line in message.splitlines() if line.strip())}",
          file=sys.stderr)
    return NOTHING_MATCHED


def _fail(message: str) -> int:
    # One line, whatever the message (a user's exception text may span several).
    message = " / ".join(line.strip() for line in message.splitlines() if line.strip())
    print(f"outbox-relay: error: {message}", file=sys.stderr)
    return 2


def _dispatch(args: argparse.Namespace, settings: OutboxSettings) -> int:
    from outbox.db.engine import translate_errors

    if args.command == "run":
        from outbox.registry import Outbox
        from outbox.relay.relay import Relay

        registry = load_app(args.app) if args.app else Outbox()
        relay = Relay(registry, settings, route=not args.no_route, maintain=not args.no_maintain,
                      schedule=not args.no_schedule)
        return relay.run()
    if args.command == "demo":
        from outbox.demo.run import main as demo_main

        return demo_main(args, settings)
    if args.command == "psql":
        return _psql(args, settings)
    if args.command == "catalog":
        from outbox.ops.catalog import render

        sys.stdout.write(render(load_app(args.app), args.format, args.title))
        return 0
    if args.command == "grants":
        from outbox.ops.grants import main as grants_main

        if not args.apply:  # printing needs no database
            return grants_main(args, settings, None)
        engine = _engine(settings)
        with translate_errors(engine.url, settings.schema_name):
            return grants_main(args, settings, engine)
    if args.command == "intake-http":
        try:
            from outbox.ops.intake_http import serve as serve_intake
        except ImportError as exc:
            raise UsageError(f"intake-http needs the extra [dashboard] (pip install 'outbox-relay[dashboard]'): "
                             f"{exc}") from None
        return serve_intake(load_app(args.app), settings, host=args.host, port=args.port)
    if args.command == "intake" and args.action == "forget" and not args.source:
        raise UsageError("intake forget: name the intake (SOURCE)")
    if args.command == "dashboard":
        try:
            from outbox.ops.dashboard import serve
        except ImportError as exc:
            raise UsageError(f"the dashboard needs the extra [dashboard] (pip install 'outbox-relay[dashboard]'): "
                             f"{exc}") from None
        return serve(settings, host=args.host, port=args.port, read_only=args.read_only)
    if args.command in ("pause", "resume"):
        _check_consumer_name(args.command, args.consumer)  # before anything connects
    if args.command == "jobs":
        _check_jobs_args(args)
    engine = _engine(settings, demo_fallback=args.command != "migrate")
    schema = settings.schema_name
    with translate_errors(engine.url, schema):
        if args.command == "migrate":
            from outbox.db.migrate import upgrade

            revision = upgrade(engine, schema=schema)
            print(f"outbox schema {schema} at revision {revision}")
            return 0
        return _inspect(args, engine, schema, settings)


def _psql(args: argparse.Namespace, settings: OutboxSettings) -> int:
    """Run psql on the configured database, or on the embedded server (kept running while
    psql runs). The embedded server's own psql binary is used for it.

    No secret reaches psql's command line (which any local user may read, ``ps``): the
    password goes in its environment (``PGPASSWORD``), the URL's other secret parameters
    (``sslpassword`` and the rest of :data:`outbox.redaction.SECRET_PARAMETERS`; libpq
    reads no environment variable for them) in a connection service file (PostgreSQL docs,
    "The Connection Service File") readable by this user only and deleted when psql exits.
    Raises :class:`UsageError` when such a parameter cannot go there: the URL or
    ``PGSERVICE`` names a service of its own, or a value ends in whitespace or holds a line
    break (a service file cannot hold it)."""
    import os
    import shutil
    import subprocess
    import tempfile
    from pathlib import Path

    from outbox.db.engine import parse_url
    from outbox.redaction import split_secrets

    url = settings.url()
    if url is None:
        from outbox.db.embedded import DEFAULT_DATA_DIR, psql_binary, start_embedded

        data_dir = Path(args.pgdata) if args.pgdata else DEFAULT_DATA_DIR
        if not (data_dir / "PG_VERSION").exists():
            raise UsageError(f"no embedded database in {data_dir.resolve()}; run `outbox-relay demo` first "
                             "or set OUTBOX_DATABASE_URL")
        url, binary = start_embedded(data_dir), psql_binary()
    else:
        found = shutil.which("psql")
        if found is None:
            raise UsageError("psql is not installed (it comes with the PostgreSQL client package)")
        binary = found
    target = parse_url(url)
    if args.db_name:
        target = target.set(database=args.db_name)
    target, secrets = split_secrets(target.set(drivername="postgresql"))
    # Unqualified names resolve in outbox's schema first (then public), so `SELECT * FROM
    # outbox_jobs` reads the jobs of --schema; PGOPTIONS reaches this psql only.
    env = dict(os.environ)
    if settings.schema_name != "public":
        path = f"-c search_path={settings.schema_name},public"
        env["PGOPTIONS"] = f"{env['PGOPTIONS']} {path}" if env.get("PGOPTIONS") else path
    password = secrets.pop("password", None)
    if password is not None:
        env["PGPASSWORD"] = password
    with tempfile.TemporaryDirectory(prefix="outbox-psql-") as private:  # mode 0700: this user's only
        if secrets:
            target = target.update_query_dict({"service": _psql_service_file(secrets, target, env, Path(private))})
        conninfo = target.render_as_string(hide_password=False)
        return subprocess.call([binary, "--dbname", conninfo, *getattr(args, "psql_args", [])], env=env)


#: The service ``outbox-relay psql`` writes the URL's secret parameters under.
PSQL_SERVICE = "outbox_psql"


def _psql_service_file(secrets: dict[str, str], target: URL, env: dict[str, str], folder: Path) -> str:
    """Write ``secrets`` (libpq keyword -> value) as service :data:`PSQL_SERVICE` in a file
    of ``folder`` readable by this user only, point ``env``'s ``PGSERVICEFILE`` at it and
    return the service's name. libpq reads a service file's value as the rest of its line
    with trailing whitespace dropped, and looks a service up in one file only, so a value
    that cannot be written as a line, or a service of the user's own, is refused."""
    names = ", ".join(sorted(secrets))
    if "service" in target.query or env.get("PGSERVICE"):
        raise UsageError(f"psql: the URL's {names} would have to go in a service file, and the URL or PGSERVICE "
                         "names a service already; put them in that service's entry instead")
    for name, value in secrets.items():
        if value != value.rstrip() or "\n" in value or "\r" in value:
            raise UsageError(f"psql: the URL's {name} ends in whitespace or holds a line break, which psql cannot "
                             "be given outside its command line; put it in a service file or a client certificate")
    path = folder / "pg_service.conf"
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as file:
        file.write(f"[{PSQL_SERVICE}]\n" + "".join(f"{name}={value}\n" for name, value in secrets.items()))
    env["PGSERVICEFILE"] = str(path)
    return PSQL_SERVICE


def _inspect(args: argparse.Namespace, engine: Any, schema: str, settings: OutboxSettings) -> int:
    """The inspecting commands: each a call of :mod:`outbox.admin`, printed."""
    from outbox import admin
    from outbox.db.migrate import check_schema

    if args.command in ADMIN_COMMANDS:
        with engine.begin() as conn:
            check_schema(conn, schema)
        return _admin(args, engine, schema, settings)
    if args.command == "skip":
        with engine.begin() as conn:
            check_schema(conn, schema)
        promoted = admin.skip_dead_job(engine, args.job_id, schema=schema)
        print(f"job {args.job_id} no longer blocks its key; "
              + (f"job {promoted[0]} is ready" if promoted else "no job was waiting behind it"))
        return 0
    with engine.begin() as conn:
        check_schema(conn, schema)
        if args.command == "blocked":
            keys = admin.blocked_keys(conn, args.consumer, args.limit, schema=schema)
            if not keys:
                print("no blocked keys" + (f" for consumer {args.consumer}" if args.consumer else ""))
            else:
                print(f"{'consumer':<32} {'key':<32} {'dead job':>10} {'pending':>8}  since")
            for k in keys:
                since = k.since.astimezone(UTC).isoformat() if k.since else "-"
                print(f"{k.consumer:<32} {k.key:<32} {k.job_id:>10} {k.pending:>8}  {since}")
        elif args.command == "status":
            state = admin.status(conn, exact=args.exact, schema=schema)
            if args.json:
                print(json.dumps(admin.as_dict(state)))
                return 0
            _print_status(state)
            _print_flow(admin.flow_controls(conn, schema=schema))
            schedules = admin.schedules(conn, schema=schema)
            if schedules:
                print(f"{'schedule':<32} {'cron':<18} {'timezone':<16} {'last slot published':<26} next slot")
            for schedule in schedules:
                last = schedule.last_slot.astimezone(UTC).isoformat() if schedule.last_slot else "-"
                print(f"{schedule.name:<32} {schedule.cron:<18} {schedule.timezone:<16} {last:<26} "
                      f"{schedule.next_slot.astimezone(UTC).isoformat()}"
                      f"{'  (catch_up)' if schedule.catch_up else ''}")
        elif args.command == "dead":
            dead = admin.dead_jobs(conn, args.consumer, args.limit, schema=schema)
            if not dead and not args.json:
                print("no dead jobs" + (f" for consumer {args.consumer}" if args.consumer else ""))
            for job in dead:
                if args.json:
                    print(json.dumps({**admin.as_dict(job), "finished_at": str(job.finished_at)}))
                else:
                    message = _error_message(job.last_error)
                    print(f"job {job.id} event {job.event_id} {job.consumer} attempts {job.attempts}/"
                          f"{job.max_attempts}{f' snoozes {job.snoozes}' if job.snoozes else ''}: "
                          f"{message[0] if message else ''}")
                    for line in message[1:]:  # a message of several lines: a validation error's fields
                        print(f"    {line}")
        elif args.command == "redrive":
            if not args.ids and not args.consumer and not args.all:
                raise UsageError("redrive needs job ids, --consumer or --all")
            ids = admin.redrive(conn, args.ids or None, args.consumer, every=args.all, schema=schema)
            if not ids:
                return _nothing("no job redriven: " + (f"none of {args.ids[:20]} is a dead job" if args.ids else
                                                       "no dead job" + (f" of consumer {args.consumer}"
                                                                        if args.consumer else "")))
            print(f"redriven {len(ids)} job{'s' if len(ids) != 1 else ''}" + (f": {ids[:20]}" if ids else ""))
            missing = sorted(set(args.ids) - set(ids))
            if missing:
                print(f"not redriven (no such job, or not dead): {missing[:20]}")
        elif args.command == "subscriptions":
            subscriptions = admin.subscriptions(conn, schema=schema)
            if not subscriptions:
                print("no subscriptions (a relay writes its registry's when it starts)")
            for sub in subscriptions:
                print(f"{sub.topic:<32} {sub.consumer:<32} max_attempts={sub.max_attempts} "
                      f"lease={sub.lease_seconds:g}s priority={sub.priority}{' transactional' if sub.transactional else ''}")
        elif args.command == "unsubscribe":
            topics = admin.unsubscribe(conn, args.consumer, schema=schema)
            if not topics:
                raise UsageError(f"no subscription for consumer {args.consumer!r}")
            print(f"unsubscribed {args.consumer} from {', '.join(topics)}")
        elif args.command in ("pause", "resume"):
            _pause_or_resume(conn, schema, args.command, args.consumer)
        elif args.command == "intake":
            return _intake(conn, args, schema)
    return 0


def _printable(text: str) -> str:
    """``text`` with control characters escaped as Python writes them (``\\n``, ``\\x1b``):
    what a message's sender chose cannot move the cursor or forge a line of the listing."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _intake(conn: Connection, args: argparse.Namespace, schema: str) -> int:
    """``intake rejected`` and ``intake forget`` (:func:`outbox.admin.rejected_messages`,
    :func:`outbox.admin.forget_rejected`)."""
    from outbox import admin

    if args.action == "forget":
        forgotten = admin.forget_rejected(conn, args.source, args.identities or None, schema=schema)
        print(f"forgot {len(forgotten)} rejected message{'s' if len(forgotten) != 1 else ''} of {args.source}")
        return 0 if forgotten else NOTHING_MATCHED
    rejected = admin.rejected_messages(conn, args.source, args.limit, schema=schema)
    if args.json:
        for m in rejected:
            print(json.dumps({"source": m.source, "identity": m.identity, "taken_at": m.taken_at.isoformat(),
                              "problem": m.problem, "subject": m.subject, "headers": m.headers,
                              "body_base64": base64.b64encode(m.body or b"").decode(), "body_size": m.body_size}))
        return 0
    if not rejected:
        print("no rejected messages" + (f" of intake {args.source}" if args.source else ""))
    for m in rejected:
        shown = (m.body or b"")[:200].decode("utf-8", "backslashreplace")
        print(f"{m.taken_at.astimezone(UTC).isoformat()}  {_printable(m.source)}  {_printable(m.identity)}  "
              f"subject {m.subject!r}  {m.body_size} bytes\n    {_printable(m.problem)}\n    body: {shown!r}")
    return 0


def _admin(args: argparse.Namespace, engine: Any, schema: str, settings: OutboxSettings) -> int:
    """``relays``, ``cancel``, ``retry``, ``replay``, ``purge``, ``prune`` (:mod:`outbox.admin`):
    text or ``--json`` on stdout; nothing matched: one line on stderr, status 1."""
    from outbox import admin

    def out(result: Any, text: str) -> None:
        if args.json:
            print(json.dumps([admin.as_dict(r) for r in result] if isinstance(result, list) else admin.as_dict(result)))
        else:
            print(text)

    command = args.command
    if command in ("cancel", "retry", "replay", "purge") and getattr(args, "consumer", None) is not None:
        _check_consumer_name(command, args.consumer)
    if command in ("cancel", "retry") and bool(args.ids) == (args.consumer is not None):
        raise UsageError(f"{command} needs job ids or --consumer (one of them)")
    if command == "relays":
        with engine.begin() as conn:
            rows = admin.relays(conn, gone_after=args.gone_after or admin.RELAY_SILENT_AFTER, schema=schema)
        if not rows:
            return _nothing("no relay registered (relays running handlers register; see `outbox-relay run --app`)")
        lines = [f"{'relay':<40} {'version':<9} {'conc':>4} {'running':>7}  {'started':<25} {'last seen':<10} consumers"]
        for r in rows:
            seen = "gone " + _seconds(r.silent_seconds) if r.gone else _seconds(r.silent_seconds) + " ago"
            lines.append(f"{r.id:<40} {r.version or '?':<9} {r.concurrency if r.concurrency is not None else '?':>4} "
                         f"{r.running:>7}  {r.started_at.astimezone(UTC).isoformat(timespec='seconds'):<25} "
                         f"{seen:<10} {','.join(r.consumers) if r.consumers is not None else '?'}")
        out(rows, "\n".join(lines))
        return 0
    if command == "jobs":
        return _job_show(args, engine, schema) if args.action == "show" else _jobs(args, engine, schema)
    if command == "cancel":
        result = admin.cancel(engine, args.ids or None, args.consumer, statuses=args.status or admin.CANCELLABLE,
                              schema=schema)
        finished = [f"job {i} is {s}" for i, s in sorted(result.unchanged.items())[:20]]
        missing = sorted(set(args.ids) - set(result.cancelled) - set(result.requested) - set(result.unchanged))
        if not result.cancelled and not result.requested:
            if not args.ids:
                return _nothing(f"no job cancelled: consumer {args.consumer} has no such job")
            return _nothing("no job cancelled: " + "; ".join(
                finished + ([f"no such job, or finished: {missing[:20]}"] if missing else [])))
        text = [f"cancelled {len(result.cancelled)} job{'s' if len(result.cancelled) != 1 else ''}"
                + (f": {result.cancelled[:20]}" if result.cancelled else "")]
        if result.requested:
            text.append(f"asked {len(result.requested)} running job{'s' if len(result.requested) != 1 else ''} to "
                        f"stop (cancelled when the attempt ends): {result.requested[:20]}")
        if result.promoted:
            text.append(f"{len(result.promoted)} ordered jobs behind them now ready: {result.promoted[:20]}")
        if finished:
            text.append(f"not cancelled: {', '.join(finished)}")
        if missing:
            text.append(f"not cancelled (no such job, or finished): {missing[:20]}")
        out(result, "\n".join(text))
        return 0
    if command == "retry":
        with engine.begin() as conn:
            ids = admin.retry(conn, args.ids or None, args.consumer, schema=schema)
        if not ids:
            return _nothing("no job made due: " + (f"none of {args.ids[:20]} is a ready job waiting to be due"
                                                   if args.ids else f"consumer {args.consumer} has no job in backoff"))
        missing = sorted(set(args.ids) - set(ids))
        out(admin.RetryResult(ids, missing), f"due now: {len(ids)} job{'s' if len(ids) != 1 else ''}: {ids[:20]}"
            + (f"\nnot changed (no such job, or not waiting): {missing[:20]}" if missing else ""))
        return 0
    if command == "replay":
        with engine.begin() as conn:
            now = admin.database_now(conn, schema=schema)
        since = _time_arg("--since", args.since, now) if args.since else None
        until = _time_arg("--until", args.until, now) if args.until else None
        replayed = admin.replay(engine, args.consumer, since=since, from_event=args.from_event, until=until,
                                until_event=args.until_event, topic=args.topic, batch=args.batch,
                                retention_events=settings.retention_events, schema=schema)
        if not replayed.scanned:
            return _nothing(f"nothing to replay: no routed event of {', '.join(replayed.topics)} in that window")
        out(replayed, f"replay to {replayed.consumer}: {replayed.created} jobs created for {replayed.scanned} events "
                      f"of {', '.join(replayed.topics)} ({replayed.scanned - replayed.created} had one already; "
                      f"{replayed.batches} batches, event ids {replayed.first_id} to {replayed.last_id})")
        return 0
    if command == "purge":
        if not args.yes:
            raise UsageError(f"purge deletes every job of consumer {args.consumer} but its running ones; "
                             "add --yes to do it")
        purged = admin.purge(engine, args.consumer, schema=schema)
        if not purged.deleted and not purged.running:
            return _nothing(f"consumer {args.consumer} has no job to purge")
        out(purged, f"purged {purged.deleted} jobs of {purged.consumer}"
            + (f"; {purged.running} running ones left (purge again once they finished)" if purged.running else ""))
        return 0
    pruned = admin.prune_now(engine, done_older_than=settings.retention_done,
                             events_older_than=settings.retention_events, schema=schema)
    out(pruned, f"pruned {pruned.jobs} done, cancelled or superseded jobs, {pruned.events} events, {pruned.relays} relays gone")
    return 0


def _jobs(args: argparse.Namespace, engine: Any, schema: str) -> int:
    """``jobs``: one page of :func:`outbox.admin.list_jobs`, as a table and the next page's
    cursor, or one JSON object; nothing matched: one line on stderr, status 1."""
    from outbox import admin

    with engine.begin() as conn:
        page = admin.list_jobs(conn, consumer=args.consumer, statuses=args.status, key=args.key,
                               event_id=args.event, older_than=args.older_than_seconds,
                               newer_than=args.newer_than_seconds, after=args.after, limit=args.limit, schema=schema)
    if not page.jobs:
        return _nothing("no job matches" + (f" after job {args.after}" if args.after else ""))
    if args.json:
        print(json.dumps(admin.as_dict(page)))
        return 0
    print(f"{'job':>10} {'event':>10} {'consumer':<24} {'status':<9} {'attempts':>8}  {'created':<25} "
          f"{'key':<24} last error")
    for j in page.jobs:
        error = (j.last_error or "").splitlines()[0][:80] if j.last_error else ""
        print(f"{j.id:>10} {j.event_id:>10} {j.consumer:<24} {j.status:<9} {f'{j.attempts}/{j.max_attempts}':>8}  "
              f"{j.created_at.astimezone(UTC).isoformat(timespec='seconds'):<25} {j.key or '-':<24} {error}")
    if page.next_after is not None:
        print(f"next page: --after {page.next_after}")
    return 0


def _job_show(args: argparse.Namespace, engine: Any, schema: str) -> int:
    """``jobs show ID``: :func:`outbox.admin.job_detail`, as text (the job, then a table of its
    attempts, oldest first, each error's first line) or one JSON object; no such job: one
    line on stderr, status 1."""
    from outbox import admin

    with engine.begin() as conn:
        job = admin.job_detail(conn, args.job_id, schema=schema)
    if job is None:
        return _nothing(f"no job {args.job_id} (never routed, or pruned)")
    if args.json:
        print(json.dumps(admin.as_dict(job)))
        return 0

    def when(moment: datetime | None) -> str:
        return moment.astimezone(UTC).isoformat(timespec="milliseconds") if moment else "-"

    event = f"event {job.event_id}" + (f" ({_printable(job.topic)}" + (f", key {_printable(job.key)})"
                                                                         if job.key is not None else ")")
                                       if job.topic is not None else " (pruned)")
    print(f"job {job.id}: {_printable(job.consumer)}, {event}")
    print(f"status {job.status}{' (cancel requested)' if job.cancel_requested else ''}, attempts {job.attempts}/"
          f"{job.max_attempts}{f', snoozes {job.snoozes}' if job.snoozes else ''}, priority {job.priority}, "
          f"fence {job.fence}" + (f", ordered key {_printable(job.ordering_key)}" if job.ordering_key else ""))
    print(f"created {when(job.created_at)}, run at {when(job.run_at)}, updated {when(job.updated_at)}"
          + (f", finished {when(job.finished_at)}" if job.finished_at else "")
          + (f", lease until {when(job.lease_until)}" if job.lease_until else ""))
    if job.superseded_by is not None:
        print(f"superseded by event {job.superseded_by}" if job.status == "superseded" else
              f"event {job.superseded_by} of its key came while it ran (coalescing): a retry would end superseded")
    if not job.history:
        print("no attempt yet")
        return 0
    kept = sum(1 for a in job.history if a.outcome not in ("done", "running"))
    print(f"{'attempt':>7}  {'outcome':<13} {'started':<29} {'ended':<29} {'relay':<32} error")
    for a in job.history:
        message = _error_message(a.error)
        error = _printable(message[0][:120]) if message else ""
        print(f"{a.attempt:>7}  {a.outcome:<13} {when(a.started_at):<29} {when(a.ended_at):<29} "
              f"{_printable(a.relay or '-'):<32} {error}".rstrip())
    if kept >= admin.HISTORY_KEPT:
        print(f"(the newest {admin.HISTORY_KEPT} ended attempts are kept; older ones were dropped)")
    if any(a.error for a in job.history):
        print("each error's first line; the whole text: jobs show --json")
    return 0


def _check_jobs_args(args: argparse.Namespace) -> None:
    """Refuse ``jobs``' bad filters before anything connects, naming the flag; the ages go to
    ``older_than_seconds`` and ``newer_than_seconds`` (None: not given). ``jobs show`` takes a
    job id and ``--json`` only."""
    if args.action == "show":
        if args.job_id is None:
            raise UsageError("jobs show: name the job (jobs show ID)")
        given = [flag for flag, value in (("--consumer", args.consumer), ("--status", args.status), ("--key", args.key),
                                          ("--event", args.event), ("--older-than", args.older_than),
                                          ("--newer-than", args.newer_than), ("--after", args.after))
                 if value is not None]
        if given or args.limit != 50:
            raise UsageError(f"jobs show ID takes --json only, not {', '.join(given) or '--limit'}")
        return
    if args.consumer is not None:
        _check_consumer_name("jobs", args.consumer)
    if args.key is not None and (not args.key or "\x00" in args.key):
        raise UsageError(f"--key: must be a non-empty text without NUL characters, got {args.key[:40]!r}")
    args.older_than_seconds = _age_arg("--older-than", args.older_than) if args.older_than is not None else None
    args.newer_than_seconds = _age_arg("--newer-than", args.newer_than) if args.newer_than is not None else None
    if None not in (args.older_than_seconds, args.newer_than_seconds) and \
            args.newer_than_seconds <= args.older_than_seconds:
        raise UsageError(f"--newer-than {args.newer_than} is not above --older-than {args.older_than}: "
                         "no job is in that window")


def _age_arg(flag: str, text: str) -> float:
    """``flag``'s AGE in seconds (:func:`outbox.admin.age_seconds`); :class:`UsageError` naming
    ``flag`` for a bad one."""
    from outbox.admin import age_seconds
    from outbox.errors import AdminError

    try:
        return age_seconds(text, flag)
    except AdminError as exc:
        raise UsageError(str(exc)) from None


def _time_arg(flag: str, text: str, now: datetime) -> datetime:
    """``flag``'s TIME: ISO 8601 with a UTC offset, or an age (``90s``, ``30m``, ``2h``, ``7d``)
    before ``now`` (the database clock)."""
    from outbox.admin import AGE_UNITS

    if text and text[-1] in AGE_UNITS and text[:-1].replace(".", "", 1).isdigit():
        try:
            return now - timedelta(seconds=float(text[:-1]) * AGE_UNITS[text[-1]])
        except OverflowError:  # beyond timedelta's or datetime's range (about 2.7 million years)
            raise UsageError(f"{flag}: {text!r} reaches before the year 1") from None
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        raise UsageError(f"{flag}: not a time: {text!r} (ISO 8601 with offset, or an age such as 2h)") from None
    if value.tzinfo is None:
        raise UsageError(f"{flag}: {text!r} has no UTC offset (add +00:00 or Z)")
    return value


def _check_consumer_name(command: str, consumer: str) -> None:
    """Refuse a consumer name no registry could declare (empty, over 255 characters, a NUL),
    naming the problem, before anything is written."""
    from outbox.errors import InvalidEventError
    from outbox.publish import check_name

    if not consumer.strip():
        raise UsageError(f"{command} needs a consumer name, got {consumer!r}")
    try:
        check_name(consumer, "consumer")  # the registry's rule
    except InvalidEventError as exc:
        raise UsageError(f"{command}: {exc}") from None


def _pause_or_resume(conn: Any, schema: str, command: str, consumer: str) -> None:
    """Pause or resume ``consumer`` (:func:`outbox.admin.pause`, :func:`outbox.admin.resume`)
    and say what changed."""
    from outbox import admin

    if command == "pause":
        paused = admin.pause(conn, consumer, schema=schema)
        assert paused.paused_at is not None  # a pause always leaves the consumer paused
        since = paused.paused_at.astimezone(UTC).isoformat()
        if paused.was_paused_at is not None:
            print(f"consumer {consumer} was already paused (since {since}); nothing changed")
        else:
            new = " (no relay has declared it yet)" if paused.created else ""
            print(f"paused consumer {consumer}{new} at {since}: no relay claims its jobs until `outbox-relay resume "
                  f"{consumer}`; routing goes on, jobs already claimed finish")
        return
    resumed = admin.resume(conn, consumer, schema=schema)
    if not resumed.known:
        print(f"consumer {consumer} is unknown (never declared nor paused); nothing changed")
    elif resumed.was_paused_at is None:
        print(f"consumer {consumer} was not paused; nothing changed")
    else:
        print(f"resumed consumer {consumer} (paused since {resumed.was_paused_at.astimezone(UTC).isoformat()}): "
              "relays claim its jobs again")


def _print_status(state: Any) -> None:
    """The text form of ``status`` (:class:`outbox.admin.Status`)."""
    age = f" (oldest {_seconds(state.unrouted_oldest_seconds)})" if state.unrouted else ""
    print(f"unrouted events: {state.unrouted}{age}")
    print(f"{'consumer':<32} {'ready':>8} {'running':>8} {'pending':>8} {'dead':>8} {'cancelled':>9} "
          f"{'done':>10} {'superseded':>10} {'blocked':>7} {'lag':>8}  paused")
    for c in state.consumers:
        done = str(c.done) if c.done is not None else "~"
        superseded = str(c.superseded) if c.superseded is not None else "~"
        lag = _seconds(c.lag_seconds) if c.lag_seconds is not None else "-"
        paused = c.paused_at.astimezone(UTC).isoformat() if c.paused_at else "-"
        note = "" if c.subscribed else "  (no subscription)"
        print(f"{c.consumer:<32} {c.ready:>8} {c.running:>8} {c.pending:>8} {c.dead:>8} {c.cancelled:>9} "
              f"{done:>10} {superseded:>10} {c.blocked_keys:>7} {lag:>8}  {paused}{note}")
    if not state.done_exact:
        print(f"done and superseded jobs: about {state.done_estimate} in all (estimated; --exact counts them per "
              "consumer)")
    where = ("retained" if state.unsubscribed_complete else f"latest {state.unsubscribed_scanned}") + " events"
    for t in state.unsubscribed:
        print(f"no subscription for topic {t.topic!r}: {t.events} of the {where}, "
              f"{t.oldest.astimezone(UTC).isoformat()} to {t.newest.astimezone(UTC).isoformat()}")


def _seconds(value: float | None) -> str:
    """A duration for people (:func:`outbox.admin.age_text`)."""
    from outbox.admin import age_text

    return age_text(value)


def _print_flow(rows: Sequence[Any]) -> None:
    """The flow-control table of ``status``: consumers with a cap, a rate limit or a pause."""
    rows = [r for r in rows if r.paused_at is not None or r.concurrency is not None or r.rate_limit is not None]
    if not rows:
        return
    print(f"{'flow control':<32} {'paused since':<34} {'concurrency':>11} {'rate limit':>12} {'running':>8}")
    for r in rows:
        paused = r.paused_at.astimezone(UTC).isoformat() if r.paused_at else "-"
        cap = "-" if r.concurrency is None else str(r.concurrency)
        rate = "-" if r.rate_limit is None else f"{r.rate_limit:g}/s"
        print(f"{r.consumer:<32} {paused:<34} {cap:>11} {rate:>12} {r.running:>8}")


if __name__ == "__main__":
    raise SystemExit(main())
