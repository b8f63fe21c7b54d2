"""The one redaction rule for every URL outbox shows: database URLs and broker URLs alike,
in messages, log lines, pages, the pytest report header and errors raised.

:func:`redact` renders a URL with its secrets replaced by ``***``:

* the password of the userinfo (``postgresql://user:***@host/db``);
* for NATS (``nats://``, ``tls://``, ``ws://``, ``wss://``) a userinfo without a password,
  which nats-py sends as an auth token (``nats://***@host``);
* the value of every query parameter named in :data:`SECRET_PARAMETERS`, whatever the case
  of its name and however often it is given (``?password=***&sslmode=require``).

Everything else (user, hosts, ports, database, other parameters) is shown as written, so a
message still says where outbox tried to connect. Text that does not parse as a URL is
shown as ``<unparseable URL>``, never as itself.

Which parameters are secrets: libpq's own list of connection parameters
(``PQconndefaults()``, PostgreSQL docs "Parameter Key Words"). libpq marks with display
character ``*`` ("password field: hide value") ``password``, ``sslpassword`` and
``oauth_client_secret``, and with ``D`` (debug option, not shown by default)
``scram_client_key`` and ``scram_server_key``, keys that authenticate as the user just as
the password does (postgres_fdw's ``use_scram_passthrough``). All five are
:data:`SECRET_PARAMETERS`. The parameters that name a file (``sslkey``, ``sslcert``,
``sslrootcert``, ``passfile``, ``sslkeylogfile``, ``service``) carry a path or a name, not
the secret itself, and are shown. The broker clients outbox uses take no secret in the
query string (aiormq reads ``auth``, ``cafile``, ``capath``, ``cadata``, ``certfile``,
``keyfile``, ``heartbeat``, ``name``, ``no_verify_ssl``, ``timeout``; the JetStream sink
refuses a query); the rule applies to them all the same.

:func:`split_secrets` takes the secrets out of a database URL, for a program that must
get them some other way than its command line (``outbox-relay psql``).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING
from urllib.parse import unquote_plus

if TYPE_CHECKING:
    from sqlalchemy.engine import URL

#: Query parameters whose value is a secret (compared without regard to case); the
#: module's notes give the source.
SECRET_PARAMETERS = frozenset({"password", "sslpassword", "oauth_client_secret", "scram_client_key",
                               "scram_server_key"})

#: What a secret is shown as.
MASK = "***"

#: What text that does not parse as a URL is shown as.
UNPARSEABLE = "<unparseable URL>"

#: Schemes whose userinfo without a password is a token (nats-py: ``nats://TOKEN@host``).
TOKEN_SCHEMES = frozenset({"nats", "tls", "ws", "wss"})

_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*")


def is_secret_parameter(name: str) -> bool:
    """Whether the query parameter ``name`` (as written in a URL, percent-encoded or not)
    carries a secret: one of :data:`SECRET_PARAMETERS`, compared without regard to case."""
    return unquote_plus(name).strip().lower() in SECRET_PARAMETERS


def redact(url: str | URL) -> str:
    """``url`` (text, or a SQLAlchemy URL) as text safe to print, log, serve or export: the
    module's rule applied (userinfo password, NATS token and secret query parameters shown
    as ``***``). A PostgreSQL URL given as text is read as outbox reads it (SQLAlchemy's
    ``make_url``), so what is hidden is what would be sent as a secret. Never raises: text
    that does not parse is ``<unparseable URL>``."""
    try:
        if not isinstance(url, str):
            return _redact_sqlalchemy(url)
        text = url.strip()
        if text.partition("://")[0].lower().split("+")[0] in ("postgresql", "postgres"):
            from sqlalchemy.engine import make_url
            from sqlalchemy.exc import ArgumentError

            try:
                return _redact_sqlalchemy(make_url(text))
            except (ArgumentError, ValueError):  # malformed (a port that is not a number): read it as text
                pass
        return _redact_text(text)
    except Exception:  # noqa: BLE001 - whatever went wrong, the URL itself is never the answer
        return UNPARSEABLE


def split_secrets(url: URL) -> tuple[URL, dict[str, str]]:
    """``url`` without its secrets, and the secrets taken out: ``{"password": ...}`` for the
    userinfo password and one entry per secret query parameter, by its lower-case libpq name.
    A query parameter wins over the userinfo (SQLAlchemy's psycopg dialect passes the query
    after the URL's parts), and a name given twice keeps its last value (libpq's rule for a
    repeated keyword). The URL left holds no secret of the module's list."""
    secrets: dict[str, str] = {} if url.password is None else {"password": str(url.password)}
    kept: dict[str, str | tuple[str, ...]] = {}
    for name, value in url.query.items():
        if is_secret_parameter(name):
            values = (value,) if isinstance(value, str) else value
            if values:
                secrets[name.strip().lower()] = values[-1]
        else:
            kept[name] = value
    # URL.set() leaves a field given as None unchanged: build the URL anew.
    without = type(url).create(url.drivername, username=url.username, host=url.host, port=url.port,
                               database=url.database, query=kept)
    return without, secrets


def _redact_sqlalchemy(url: URL) -> str:
    """A SQLAlchemy URL rendered with its password (SQLAlchemy's own ``***``) and secret query
    values hidden; the query of its rendering is percent-encoded, so it splits safely."""
    rendered = url.render_as_string(hide_password=True)
    head, sep, query = rendered.partition("?")
    return head + sep + _redact_query(query)


def _redact_text(text: str) -> str:
    """``scheme://[userinfo@]authority[/path][?query][#fragment]`` read as urllib reads it
    (the authority ends at the first ``/``, ``?`` or ``#``; the userinfo at its last ``@``)."""
    scheme, sep, rest = text.partition("://")
    if not sep or not _SCHEME.fullmatch(scheme):
        return UNPARSEABLE
    end = len(rest)
    for mark in "/?#":
        found = rest.find(mark)
        if found != -1:
            end = min(end, found)
    authority, tail = rest[:end], rest[end:]
    path = re.split(r"[?#]", tail, maxsplit=1)[0]
    if "@" in path:  # a password holding '/' as another parser may read it: show nothing of it
        return UNPARSEABLE
    userinfo, at, hostport = authority.rpartition("@")
    if at:
        user, colon, _ = userinfo.partition(":")
        if colon:
            userinfo = f"{user}:{MASK}"
        elif scheme.lower() in TOKEN_SCHEMES:
            userinfo = MASK
        authority = f"{userinfo}@{hostport}"
    before_fragment, hash_, fragment = tail.partition("#")
    path, question, query = before_fragment.partition("?")
    return f"{scheme}://{authority}{path}{question}{_redact_query(query)}{hash_}{fragment}"


def _redact_query(query: str) -> str:
    """``query`` (``a=1&b=2``) with the value of each secret parameter replaced by ``***``;
    the other parameters are kept as written."""
    if not query:
        return query
    parts = []
    for part in query.split("&"):
        name, eq, _ = part.partition("=")
        parts.append(f"{name}={MASK}" if eq and is_secret_parameter(name) else part)
    return "&".join(parts)
