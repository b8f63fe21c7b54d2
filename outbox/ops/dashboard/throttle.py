"""The dashboard's limit on wrong credentials: :class:`LoginThrottle`.

The rule, per client address: the first :data:`FREE_FAILURES` wrong credentials (a wrong
token typed into the sign-in page, a wrong ``Authorization: Bearer`` token, a wrong basic-auth
user or password) are answered 401 at once; each further one holds the address for twice as
long as the one before, 1 s, 2 s, 4 s, ... up to :data:`LONGEST_HOLD` (5 minutes). While the
address is held, every request of it that presents credentials is answered 429 with
``Retry-After``, without looking at them: the right token after a burst of wrong ones waits
out the hold too, so guessing goes no faster with the right one mixed in, and the answer
tells nothing about the token. A right credential after the hold forgets the address's
failures; so do :data:`FORGET_AFTER` (an hour) without a failure. A request carrying a valid
sign-in cookie is never held (the cookie proves the token was typed; it is an HMAC no one
guesses).

The client address is the connection's, or the one ``X-Forwarded-For`` names when the
connection comes from an address uvicorn trusts (``FORWARDED_ALLOW_IPS``, by default
127.0.0.1 only: a proxy on the same host). IPv6 addresses count by their /64 network, the
block one host usually has. The state is in this process's memory (one dashboard process),
for at most :data:`MAX_CLIENTS` addresses (the longest-quiet ones are dropped first).
Comparisons of credentials stay constant-time (:mod:`outbox.ops.dashboard.auth`); the throttle
only decides whether they are looked at.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

#: Wrong credentials per address answered without a hold.
FREE_FAILURES = 5
#: The first hold, seconds; each further failure doubles it.
FIRST_HOLD = 1.0
#: The longest hold, seconds.
LONGEST_HOLD = 300.0
#: Seconds without a failure after which an address's failures are forgotten.
FORGET_AFTER = 3600.0
#: Most addresses remembered at once.
MAX_CLIENTS = 10_000


@dataclass
class _Record:
    failures: int
    last_failure: float
    held_until: float


class LoginThrottle:
    """Failed sign-ins per client address and the hold they earn (see the module notes).
    Thread-safe. ``clock`` gives seconds (monotonic); the other arguments override the
    module's defaults, in the same units."""

    def __init__(self, *, free_failures: int = FREE_FAILURES, first_hold: float = FIRST_HOLD,
                 longest_hold: float = LONGEST_HOLD, forget_after: float = FORGET_AFTER,
                 max_clients: int = MAX_CLIENTS, clock: Callable[[], float] = time.monotonic) -> None:
        self.free_failures = free_failures
        self.first_hold = first_hold
        self.longest_hold = longest_hold
        self.forget_after = forget_after
        self.max_clients = max_clients
        self._clock = clock
        self._lock = threading.Lock()
        self._clients: OrderedDict[str, _Record] = OrderedDict()

    def wait(self, client: str) -> float:
        """Seconds ``client`` is still held (0.0: its credentials may be checked now)."""
        now = self._clock()
        with self._lock:
            record = self._clients.get(client)
            if record is None:
                return 0.0
            if now - record.last_failure > self.forget_after and now >= record.held_until:
                del self._clients[client]
                return 0.0
            return max(0.0, record.held_until - now)

    def failed(self, client: str) -> float:
        """Record a wrong credential of ``client``; returns the hold it now has, seconds
        (0.0 while within the free failures)."""
        now = self._clock()
        with self._lock:
            record = self._clients.pop(client, None)
            if record is None or now - record.last_failure > self.forget_after:
                record = _Record(0, now, now)
            record.failures += 1
            record.last_failure = now
            beyond = record.failures - self.free_failures
            hold = 0.0
            if beyond > 0:
                hold = min(self.longest_hold, self.first_hold * 2.0 ** min(beyond - 1, 64))
                record.held_until = now + hold
            self._clients[client] = record  # the most recent failure last
            while len(self._clients) > self.max_clients:
                self._clients.popitem(last=False)
        if hold:
            log.warning("dashboard: %d wrong credentials in a row from %s; its sign-ins wait %s s", record.failures,
                        client, f"{hold:g}")
        return hold

    def succeeded(self, client: str) -> None:
        """Forget ``client``'s failures: it presented the right credentials."""
        with self._lock:
            self._clients.pop(client, None)


def client_key(host: str | None) -> str:
    """The address a throttle counts a client by: its IP address, an IPv6 one reduced to its
    /64 network; ``unknown`` when the server knows none."""
    if not host:
        return "unknown"
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.ip_network(f"{address}/64", strict=False))
    return str(address)


def retry_after(wait: float) -> str:
    """``wait`` seconds as a ``Retry-After`` value: whole seconds, rounded up, at least 1."""
    return str(max(1, math.ceil(wait)))
