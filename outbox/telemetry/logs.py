"""The relay's log lines: text or JSON, and the structured fields of job lines.

``log_format`` (``--log-format``, ``OUTBOX_LOG_FORMAT``) chooses the format of every
line the process writes to stderr: ``text`` (``time LEVEL logger [pid] message``) or
``json``, one JSON object per line (:class:`JsonFormatter`): ``ts`` (UTC, ISO 8601 with
milliseconds), ``level``, ``logger``, ``message`` (the same text as the text format),
``pid``, ``thread``, the traceback as ``exc_info`` when there is one, and the record's
structured fields.

Structured fields: every line about a job's state changing (dead-lettered, retried,
snoozed, stale, lease lost, released, timed out, and at DEBUG each finished job) is logged
with ``extra=job_fields(job, ...)``: ``job_id``, ``event_id``, ``consumer``, ``topic``,
``fence``, ``attempt``, ``max_attempts``, ``duration_seconds`` (how long its handler ran,
when it ran) and what the line adds (``outcome``, ``delay_seconds``, ``error``). Other
lines carry what they name (``topic`` and ``events`` for a topic with no subscriber). The
text format shows the message only; the fields are for JSON.

One line per state change (issue 26, item 10). Where one fault changes many jobs at once (a
relay paused past its lease loses every claim it held), the part that notices writes one
summary line per round (:func:`job_summary`: the count, the count per consumer and the first
:data:`SUMMARY_IDS` ids; fields ``count``, ``consumers``, ``job_ids``, ``outcome``) and each
job's own line at DEBUG; a job is summarised once, by the first part that notices
(:meth:`outbox.relay.claims.HeldClaims.first_reports`). The broker clients' own records of a
connection or channel the broker closed (aiormq, aio-pika: an ERROR and a traceback for each)
say what the forwarder logs once, as its broker's state changing; :class:`ClientNoise`, which
:func:`configure` puts on the process's handler, writes them at DEBUG.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from collections import Counter
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from outbox.job import Job

#: The text format's layout.
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(process)d] %(message)s"

#: Characters the text format escapes (``\x1b``, ``\u202e``): C0 and C1 controls but newline
#: and tab, DEL, and Unicode's line separators and bidirectional overrides, which a handler's
#: error text, a topic or a header could carry to the reader's terminal (escape sequences
#: that move the cursor, rewrite the title, or reorder what is shown).
CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")

#: How many job ids a summary line names (:func:`job_summary`).
SUMMARY_IDS = 5

#: The broker clients' records :class:`ClientNoise` writes at DEBUG: (logger, the start of the
#: record's format string). Each is about a connection or channel the broker closed or that
#: could not be opened, which the forwarder reports once as its broker being unreachable
#: (and back), naming the reason: aiormq 7.2's reader and close handler (an ERROR and a
#: WARNING with a traceback for every connection the broker closes), aio-pika 10.2's robust
#: connection (a line per reconnect attempt while the broker is down, and its own "closed,
#: reconnecting" at INFO: the relay's keeper reconnects instead). Records of other events (a
#: connection blocked by a resource alarm, a frame nobody expected) keep their level.
CLIENT_NOISE = (
    ("aiormq.connection", "Unexpected connection close from remote"),
    ("aiormq.connection", "Cancelling cause reader exited abnormally"),
    ("aiormq.connection", "error when creating transport"),
    ("aiormq.connection", "Got frame for closed channel"),
    ("aiormq.connection.marshall", "It looks like you are going to send a frame"),
    ("aio_pika.robust_connection", "Connection attempt to"),
    ("aio_pika.robust_connection", "Connection to %s closed. Reconnecting"),
    ("aio_pika.robust_connection", "Reconnect attempt failed"),
)

# Attributes every LogRecord has: anything else on a record came from ``extra=``.
_RECORD_ATTRIBUTES = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


def job_fields(job: Job, duration: float = 0.0, **more: Any) -> dict[str, Any]:
    """The structured fields of a log line about ``job`` (see the module notes), with
    ``duration_seconds`` when ``duration`` (how long its handler ran, seconds) is not 0, and ``more``."""
    fields: dict[str, Any] = {"job_id": job.id, "event_id": job.event_id, "consumer": job.consumer,
                              "topic": job.topic, "fence": job.fence, "attempt": job.attempt,
                              "max_attempts": job.max_attempts}
    if duration:
        fields["duration_seconds"] = round(duration, 6)
    fields.update(more)
    return fields


def job_summary(jobs: Sequence[Job], outcome: str) -> tuple[str, dict[str, Any]]:
    """The text and the structured fields of one line about many ``jobs`` at once (one round's
    lost leases, stale reports, ...): ``"3 jobs (send_receipt 2, ledger 1; ids 17, 18, 40)"``,
    naming at most :data:`SUMMARY_IDS` ids (``"... and 95 more"``); fields ``count``,
    ``consumers`` (jobs per consumer), ``job_ids`` (the ids named) and ``outcome``."""
    per_consumer = Counter(job.consumer for job in jobs)
    ids = [job.id for job in jobs[:SUMMARY_IDS]]
    more = f" and {len(jobs) - len(ids)} more" if len(jobs) > len(ids) else ""
    consumers = ", ".join(f"{consumer} {n}" for consumer, n in per_consumer.most_common())
    text = (f"{len(jobs)} job{'' if len(jobs) == 1 else 's'} ({consumers}; "
            f"id{'' if len(ids) == 1 else 's'} {', '.join(map(str, ids))}{more})")
    return text, {"count": len(jobs), "consumers": dict(per_consumer), "job_ids": ids, "outcome": outcome}


class ClientNoise(logging.Filter):
    """A handler filter that writes the broker clients' records listed in
    :data:`CLIENT_NOISE` at DEBUG (and drops them when their logger is not enabled for
    DEBUG), and so does for aio-pika's "Callback ... error" records whose error is aiormq's
    (a callback that met the closed connection: ``ConnectionChannelError``, ...). Every other
    record passes unchanged. :func:`configure` installs it; an application that runs a relay
    under its own logging can add it to its handlers."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno <= logging.DEBUG or not record.name.startswith(("aiormq", "aio_pika")):
            return True
        if not _client_noise(record):
            return True
        record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


def _client_noise(record: logging.LogRecord) -> bool:
    """Whether ``record`` is one of :data:`CLIENT_NOISE`, or an aio-pika callback's aiormq error."""
    text = record.msg if isinstance(record.msg, str) else ""
    if any(record.name == name and text.startswith(start) for name, start in CLIENT_NOISE):
        return True
    args = record.args if isinstance(record.args, tuple) else ()
    return (record.name == "aio_pika.tools" and text.startswith("Callback %r error") and len(args) >= 3
            and type(args[2]).__module__.startswith("aiormq"))


class TextFormatter(logging.Formatter):
    """Formats a record as :data:`TEXT_FORMAT`, with the characters of :data:`CONTROLS`
    escaped as Python writes them (``\\x1b``), tracebacks included; newlines and tabs stay
    (a traceback spans lines). The JSON format needs none of this: JSON escapes controls."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        return CONTROLS.sub(lambda m: repr(m.group())[1:-1], super().format(record))


class JsonFormatter(logging.Formatter):
    """Formats a record as one line of JSON (see the module notes). A field value that JSON
    cannot encode is written as its ``str()``."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "pid": record.process,
            "thread": record.threadName,
        }
        for name, value in vars(record).items():
            if name not in _RECORD_ATTRIBUTES and name not in entry:
                entry[name] = value
        if record.exc_info:
            entry["exc_info"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["exc_info"] = record.exc_text
        if record.stack_info:
            entry["stack_info"] = self.formatStack(record.stack_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


def configure(level: str, log_format: str = "text") -> None:
    """Send the process's log records at ``level`` and above to stderr in ``log_format``
    (``text`` or ``json``), as :func:`logging.basicConfig` does: nothing changes when the root
    logger has handlers already (the CLI calls it once, before any other logging). The
    handler carries :class:`ClientNoise`."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    handler.addFilter(ClientNoise())
    logging.basicConfig(level=level, handlers=[handler])
