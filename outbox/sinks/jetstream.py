"""The NATS JetStream sink: a forwarder's jobs published to a JetStream stream.

Each message is published to the subject its template renders (``"{topic}"`` by default)
with ``Nats-Msg-Id`` set to the job's idempotency key, so the stream stores one copy per
event and consumer within its duplicate window (``duplicate_window``, two minutes unless
the stream sets another): a re-sent message (a retry after a lost PubAck, a job the reaper
handed back, a relay that crashed after sending) is acknowledged as a duplicate and not
stored again. Outbox's headers (``Outbox-Event-Id``, ``Outbox-Topic``, ``Outbox-Key``,
``Outbox-Idempotency-Key``, ``Outbox-Created-At``) travel with the event's own, which pass
through unchanged (outbox's names win on a clash, compared case-insensitively).

A batch is published pipelined, with the core client: each message is a plain publish
whose reply subject is the sink's own inbox (``_INBOX.<unique>.``, one subscription to
``<inbox>.*`` made at connect) plus a token naming the message, so a batch costs no asyncio
task or request future per message and goes out in few socket writes (the client's flusher
writes what the batch buffered once the sink waits). The server's answer arrives on that
inbox: a PubAck, a JetStream API error, or a no-responders status. At most ``max_pending``
publishes await their answer at once, over every batch in flight (a send past that waits
for an earlier one, within its batch's time), then every answer is awaited, the batch's
``timeout`` in all; each answer is passed on as it arrives (``answered``). Several batches
may be in flight at once: a token names its batch too. Immediately before each publish the
message's ``deadline`` is checked (after any wait for room): past it, the message is not
sent (:class:`~outbox.sinks.Expired`). The
client's own ``publish_async`` is not used: in nats-py 2.16 an error answer (any JetStream
API error) raises inside its reply handler and never reaches the future, which then waits
forever and keeps its place in the pending window; this sink parses every answer itself.

What each message gets:

* a PubAck: :class:`~outbox.sinks.Delivered` (``duplicate`` as the server says);
* refused before sending, permanently (no retry can change it): a subject the event cannot
  be rendered into (no key for ``{key}``; empty tokens, whitespace or wildcards in it; too
  long for the protocol), a header NATS cannot carry unchanged, headers plus body over the
  server's ``max_payload``. Sending such a message would not only fail: the server closes
  the connection on an oversized or malformed publish, failing the whole batch;
* "no responders" (no stream binds the subject): permanent :class:`~outbox.sinks.Failed`;
* a JetStream API error: :class:`~outbox.sinks.Failed` with its code and description,
  permanent for the errors retrying cannot help (:data:`PERMANENT_ERROR_CODES`);
* no PubAck in time: :class:`~outbox.sinks.Failed`, retried (a re-send is deduplicated);
* its ``deadline`` passed before its publish (waiting for room, or a relay paused):
  :class:`~outbox.sinks.Expired`, not sent;
* the connection lost during the batch or down before it: :class:`~outbox.sinks.Unavailable`
  for every message without a PubAck yet. The client reconnects by itself (forever, every
  ``reconnect_time_wait``); ``connected`` follows its callbacks.

Publishes still unanswered when the batch ends are given up (the stream may yet store them:
a re-send is deduplicated); an answer arriving later is dropped, so nothing of one batch
lingers into the next (tokens are never reused on a connection).

The duplicate window (issue 26, item 3). Deduplication holds only within the stream's
``duplicate_window``, and the relay may send a message again up to the span it gives
:meth:`~outbox.sinks.Sink.expect_resends` later (:func:`~outbox.sinks.resend_span`: the
lease, reap and poll intervals after a crash, or the timeout and the longest retry delay
after a lost PubAck). So the sink reads the window of every stream it publishes to (the
``stream`` given, at connect; any other as soon as a PubAck names it) with the JetStream
API's ``STREAM.INFO``, again after each reconnect and every :data:`WINDOW_CHECK_INTERVAL`
seconds (a stream's config may change while the relay runs), and logs a WARNING when a
window is shorter than the span, naming the stream, the window and the span with its parts:
once per stream and window read (an INFO line when a later read finds it long enough). It
warns and does not refuse: the window is the stream owner's setting, changeable at any time,
so a check at start could not hold it anyway; a short one costs a second copy of a message
only after a fault, which the stream's consumers can drop by ``Outbox-Idempotency-Key``,
while refusing would stop all forwarding; and a small window can be a deliberate choice
(the server keeps every id of the window in memory). A window that cannot be read (no
permission for the API, no such stream) is said once at INFO and not checked.
"""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import json
import logging
import math
import re
import time
from collections.abc import Iterable, Sequence
from datetime import UTC
from typing import Any
from urllib.parse import urlsplit

from outbox.errors import ConfigurationError
from outbox.redaction import redact
from outbox.sinks import (
    Answered,
    Delivered,
    Expired,
    Failed,
    Message,
    SendResult,
    Sink,
    SinkUnavailableError,
    Template,
    Unavailable,
)

log = logging.getLogger(__name__)

#: Seconds between two readings of the duplicate windows of the streams a sink publishes to,
#: while it sends (the module notes); each reconnect reads them at once.
WINDOW_CHECK_INTERVAL = 300.0

#: Most seconds one reading of a stream's config (a ``STREAM.INFO`` request) may take.
WINDOW_CHECK_TIMEOUT = 5.0

#: JetStream error codes (``err_code``) no retry can turn into a PubAck: the message is over
#: the stream's ``max_msg_size`` (10054) or its headers over 64 KiB (10097); the subject
#: belongs to another stream than the ``stream=`` expected (10060); the stream is sealed
#: (10109). Every other API error (storage full with ``discard=new``, a cluster without a
#: leader, too many requests) is retried with backoff. Source: nats-server's errors.json.
PERMANENT_ERROR_CODES = frozenset({10054, 10060, 10097, 10109})

#: Longest rendered subject, bytes. The server's control line (``HPUB <subject> <reply>
#: <sizes>``) is limited to 4,096 bytes by default and a longer one closes the connection;
#: this leaves room for the reply inbox and the sizes.
MAX_SUBJECT_BYTES = 3_840

#: The NATS header block's fixed parts as the client writes them (``NATS/1.0`` line and the
#: closing blank line), counted into a message's size against ``max_payload``.
HEADER_BLOCK_OVERHEAD = len(b"NATS/1.0\r\n\r\n")

#: Header names NATS accepts: an RFC 7230 token.
HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")

#: A stream name: no whitespace, ``.``, ``*``, ``>``, path separators or control characters
#: (NATS documentation, "Naming Things"), at most 255 bytes.
STREAM_NAME = re.compile(r"[^\s.*>/\\\x00-\x1f\x7f]{1,255}")

OUTBOX_HEADERS = ("Nats-Msg-Id", "Nats-Expected-Stream", "Outbox-Event-Id", "Outbox-Topic", "Outbox-Key",
                  "Outbox-Idempotency-Key", "Outbox-Created-At")
_OUTBOX_HEADERS_LOWER = frozenset(name.lower() for name in OUTBOX_HEADERS)
#: The NATS control headers outbox itself sets; an event's own ``Nats-*`` headers are refused.
_OWN_NATS_HEADERS = frozenset({"Nats-Msg-Id", "Nats-Expected-Stream"})

#: Most subjects, and most header names, whose check a sink remembers (then it starts over).
CHECKS_KEPT = 10_000

_UNCHECKED = object()


def subject_problem(subject: str) -> str | None:
    """Why ``subject`` cannot be published to (empty token, whitespace or control character,
    wildcard, too long), or None when it can."""
    if len(subject.encode()) > MAX_SUBJECT_BYTES:
        return f"subject is {len(subject.encode())} bytes, over the {MAX_SUBJECT_BYTES}-byte limit"
    if any(ch.isspace() or ord(ch) < 0x20 or ord(ch) == 0x7F for ch in subject):
        return f"subject {subject!r} holds whitespace or a control character"
    tokens = subject.split(".")
    if any(token == "" for token in tokens):
        return f"subject {subject!r} has an empty token"
    if any(token in ("*", ">") or "*" in token or ">" in token for token in tokens):
        return f"subject {subject!r} holds a wildcard (* or >), which cannot be published to"
    return None


def header_problem(name: str, value: str) -> str | None:
    """Why a header cannot travel over NATS unchanged (the client trims values and turns line
    breaks into spaces; names must be RFC 7230 tokens), or None. Names starting with
    ``Nats-`` are the server's control headers (``Nats-Rollup`` purges a stream,
    ``Nats-Expected-*`` make conditions, ``Nats-TTL`` expires the message): an event's own
    header must not steer the stream, so they are refused (outbox sets ``Nats-Msg-Id`` and
    ``Nats-Expected-Stream`` itself)."""
    if not HEADER_NAME.fullmatch(name):
        return f"header name {name!r} is not a token NATS accepts"
    if name.lower().startswith("nats-") and name not in _OWN_NATS_HEADERS:
        return f"header {name!r} is a NATS control header (Nats-*), which an event may not set: it would steer the stream"
    if "\r" in value or "\n" in value or value != value.strip():
        return f"header {name!r} value holds a line break or surrounding whitespace, which NATS does not keep"
    return None


def parse_servers(url: object) -> list[str]:
    """The server URLs of ``url`` (one ``nats://`` or ``tls://`` URL, or several separated by
    commas). Raises :class:`ConfigurationError` naming ``url`` for anything else."""
    if not isinstance(url, str) or not url.strip():
        shown = repr(url) if isinstance(url, str) else f"a {type(url).__name__}"  # bytes could hold a password
        raise ConfigurationError(f"JetStream: url must be a nats:// or tls:// URL, got {shown}")
    servers = []
    for part in url.split(","):
        part = part.strip()
        try:
            parts = urlsplit(part)
            port = parts.port
        except ValueError as exc:
            raise ConfigurationError(f"JetStream: url {redact(part)!r} does not parse: {exc}") from None
        if parts.scheme not in ("nats", "tls") or not parts.hostname:
            raise ConfigurationError(f"JetStream: url {redact(part)!r} must be nats://host[:port] or tls://host[:port]")
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise ConfigurationError(f"JetStream: url {redact(part)!r} takes no path, query or fragment")
        if port == 0:
            raise ConfigurationError(f"JetStream: url {redact(part)!r} has port 0")
        servers.append(part)
    return servers


class JetStream(Sink):
    """Publishes a forwarder's jobs to NATS JetStream (the module notes say what each
    outcome becomes).

    ``url``: ``nats://host:port`` or ``tls://host:port``, or several separated by commas (a
    cluster; credentials in the URL are used but never shown: :mod:`outbox.redaction`). ``subject``: a template of
    ``{topic}``, ``{key}``, ``{consumer}`` (default ``"{topic}"``) whose literal parts hold no
    whitespace, wildcards or empty tokens. ``stream``: the stream the subject must belong to
    (sent as ``Nats-Expected-Stream``; a message that lands elsewhere fails permanently), or
    None for whichever stream binds it. ``connect_timeout``: seconds :meth:`connect` waits
    for the first connection (default 5). ``max_pending``: most PubAcks outstanding at once,
    over all batches in flight (default 4,000, as nats-py's ``publish_async``); a larger
    batch still goes out, each send past the limit waiting for an earlier PubAck. Needs ``pip install 'outbox-relay[nats]'``.
    Raises :class:`ConfigurationError` naming the option for a bad one, or when nats-py is
    not installed."""

    extra = "nats"

    def __init__(self, url: str = "nats://127.0.0.1:4222", *, subject: str = "{topic}", stream: str | None = None,
                 connect_timeout: float = 5.0, max_pending: int = 4000) -> None:
        self.servers = parse_servers(url)
        try:
            self.subject = Template(subject, "subject")
        except ConfigurationError as exc:
            raise ConfigurationError(f"JetStream: {exc}") from None
        literal = self.subject.text.format(topic="t", key="k", consumer="c")
        problem = subject_problem(literal)
        if problem is not None:
            raise ConfigurationError(f"JetStream: subject template {self.subject.text!r} is invalid "
                                     f"(rendered as {literal!r}: {problem})")
        if stream is not None and (not isinstance(stream, str) or not STREAM_NAME.fullmatch(stream)
                                   or len(stream.encode()) > 255):
            raise ConfigurationError(f"JetStream: stream must be None or a stream name (no whitespace, '.', '*', "
                                     f"'>', slashes; at most 255 bytes), got {stream!r}")
        if isinstance(connect_timeout, bool) or not isinstance(connect_timeout, (int, float)) or not (
                0 < connect_timeout <= 3600):
            raise ConfigurationError(f"JetStream: connect_timeout must be seconds, more than 0 and at most 3600, "
                                     f"got {connect_timeout!r}")
        if isinstance(max_pending, bool) or not isinstance(max_pending, int) or not 1 <= max_pending <= 1_000_000:
            raise ConfigurationError(f"JetStream: max_pending must be an integer from 1 to 1000000, "
                                     f"got {max_pending!r}")
        if importlib.util.find_spec("nats") is None:
            raise ConfigurationError("JetStream needs the NATS client: pip install 'outbox-relay[nats]'")
        self.stream = stream
        self.connect_timeout = float(connect_timeout)
        self.max_pending = max_pending
        self._nc: Any = None
        self._inbox = ""  # "<the connection's reply subject prefix>.": a publish's reply is this plus its token
        self._tokens = itertools.count(1)
        self._awaiting: dict[str, _Batch] = {}  # a publish's token -> its batch, until answered or given up
        self._room: asyncio.Event | None = None  # set when an answer leaves room under max_pending
        self._subject_problems: dict[str, str | None] = {}  # a rendered subject -> subject_problem's answer
        self._good_names: set[str] = set(OUTBOX_HEADERS)  # header names header_problem accepted
        self._up = False
        self._down = asyncio.Event()  # set while the connection is down; bound to a loop on first wait
        self._resend: tuple[float, str] | None = None  # expect_resends: (seconds, its parts)
        self._windows: dict[str, float | str | None] = {}  # stream -> its window last read, s (str: unreadable)
        self._to_check: set[str] = set()  # streams whose window is to be read
        self._checker: asyncio.Task[None] | None = None
        self._checked_at = -math.inf  # loop time of the last reading

    def describe(self) -> str:
        """The servers (secrets hidden by :func:`outbox.redaction.redact`: a password or a
        token as ``***``) and the subject template."""
        where = ",".join(redact(s) for s in self.servers)
        return f"{where} subject {self.subject.text}" + (f" stream {self.stream}" if self.stream else "")

    @property
    def connected(self) -> bool:
        """Whether the client is connected now (False from a disconnection until it has
        reconnected, and after :meth:`close`)."""
        return self._up and self._nc is not None and bool(self._nc.is_connected)

    def expect_resends(self, within: float, why: str) -> None:
        """The relay may send a message again up to ``within`` seconds after it sent it
        (``why``: the parts of that span): every stream's ``duplicate_window`` is checked
        against it (the module notes). Told by several forwarders, the longest counts."""
        if self._resend is None or within > self._resend[0]:
            self._resend = (within, why)

    async def connect(self) -> None:
        """Connect to the first server that answers within ``connect_timeout`` seconds and
        open the JetStream context; afterwards the client reconnects by itself after any
        outage. Raises :class:`SinkUnavailableError` naming the servers when none answers.
        Connecting again closes the previous connection first."""
        import nats.errors  # noqa: PLC0415 (an optional dependency, imported when used)
        from nats.aio.client import Client  # noqa: PLC0415

        await self.close()
        self._down = asyncio.Event()
        self._down.set()
        self._room = asyncio.Event()
        nc = Client()

        async def disconnected() -> None:
            self._up = False
            self._down.set()

        async def reconnected() -> None:
            self._up = True
            self._down.clear()
            self._check_soon(self._windows)  # a stream may have been changed meanwhile

        async def error(exc: Exception) -> None:
            return None  # reported through connected and each batch's results

        try:
            await asyncio.wait_for(
                nc.connect(servers=self.servers, allow_reconnect=True, max_reconnect_attempts=-1,
                           connect_timeout=math.ceil(self.connect_timeout), disconnected_cb=disconnected,
                           reconnected_cb=reconnected, closed_cb=disconnected, error_cb=error),
                self.connect_timeout)
            inbox = nc.new_inbox() + "."
            await nc.subscribe(inbox + "*", cb=self._answered)
        except (TimeoutError, OSError, nats.errors.Error) as exc:
            await _quietly_close(nc)
            reason = type(exc).__name__ + (f": {exc}" if str(exc) else "")
            raise SinkUnavailableError(f"cannot reach NATS at {','.join(redact(s) for s in self.servers)} "
                                       f"within {self.connect_timeout:g} s ({reason})") from None
        self._nc = nc
        self._inbox = inbox
        self._up = True
        self._down.clear()
        if self.stream is not None:  # at start: the stream given is known now
            self._windows.setdefault(self.stream, None)
            await self._check_window(self.stream)
        self._check_soon(s for s in self._windows if s != self.stream)

    async def close(self) -> None:
        """Flush what is buffered and close the connection; does nothing when not connected."""
        nc, self._nc, self._up = self._nc, None, False
        self._down.set()
        checker, self._checker = self._checker, None
        if checker is not None:
            checker.cancel()
        if nc is not None:
            await _quietly_close(nc)

    async def send_many(self, messages: Sequence[Message], timeout: float,
                        answered: Answered | None = None) -> list[SendResult]:
        """Publish ``messages`` pipelined and wait up to ``timeout`` seconds in all for their
        PubAcks; one result per message (the module notes map each outcome), each answer
        passed to ``answered`` as it arrives. A message whose ``deadline`` has passed just
        before its publish is not sent (:class:`~outbox.sinks.Expired`). The stream may
        store one batch's messages in another order than given."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        if loop.time() - self._checked_at >= WINDOW_CHECK_INTERVAL:
            self._check_soon(self._windows)
        batch = _Batch(len(messages), answered)
        nc = self._nc
        lost: str | None = None
        if self._room is None:
            self._room = asyncio.Event()
        try:
            for index, message in enumerate(messages):
                address = self._addressed(message)
                if isinstance(address, Failed):
                    batch.results[index] = address
                    continue
                if lost is None and not self.connected:
                    lost = "not connected to NATS" if nc is None else "the connection to NATS is down"
                if lost is not None:
                    batch.results[index] = Unavailable(lost)
                    continue
                if len(self._awaiting) >= self.max_pending and time.monotonic() < message.deadline:
                    # The window is full: wait for a PubAck, within the batch's time and the message's.
                    await self._await_room(min(deadline - loop.time(), message.deadline - time.monotonic()))
                    if not self.connected:
                        lost = "the connection to NATS was lost before the PubAck"
                        batch.results[index] = Unavailable(lost)
                        continue
                if time.monotonic() >= message.deadline:
                    batch.results[index] = Expired("not sent: its deadline passed before the publish")
                    continue
                if len(self._awaiting) >= self.max_pending:
                    batch.results[index] = Failed(f"no PubAck within {timeout:g} s (the {self.max_pending} "
                                                  "outstanding publishes took all of it)", unanswered=True)
                    continue
                subject, headers = address
                token = str(next(self._tokens))
                batch.subjects[index] = subject
                batch.pending[token] = index
                self._awaiting[token] = batch
                try:
                    # Never yields while the client's buffer has room: the whole batch is
                    # written before its flusher runs, in few socket writes.
                    await nc.publish(subject, message.body, reply=self._inbox + token, headers=headers)
                except Exception as exc:  # noqa: BLE001 - that message's result says it
                    del batch.pending[token]
                    self._awaiting.pop(token, None)
                    batch.results[index] = _refused(exc)
            if batch.pending:
                await self._await_answers(batch, deadline - loop.time())
        finally:
            # A PubAck arriving later is dropped: a re-send is deduplicated.
            for token in batch.pending:
                self._awaiting.pop(token, None)
            self._room.set()
        if batch.pending:
            late: SendResult = (Unavailable("the connection to NATS was lost before the PubAck")
                                if lost is not None or not self.connected else Failed(f"no PubAck within {timeout:g} s", unanswered=True))
            for index in batch.pending.values():
                batch.results[index] = late
        return [r if r is not None else Unavailable("not sent") for r in batch.results]

    async def _answered(self, msg: Any) -> None:
        """The reply inbox's callback: one PubAck (or error, or no-responders status) settles
        the message its token names, of whichever batch in flight sent it; others (late,
        their batch ended) are dropped."""
        token = msg.subject[len(self._inbox):]
        batch = self._awaiting.pop(token, None)
        if batch is None:
            return
        index = batch.pending.pop(token)
        result, stream = _pub_ack(msg, batch.subjects[index], self.stream)
        batch.results[index] = result
        if stream is not None and stream not in self._windows:  # a stream not checked yet
            self._windows[stream] = None
            self._check_soon([stream])
        if not batch.pending:
            batch.finished.set()
        if self._room is not None and len(self._awaiting) < self.max_pending:
            self._room.set()
        if batch.answered is not None:
            batch.answered(index, result)

    def _check_soon(self, streams: Iterable[str]) -> None:
        """Read the windows of ``streams`` in a task of their own (a batch never waits for it),
        when the relay said how long its re-sends may take."""
        if self._resend is None:
            return
        self._to_check.update(streams)
        if self._to_check and (self._checker is None or self._checker.done()):
            self._checker = asyncio.get_running_loop().create_task(self._check_windows())

    async def _check_windows(self) -> None:
        while self._to_check:
            await self._check_window(self._to_check.pop())

    async def _check_window(self, stream: str) -> None:
        """Read ``stream``'s ``duplicate_window`` (``$JS.API.STREAM.INFO.<stream>``) and log
        when it is shorter than the re-send span, or cannot be read, once per new reading."""
        nc, resend = self._nc, self._resend
        if nc is None or resend is None:
            return
        self._checked_at = asyncio.get_running_loop().time()
        window: float | str
        try:
            reply = await nc.request(f"$JS.API.STREAM.INFO.{stream}", b"",
                                     timeout=min(WINDOW_CHECK_TIMEOUT, self.connect_timeout))
            window = _duplicate_window(reply.data)
        except Exception as exc:  # noqa: BLE001 - unchecked, said once below; forwarding goes on
            window = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        before, self._windows[stream] = self._windows.get(stream), window
        if window == before:
            return
        within, why = resend
        if isinstance(window, str):
            log.info("JetStream stream %s: cannot read its duplicate_window (%s); not checked against the %g s "
                     "within which a message may be sent again", stream, window, within)
        elif window < within:
            log.warning("JetStream stream %s: duplicate_window %g s is shorter than the %g s within which a message "
                        "may be sent again (%s): a message sent again after the window is stored twice; set the "
                        "stream's duplicate_window above %g s (forwarding notes, \"Guarantees\")",
                        stream, window, within, why, within)
        elif isinstance(before, float) and before < within:
            log.info("JetStream stream %s: duplicate_window %g s now covers the %g s within which a message may be "
                     "sent again", stream, window, within)

    def _addressed(self, message: Message) -> tuple[str, dict[str, str]] | Failed:
        """The subject and headers ``message`` is published with, or a permanent failure when
        it cannot be published at all. The checks of a subject and of a header name are
        remembered (most messages repeat them), at most :data:`CHECKS_KEPT` of each."""
        try:
            subject = self.subject.render(message)
        except ValueError as exc:
            return Failed(str(exc), permanent=True)
        problem = self._subject_problems.get(subject, _UNCHECKED)
        if problem is _UNCHECKED:
            problem = subject_problem(subject)
            _remember(self._subject_problems, subject, problem)
        if problem is not None:
            return Failed(f"event {message.event_id}: {problem}", permanent=True)
        headers = self._headers(message)
        names = self._good_names
        for name, value in headers.items():
            if name not in names or "\r" in value or "\n" in value or value != value.strip():
                problem = header_problem(name, value)
                if problem is not None:
                    return Failed(f"event {message.event_id}: {problem}", permanent=True)
                if len(names) >= CHECKS_KEPT:
                    names.clear()
                    names.update(OUTBOX_HEADERS)
                names.add(name)
        if self._nc is not None:
            limit = int(self._nc.max_payload)
            # "k: v\r\n" per header; UTF-8 lengths, from one encoding of all the names and values
            size = (len(message.body) + HEADER_BLOCK_OVERHEAD + 4 * len(headers)
                    + len("".join(itertools.chain(headers, headers.values())).encode()))
            if size > limit:
                return Failed(f"event {message.event_id}: message is {size} bytes (body {len(message.body)} and "
                              f"headers), over the server's max_payload of {limit} bytes", permanent=True)
        return subject, headers

    def _headers(self, message: Message) -> dict[str, str]:
        """The headers ``message`` is published with: the event's own but those named as one
        of outbox's (compared case-insensitively), then outbox's."""
        created = message.created_at
        headers = ({k: v for k, v in message.headers.items() if k.lower() not in _OUTBOX_HEADERS_LOWER}
                   if message.headers else {})
        headers["Nats-Msg-Id"] = message.idempotency_key
        headers["Outbox-Event-Id"] = str(message.event_id)
        headers["Outbox-Topic"] = message.topic
        headers["Outbox-Idempotency-Key"] = message.idempotency_key
        headers["Outbox-Created-At"] = (created if created.tzinfo is UTC else created.astimezone(UTC)).isoformat()
        if message.key is not None:
            headers["Outbox-Key"] = message.key
        if self.stream is not None:
            headers["Nats-Expected-Stream"] = self.stream
        return headers

    async def _await_room(self, seconds: float) -> None:
        """Wait until fewer than ``max_pending`` publishes (of every batch) await their PubAck,
        ``seconds`` pass, or the connection goes down."""
        room = self._room
        assert room is not None  # made by send_many
        stop = asyncio.get_running_loop().time() + seconds
        while len(self._awaiting) >= self.max_pending and self.connected:
            left = stop - asyncio.get_running_loop().time()
            if left <= 0:
                return
            room.clear()
            await self._wait(room, left)

    async def _await_answers(self, batch: _Batch, seconds: float) -> None:
        """Wait until every publish of ``batch`` is answered, ``seconds`` pass, or the
        connection goes down."""
        if seconds > 0 and batch.pending:
            batch.finished.clear()  # set whenever no publish awaited its answer, even mid-batch
            await self._wait(batch.finished, seconds)

    async def _wait(self, event: asyncio.Event, seconds: float) -> None:
        """Wait until ``event`` is set, ``seconds`` pass, or the connection goes down."""
        answered: asyncio.Future[Any] = asyncio.ensure_future(event.wait())
        down: asyncio.Future[Any] = asyncio.ensure_future(self._down.wait())
        try:
            await asyncio.wait({answered, down}, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            down.cancel()
            answered.cancel()


class _Batch:
    """One :meth:`JetStream.send_many` call in flight: each message's result (None until
    known), the subject each sent one went to, the publishes awaiting their PubAck (reply
    token -> index), who is told each answer (``answered``), and ``finished``, set once no
    publish awaits its answer."""

    __slots__ = ("answered", "finished", "pending", "results", "subjects")

    def __init__(self, size: int, answered: Answered | None) -> None:
        self.results: list[SendResult | None] = [None] * size
        self.subjects: dict[int, str] = {}
        self.pending: dict[str, int] = {}
        self.answered = answered
        self.finished = asyncio.Event()


def _pub_ack(msg: Any, subject: str, stream: str | None) -> tuple[SendResult, str | None]:
    """The result a reply to a publish to ``subject`` says, and the stream a PubAck names: a
    PubAck (JSON ``{"stream", "seq", "duplicate"}``), a JetStream API error (``{"error":
    {"code", "err_code", "description"}}``), or the server's no-responders status (503, an
    empty message with a ``Status`` header) when nothing binds the subject."""
    status = msg.headers.get("Status") if msg.headers else None
    if status == "503":
        return Failed(f"no JetStream stream binds subject {subject}", permanent=True), None
    try:
        answer = json.loads(msg.data) if msg.data else None
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        return Failed(f"NATS answered neither a PubAck nor an error (status {status}, "
                      f"{bytes(msg.data[:200])!r})"), None
    error = answer.get("error")
    if isinstance(error, dict):
        err_code = error.get("err_code")
        where = f" (expected stream {stream})" if err_code == 10060 and stream else ""
        return Failed(f"JetStream refused it: code {error.get('code')}, err_code {err_code}: "
                      f"{error.get('description')}{where}", permanent=err_code in PERMANENT_ERROR_CODES), None
    named = answer.get("stream")
    return Delivered(duplicate=bool(answer.get("duplicate"))), named if isinstance(named, str) else None


def _duplicate_window(data: bytes) -> float | str:
    """The ``duplicate_window`` in seconds of a ``STREAM.INFO`` answer (the config gives
    nanoseconds), or the API's error, or what was missing, as text."""
    try:
        answer = json.loads(data)
    except ValueError:
        return f"not a JetStream API answer: {bytes(data[:200])!r}"
    error = answer.get("error") if isinstance(answer, dict) else None
    if isinstance(error, dict):
        return f"JetStream API error {error.get('err_code')}: {error.get('description')}"
    config = answer.get("config") if isinstance(answer, dict) else None
    window = config.get("duplicate_window") if isinstance(config, dict) else None
    if isinstance(window, bool) or not isinstance(window, int | float):
        return "the stream's config names no duplicate_window"
    return window / 1e9


def _refused(exc: Exception) -> SendResult:
    """The result of a publish the client would not send: unavailable when its connection
    is closed, draining or reconnecting with a full buffer; failed otherwise."""
    import nats.errors  # noqa: PLC0415

    if isinstance(exc, nats.errors.ConnectionClosedError | nats.errors.ConnectionDrainingError
                  | nats.errors.OutboundBufferLimitError | nats.errors.ConnectionReconnectingError | OSError):
        return Unavailable(f"the connection to NATS is down ({type(exc).__name__})")
    return Failed(f"{type(exc).__name__}: {exc}")


def _remember(checks: dict[str, Any], key: str, answer: Any) -> None:
    """Keep one check's ``answer``, forgetting all the others once :data:`CHECKS_KEPT` are kept."""
    if len(checks) >= CHECKS_KEPT:
        checks.clear()
    checks[key] = answer


async def _quietly_close(nc: Any) -> None:
    """Close a client, whatever state it is in."""
    try:
        await nc.close()
    except Exception:  # noqa: BLE001 (closing after a failure: nothing more to report)
        pass


__all__ = ["JetStream", "PERMANENT_ERROR_CODES", "MAX_SUBJECT_BYTES", "header_problem", "parse_servers",
           "subject_problem"]
