"""Which requests the dashboard answers by address: the ``Host`` a request names (DNS
rebinding) and the ``Origin`` of every POST (requests sent by other sites).

**Host** (:class:`HostPolicy`). A site whose name its owner re-points to 127.0.0.1 (DNS
rebinding) is, for the browser, the same origin as whatever answers there: its script reads
the dashboard's pages and posts its forms, cookie and CSRF token included. The one thing that
still names the attacker's site is the ``Host`` header, so the dashboard answers only Host
values no other site can make a browser send:

- without credentials: ``localhost`` or a loopback address literal (127.0.0.0/8,
  ``[::1]``) with the port the request came in on (or without a port when that port is 80,
  as browsers send it), and the entries of ``OUTBOX_DASHBOARD_ALLOWED_HOSTS``, which must
  then be loopback names too (a name that is not, ``outbox.local`` or a DNS name, is one an
  attacker may answer for);
- with credentials: every Host, unless ``OUTBOX_DASHBOARD_ALLOWED_HOSTS`` is set (behind a
  proxy, or on a non-loopback address): then those entries and the loopback values above.

Any other Host is answered 400 (Django's ``ALLOWED_HOSTS`` rule). An entry ``name`` matches
that name on any port, ``name:port`` on that port only; names compare without case; an IPv6
address is written in brackets (``[::1]:9000``).

**Origin** (:func:`same_origin`). Every POST must carry an ``Origin`` (or, when it has none,
a ``Referer``) naming the dashboard itself: scheme http or https, the request's own Host
name and port (the scheme's default port when none is written). Browsers send ``Origin`` with
every POST; ``null`` (a sandboxed frame, a ``data:`` page) and any other site are refused
(403), as is a POST with neither header. Scheme aside, this is the origin a browser compares:
behind a proxy that ends TLS, a page at ``https://dash.example`` posts to a dashboard that sees
plain HTTP with ``Host: dash.example``, and passes.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from outbox.errors import ConfigurationError
from outbox.settings import OutboxSettings

#: What a host name or IPv4 address in ``Host`` may hold (RFC 3986 reg-name, as DNS names use it).
_HOST_NAME = re.compile(r"[a-z0-9_](?:[a-z0-9_.-]*[a-z0-9_.])?")
#: The port a browser leaves out of ``Host`` and ``Origin``, by scheme.
DEFAULT_PORTS = {"http": 80, "https": 443}


def parse_host(value: str) -> tuple[str, int | None] | None:
    """A ``Host`` header or an allowed-hosts entry as (name, port): the name lower-cased, an
    IPv6 address without its brackets, the port None when not written. None when ``value`` is
    not a host: empty, a bad port, a bracket left open, or anything a host cannot hold (a
    scheme, a path, user info)."""
    value = value.strip().lower()
    if value.startswith("["):
        name, bracket, rest = value[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            return None
        port_text = rest[1:] if rest else None
        if not _is_ipv6(name):
            return None
    elif value.count(":") > 1:  # a bare IPv6 address: no port can follow it
        name, port_text = value, None
        if not _is_ipv6(name):
            return None
    else:
        name, colon, port_text_or_empty = value.partition(":")
        port_text = port_text_or_empty if colon else None
    if not (_is_ipv6(name) or _HOST_NAME.fullmatch(name)):
        return None
    if port_text is None:
        return name, None
    if not port_text.isascii() or not port_text.isdigit() or not 0 < int(port_text) <= 65_535:
        return None
    return name, int(port_text)


def _is_ipv6(name: str) -> bool:
    try:
        return ipaddress.ip_address(name).version == 6
    except ValueError:
        return False


def is_loopback_name(name: str) -> bool:
    """Whether a browser that sends ``name`` as its Host surely reached this machine by a
    name no other site can own: ``localhost`` (browsers resolve it to loopback themselves,
    RFC 6761) or a loopback address literal (127.0.0.0/8, ``::1``)."""
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class HostPolicy:
    """The ``Host`` values the dashboard answers (see the module notes): ``entries`` from
    ``OUTBOX_DASHBOARD_ALLOWED_HOSTS`` as (name, port or None for any port); ``any_host``
    when every Host is answered (credentials and no entries)."""

    entries: tuple[tuple[str, int | None], ...] = ()
    any_host: bool = False

    @classmethod
    def from_settings(cls, settings: OutboxSettings, *, authenticated: bool) -> HostPolicy:
        """The policy of ``settings.dashboard_allowed_hosts`` (comma-separated entries; see
        :meth:`build`, which raises the same errors)."""
        return cls.build([h for h in settings.dashboard_allowed_hosts.split(",") if h.strip()],
                         authenticated=authenticated)

    @classmethod
    def build(cls, allowed_hosts: list[str], *, authenticated: bool) -> HostPolicy:
        """The policy for the entries ``allowed_hosts`` (``OUTBOX_DASHBOARD_ALLOWED_HOSTS``)
        on a dashboard with credentials (``authenticated``) or without. Raises
        :class:`~outbox.errors.ConfigurationError` for an entry that is not a host (a URL, a
        path, a bad port), and, without credentials, for one that is not a loopback name."""
        entries = []
        for raw in allowed_hosts:
            parsed = parse_host(raw)
            if parsed is None:
                raise ConfigurationError(
                    f"dashboard: OUTBOX_DASHBOARD_ALLOWED_HOSTS entry {raw[:100]!r} is not a host: write a name or "
                    "address with an optional :port (dash.example.com, dash.example.com:8443, [::1]:9000), no scheme "
                    "or path")
            if not authenticated and not is_loopback_name(parsed[0]):
                raise ConfigurationError(
                    f"dashboard: OUTBOX_DASHBOARD_ALLOWED_HOSTS names {raw[:100]!r}, which is not a loopback name, on a "
                    "dashboard without credentials: any site whose name points here could use it (DNS rebinding); "
                    "set OUTBOX_DASHBOARD_TOKEN (or OUTBOX_DASHBOARD_USER and OUTBOX_DASHBOARD_PASSWORD), or allow "
                    "only localhost and loopback addresses")
            entries.append(parsed)
        return cls(tuple(entries), any_host=authenticated and not entries)

    def allows(self, host: str | None, own_port: int | None) -> bool:
        """Whether the dashboard answers a request whose ``Host`` header is ``host`` (None:
        none sent) that came in on TCP port ``own_port`` (None: unknown, any port goes for
        the loopback names)."""
        parsed = parse_host(host) if host is not None else None
        if parsed is None:
            return False
        if self.any_host:
            return True
        name, port = parsed
        if is_loopback_name(name) and (own_port is None or port == own_port or (port is None and own_port == 80)):
            return True
        return any(name == allowed and (allowed_port is None or port == allowed_port)
                   for allowed, allowed_port in self.entries)

    def describe(self, own_port: int | None) -> str:
        """The Host values answered, for a 400 page and the start line."""
        if self.any_host:
            return "any"
        port = f":{own_port}" if own_port is not None else ""
        names = [f"localhost{port}", f"127.0.0.1{port}", f"[::1]{port}"]
        names += [(f"[{name}]" if ":" in name else name) + (f":{p}" if p is not None else "")
                  for name, p in self.entries]
        return ", ".join(names)


def same_origin(origin: str | None, referer: str | None, host: str | None) -> bool:
    """Whether a POST with these ``Origin`` and ``Referer`` headers comes from the dashboard
    whose ``Host`` it names (see the module notes): ``Origin`` decides when present (``null``
    fails), else ``Referer``; neither, or no Host, fails."""
    source = origin if origin is not None else referer
    own = parse_host(host) if host is not None else None
    if source is None or own is None:
        return False
    try:
        parts = urlsplit(source.strip())
        port = parts.port
    except ValueError:
        return False
    if parts.scheme not in DEFAULT_PORTS or not parts.hostname or "@" in parts.netloc:
        return False
    default = DEFAULT_PORTS[parts.scheme]
    own_name, own_port = own
    return parts.hostname == own_name and (port or default) == (own_port or default)
