"""Signed webhooks as an intake source: the Standard Webhooks scheme
(https://www.standardwebhooks.com, "Verifying webhooks"), served by ``outbox-relay intake-http``.

A sender POSTs the event's JSON body with three headers: ``webhook-id`` (the message's id,
the same on every retry of it: the intake's dedup identity), ``webhook-timestamp`` (Unix
seconds) and ``webhook-signature``, a space-separated list of ``v1,<base64 HMAC-SHA256>``
signatures of ``<webhook-id>.<webhook-timestamp>.<body>`` under the shared secret (base64,
optionally prefixed ``whsec_``). A request is taken in only when one signature matches one of
the intake's secrets (several allow a rotation without downtime), compared in constant
time, and its timestamp is within ``tolerance`` seconds of the server's clock (the scheme's
defence against replays: a captured request cannot be sent again later); the answer comes
after the transaction that took it in has committed. What the server answers:

* 200 ``taken in`` (the event's id) or ``already taken in`` (a retry of a message taken in
  before: nothing written; concurrent retries of one id write one event);
* 401 a missing or wrong signature, 400 a timestamp outside the window or malformed headers,
  413 a body over ``max_body_bytes``, 400 a body that is not a JSON event (the reason said),
  404 an unknown intake: nothing written in any of these;
* 503 the database is unreachable: nothing written, the sender retries.

The event: topic from the intake's ``topic=`` (the message's subject is the body's ``type``
when it is a JSON object with a string ``type``, as the scheme's payloads have, else the
intake's name), payload the body's JSON, headers ``webhook-id`` and ``webhook-timestamp``
(and the request's ``traceparent``, when sent).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from outbox.errors import ConfigurationError
from outbox.intake import Received, Source, finite

#: The scheme's default tolerance between the sender's timestamp and ours, seconds.
DEFAULT_TOLERANCE = 300.0
#: Largest body taken by default, bytes (publish's payload limit).
DEFAULT_MAX_BODY = 1_048_576
#: The signature version this scheme defines for HMAC-SHA256.
SIGNATURE_VERSION = "v1"


class Webhook(Source):
    """Signed webhooks (module notes). ``secret``: the shared secret, or a sequence of them
    (any may sign), each base64 text with or without the ``whsec_`` prefix, at least 16
    bytes decoded. ``tolerance``: seconds a request's timestamp may differ from the server's
    clock (default 300, the scheme's). ``max_body_bytes``: the largest body taken (default
    1 MiB). Raises :class:`ConfigurationError` naming what is wrong (a secret that is not
    base64, too short)."""

    pulled = False

    def __init__(self, secret: str | Sequence[str], *, tolerance: float = DEFAULT_TOLERANCE,
                 max_body_bytes: int = DEFAULT_MAX_BODY) -> None:
        secrets = [secret] if isinstance(secret, str) else list(secret) if isinstance(secret, Sequence) else None
        if not secrets:
            raise ConfigurationError("Webhook: secret must be a base64 secret (whsec_...) or a non-empty list of them")
        self._keys = [_key(s, i) for i, s in enumerate(secrets)]
        if not finite(tolerance) or not 1 <= tolerance <= 86_400:
            raise ConfigurationError(f"Webhook: tolerance must be seconds in 1..86400, got {tolerance!r}")
        if type(max_body_bytes) is not int or not 1 <= max_body_bytes <= 64 * 1024 * 1024:
            raise ConfigurationError(f"Webhook: max_body_bytes must be an int in 1..67108864, got {max_body_bytes!r}")
        self.tolerance = float(tolerance)
        self.max_body_bytes = max_body_bytes

    def describe(self) -> str:
        """What it takes (never the secrets)."""
        keys = f"{len(self._keys)} signing key{'s' if len(self._keys) > 1 else ''}"
        return (f"signed webhooks (Standard Webhooks, {keys}, tolerance {self.tolerance:g} s, "
                f"bodies up to {self.max_body_bytes} bytes)")

    def __repr__(self) -> str:
        return f"Webhook({len(self._keys)} signing key(s) hidden, tolerance={self.tolerance:g})"

    def verify(self, headers: Mapping[str, str], body: bytes, now: float) -> Received:
        """The message of a request with ``headers`` (names in lower case) and ``body``,
        received at Unix time ``now``. Raises :class:`Refused` with the status to answer
        (401: no signature matches; 400: headers missing or malformed, timestamp outside the
        tolerance)."""
        webhook_id = headers.get("webhook-id", "")
        stamp = headers.get("webhook-timestamp", "")
        signatures = headers.get("webhook-signature", "")
        if not webhook_id or not stamp or not signatures:
            missing = [n for n, v in (("webhook-id", webhook_id), ("webhook-timestamp", stamp),
                                      ("webhook-signature", signatures)) if not v]
            raise Refused(401 if missing == ["webhook-signature"] else 400,
                          f"missing header{'s' if len(missing) > 1 else ''}: {', '.join(missing)}")
        if len(webhook_id) > 255 or "\x00" in webhook_id:
            raise Refused(400, "webhook-id must be at most 255 characters")
        if not stamp.isascii() or not stamp.isdigit() or len(stamp) > 12:
            raise Refused(400, "webhook-timestamp must be Unix seconds")
        if abs(now - int(stamp)) > self.tolerance:
            raise Refused(400, f"webhook-timestamp is more than {self.tolerance:g} s from the server's clock "
                               "(a replay, or a clock off)")
        signed = f"{webhook_id}.{stamp}.".encode() + body
        expected = [hmac.new(key, signed, hashlib.sha256).digest() for key in self._keys]
        if not any(_matches(candidate, expected) for candidate in signatures.split()):
            raise Refused(401, "no signature matches")
        kept = {"webhook-id": webhook_id, "webhook-timestamp": stamp}
        if "traceparent" in headers:
            kept["traceparent"] = headers["traceparent"]
        return Received(body=body, headers=kept, subject=_type_of(body) or "", message_id=webhook_id)

    def sign(self, webhook_id: str, timestamp: int, body: bytes) -> str:
        """The ``webhook-signature`` header a sender with this intake's first secret sends
        (for tests and for senders written in Python)."""
        digest = hmac.new(self._keys[0], f"{webhook_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
        return f"{SIGNATURE_VERSION},{base64.b64encode(digest).decode()}"


@dataclass(frozen=True)
class Refused(Exception):  # noqa: N818 - an answer, not a failure of ours
    """A request refused before anything is written: ``status`` to answer, ``reason`` to say."""

    status: int
    reason: str


def _key(secret: object, index: int) -> bytes:
    if not isinstance(secret, str) or not secret:
        raise ConfigurationError(f"Webhook: secret {index} must be base64 text (whsec_...), got {type(secret).__name__}")
    text = secret.removeprefix("whsec_")
    try:
        key = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ConfigurationError(f"Webhook: secret {index} is not base64 (after an optional whsec_ prefix)") from None
    if len(key) < 16:
        raise ConfigurationError(f"Webhook: secret {index} is {len(key)} bytes decoded; use at least 16 (24-64 random "
                                 "bytes is the scheme's advice)")
    return key


def _matches(candidate: str, expected: list[bytes]) -> bool:
    version, _, encoded = candidate.partition(",")
    if version != SIGNATURE_VERSION:
        return False
    try:
        given = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        return False
    return any(hmac.compare_digest(given, digest) for digest in expected)


def _type_of(body: bytes) -> str | None:
    try:
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):  # the intake's rules reject it, naming why
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    return kind if isinstance(kind, str) else None
