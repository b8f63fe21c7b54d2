"""Who may use the dashboard, and the CSRF check of its actions.

**Authentication** (:class:`DashboardAuth`, from ``OUTBOX_DASHBOARD_TOKEN`` or
``OUTBOX_DASHBOARD_USER`` / ``OUTBOX_DASHBOARD_PASSWORD``): a request passes with
``Authorization: Bearer <token>``, with HTTP basic auth of the user and password, or with
the sign-in cookie the dashboard's sign-in page sets once the token is typed into it. The
cookie holds an HMAC derived from the token, never the token itself; every comparison is
constant-time (``hmac.compare_digest``). Secrets are kept as
:class:`pydantic.SecretStr`, so no ``repr`` or log line shows them.

**CSRF** (:class:`CsrfGuard`, which also seals the status messages of redirects): every browser gets a random session cookie
(``outbox_session``, HttpOnly, SameSite=Strict); each form carries
``HMAC(process secret, session)``; an action whose form token does not match its cookie's is
refused (403). A page of another site can neither read the token nor send the cookie
(SameSite), so it cannot forge an action.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import ipaddress
import secrets
from dataclasses import dataclass

from pydantic import SecretStr

from outbox.errors import ConfigurationError
from outbox.settings import OutboxSettings

#: Cookie names: the per-browser session the CSRF token is bound to, and the sign-in cookie.
SESSION_COOKIE = "outbox_session"
AUTH_COOKIE = "outbox_auth"
#: Fewest characters of ``OUTBOX_DASHBOARD_TOKEN`` (after stripping surrounding whitespace).
MIN_TOKEN_LENGTH = 16


@dataclass(frozen=True)
class DashboardAuth:
    """The dashboard's credentials: a bearer ``token``, and/or a basic-auth ``user`` with its
    ``password`` (each None when not configured; at least one way is set)."""

    token: SecretStr | None = None
    user: str | None = None
    password: SecretStr | None = None

    @classmethod
    def from_settings(cls, settings: OutboxSettings) -> DashboardAuth | None:
        """The credentials of ``settings`` (``dashboard_token``, ``dashboard_user`` and
        ``dashboard_password``), or None when none is set. A token set at all must hold at
        least :data:`MIN_TOKEN_LENGTH` characters once surrounding whitespace is stripped (the
        stripped token is the one compared), and a user and password set must both be
        non-blank; anything weaker raises :class:`~outbox.errors.ConfigurationError` naming
        the variable, never its value, so a dashboard never starts guarded by a guessable
        secret (an empty password would let ``ops:`` in)."""
        token = None
        if settings.dashboard_token is not None:
            stripped = settings.dashboard_token.get_secret_value().strip()
            if len(stripped) < MIN_TOKEN_LENGTH:
                raise ConfigurationError(
                    f"dashboard: OUTBOX_DASHBOARD_TOKEN is too short: at least {MIN_TOKEN_LENGTH} characters besides "
                    "surrounding whitespace (openssl rand -hex 24 makes one), or leave it unset")
            token = SecretStr(stripped)
        user, password = settings.dashboard_user, settings.dashboard_password
        if user is not None and not user.strip():
            raise ConfigurationError("dashboard: OUTBOX_DASHBOARD_USER is blank: set a user name, or unset it and "
                                     "OUTBOX_DASHBOARD_PASSWORD")
        if password is not None and not password.get_secret_value().strip():
            raise ConfigurationError("dashboard: OUTBOX_DASHBOARD_PASSWORD is blank: set a password, or unset it and "
                                     "OUTBOX_DASHBOARD_USER")
        basic = user is not None and password is not None
        if token is None and not basic:
            return None
        return cls(token, user if basic else None, password if basic else None)

    def describe(self) -> str:
        """How requests authenticate, for the start line (no secret in it)."""
        ways = (["bearer token or sign-in"] if self.token else []) + (["basic auth"] if self.user else [])
        return " or ".join(ways)

    def cookie_value(self) -> str | None:
        """The sign-in cookie's value: an HMAC of a fixed label keyed with the token (None
        without a token); it proves the token was typed, without holding it."""
        if self.token is None:
            return None
        return hmac.new(self.token.get_secret_value().encode(), b"outbox-dashboard sign-in", hashlib.sha256).hexdigest()

    def token_matches(self, candidate: str) -> bool:
        """Whether ``candidate`` is the token (constant time; False without a token)."""
        if self.token is None:
            return False
        return hmac.compare_digest(candidate.encode(), self.token.get_secret_value().encode())

    def allows(self, authorization: str | None, cookie: str | None) -> bool:
        """Whether a request with this ``Authorization`` header and sign-in ``cookie`` may
        pass: a matching bearer token, basic user and password, or sign-in cookie."""
        return self.authorization_matches(authorization) or self.cookie_matches(cookie)

    def authorization_matches(self, authorization: str | None) -> bool:
        """Whether the ``Authorization`` header holds the bearer token, or the basic-auth user
        and password (constant time; False for a header that is missing or malformed)."""
        if not authorization:
            return False
        scheme, _, value = authorization.partition(" ")
        if scheme.lower() == "bearer":
            return self.token_matches(value.strip())
        if scheme.lower() == "basic" and self.user is not None and self.password is not None:
            try:
                user, sep, password = base64.b64decode(value.strip(), validate=True).decode().partition(":")
            except (binascii.Error, UnicodeDecodeError):
                return False
            return bool(sep) and hmac.compare_digest(user.encode(), self.user.encode()) & hmac.compare_digest(
                password.encode(), self.password.get_secret_value().encode())
        return False

    def cookie_matches(self, cookie: str | None) -> bool:
        """Whether ``cookie`` is the sign-in cookie (:meth:`cookie_value`; constant time)."""
        expected = self.cookie_value()
        return expected is not None and cookie is not None and hmac.compare_digest(cookie.encode(), expected.encode())


def bind_address(host: str) -> str:
    """``host`` as a socket takes it: an IPv6 literal without the brackets of a URL
    (``[::1]`` -> ``::1``); anything else unchanged."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` surely listens on the loopback interface only: a literal
    loopback address (127.0.0.0/8, ``::1``, also as ``[::1]``). Any name, ``localhost``
    included, is not (a resolver or ``/etc/hosts`` decides where a name points), nor are
    ``0.0.0.0``, ``::`` and every other address."""
    try:
        return ipaddress.ip_address(bind_address(host)).is_loopback
    except ValueError:
        return False


class CsrfGuard:
    """Makes and checks the CSRF tokens of one dashboard process (see the module notes).
    The key is random per process: tokens issued before a restart are refused after it
    (the page is reloaded and the action confirmed again)."""

    def __init__(self) -> None:
        self._key = secrets.token_bytes(32)

    @staticmethod
    def new_session() -> str:
        """A fresh session id for the session cookie."""
        return secrets.token_urlsafe(24)

    def token(self, session: str) -> str:
        """The CSRF token of forms shown to ``session``."""
        return hmac.new(self._key, session.encode(), hashlib.sha256).hexdigest()

    def seal(self, message: str) -> str:
        """The seal of a status ``message`` the dashboard itself wrote (an HMAC with this
        process's key, apart from the CSRF tokens), sent along with it in the redirect after
        an action: only a sealed message is shown, so a crafted link cannot show its own text
        as the dashboard's."""
        return hmac.new(self._key, b"status message\x00" + message.encode(), hashlib.sha256).hexdigest()

    def sealed(self, message: str | None, seal: str | None) -> bool:
        """Whether ``seal`` is :meth:`seal` of ``message`` (False when either is missing)."""
        if not message or not seal:
            return False
        return hmac.compare_digest(seal.encode(), self.seal(message).encode())

    def valid(self, session: str | None, token: str | None) -> bool:
        """Whether ``token`` (from a form) is the one of ``session`` (from its cookie)."""
        if not session or not token:
            return False
        return hmac.compare_digest(token.encode(), self.token(session).encode())
