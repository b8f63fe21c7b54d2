"""The dashboard's access log without secrets: :class:`QueryRedactor`.

uvicorn writes a line per request (logger ``uvicorn.access``) with the request's path and
query string. The dashboard never takes credentials from a URL, yet a token someone puts in
one (``/?token=...``, a bookmark, a script) would be written to the log, and from there to
wherever logs go. So the dashboard's access lines keep the values of its own query parameters
(:data:`QUERY_PARAMETERS`: status, before, id, key, action, consumer, job, msg, seal) and
write every other parameter, name and value, as ``***``: ``/?token=s3cret&status=dead``
is logged as ``/?***&status=dead``.
"""

from __future__ import annotations

import logging
from urllib.parse import unquote_plus

#: The query parameters of the dashboard's own links and forms; their values are logged.
QUERY_PARAMETERS = frozenset({"status", "before", "id", "key", "action", "consumer", "job", "msg", "seal"})
#: What an unknown query parameter is logged as.
REDACTED = "***"
#: The logger uvicorn writes its access lines to.
ACCESS_LOGGER = "uvicorn.access"


def redact_target(target: str) -> str:
    """A request target (path and query string) with every query parameter but the
    dashboard's own (:data:`QUERY_PARAMETERS`) written as ``***``."""
    path, question, query = target.partition("?")
    if not question:
        return target
    kept = []
    for item in query.split("&"):
        name = unquote_plus(item.partition("=")[0])
        kept.append(item if name in QUERY_PARAMETERS else REDACTED)
    return f"{path}?{'&'.join(kept)}"


class QueryRedactor(logging.Filter):
    """A filter for the ``uvicorn.access`` logger: each argument of a record that holds a
    query string (the request target) is replaced by :func:`redact_target` of it, so the line
    is formatted without the query's unknown parameters. Records are never dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and any(isinstance(a, str) and "?" in a for a in record.args):
            record.args = tuple(redact_target(a) if isinstance(a, str) and "?" in a else a for a in record.args)
        return True


#: The one filter :func:`redact_access_log` installs.
_REDACTOR = QueryRedactor()


def redact_access_log() -> None:
    """Install :class:`QueryRedactor` on uvicorn's access logger (once per process)."""
    logging.getLogger(ACCESS_LOGGER).addFilter(_REDACTOR)
