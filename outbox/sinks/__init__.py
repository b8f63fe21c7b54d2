"""Sinks: the brokers a forwarder relays events to (forwarding notes).

A forwarder (``Outbox.forward``) is a consumer whose jobs are not run by a Python handler
but sent to a broker by a :class:`Sink`. Each job becomes one :class:`Message` (the event's
payload bytes as stored, its headers and outbox's own, see the mapping table in the
forwarding notes, "What a message carries"); the relay hands a sink batches, and the sink sends each batch
without waiting for one broker acknowledgement before the next send, then reports one
:data:`SendResult` per message, in order (and each broker answer as it arrives, when asked:
the relay completes a job on its acknowledgement, not on its batch's slowest one). The relay
does not wait for one batch before it hands over the next: a sink has several in flight.

* :class:`Delivered`: the broker stored it (JetStream's PubAck, RabbitMQ's confirm); the
  job completes. ``duplicate``: the broker already held a message with this id (JetStream's
  duplicate window), which completes the job too.
* :class:`Failed`: the broker refused it or did not answer in time. The attempt fails and
  counts (backoff, dead letter once out of attempts); ``permanent`` (a message no retry can
  deliver: over the server's size limit, a subject no stream binds, an address the key
  cannot be rendered into) dead-letters it at once. ``error`` names the broker's answer.
* :class:`Unavailable`: the connection to the broker is down (or the broker is silent: no
  message of the batch answered in time; or, RabbitMQ, the exchange does not exist). The
  job is handed back, the attempt not counted, and the relay claims no more of the
  forwarder's jobs for a while (until the sink has reconnected, and at least a growing
  pause): an outage makes jobs wait, it never dead-letters them.
* :class:`Expired`: not sent, because the message's ``deadline`` had passed when the sink
  was about to hand it to the broker (the job's claim may already be another relay's). The
  job is handed back, its attempt not counted.

A sink object is created when the forwarder is declared (in the application module, so a
bad option is a :class:`~outbox.errors.ConfigurationError` at import time) and connected by
the relay that runs it; one relay uses it from one thread and one event loop. Before it
connects, the relay tells it how long after a send it may send the same message again
(:meth:`Sink.expect_resends`, :func:`resend_span`), so a sink whose broker drops repeated
ids within a window (JetStream) can say when that window is too short.
"""

from __future__ import annotations

import abc
import math
import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from outbox.backoff import retry_delay
from outbox.errors import ConfigurationError, OutboxError

#: Fields a subject or routing-key template may name.
TEMPLATE_FIELDS = frozenset({"topic", "key", "consumer"})


@dataclass(frozen=True, slots=True)
class Message:
    """One job as a broker message. ``body``: the event's payload, the JSON text PostgreSQL
    stores (``payload::text``), UTF-8. ``headers``: the event's own headers (strings; other
    JSON values as their JSON text), passed through unchanged. ``idempotency_key`` is the
    job's (``"<consumer>:<event_id>"``), the same on every attempt: the broker-side message
    id. ``created_at``: the event's, aware (UTC). ``deadline``: ``time.monotonic()`` after
    which the sink must not hand the message to the broker (the relay sets it a safety margin
    before its claim's lease runs out; ``inf``: none)."""

    job_id: int
    event_id: int
    consumer: str
    topic: str
    key: str | None
    idempotency_key: str
    created_at: datetime
    body: bytes
    headers: Mapping[str, str] = field(default_factory=dict)
    deadline: float = math.inf


@dataclass(frozen=True, slots=True)
class Delivered:
    """The broker stored the message (``duplicate``: it held one with this id already)."""

    duplicate: bool = False


@dataclass(frozen=True, slots=True)
class Failed:
    """The broker refused the message or did not acknowledge it in time; ``error`` says
    what the broker answered. ``permanent``: no retry can deliver it (dead at once).
    ``unanswered``: the broker gave no answer at all in time; when no message of a batch was
    answered, the forwarder takes the broker for unreachable, not the messages for bad."""

    error: str
    permanent: bool = False
    unanswered: bool = False


@dataclass(frozen=True, slots=True)
class Unavailable:
    """The broker could not be reached: the job goes back, its attempt not counted."""

    error: str


@dataclass(frozen=True, slots=True)
class Expired:
    """Not sent: the message's ``deadline`` had passed when the sink was about to hand it to
    the broker. The job goes back, its attempt not counted; ``error`` says so."""

    error: str


#: What a sink reports for one message.
SendResult = Delivered | Failed | Unavailable | Expired

#: Told each broker answer as it arrives: ``answered(index, result)`` (the message's index in
#: its batch). Called from the sink's event loop; it must not block.
Answered = Callable[[int, SendResult], None]


class SinkUnavailableError(OutboxError):
    """Raised by :meth:`Sink.connect` when the broker cannot be reached (the relay retries
    with backoff); the message says why."""


def describe_error(exc: BaseException) -> str:
    """``"TypeName: message"``, or the type's name alone when the message is empty: how
    sinks name a client's exception in results and logs."""
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class Template:
    """A subject or routing-key template: ``str.format`` syntax naming only
    :data:`TEMPLATE_FIELDS` (``"orders.{topic}"``, ``"{topic}.{key}"``). ``what`` names it
    in errors (``"subject"``). Raises :class:`ConfigurationError` for a template that is not
    a string, does not parse, names another field, or uses attribute, index, conversion or
    format-spec syntax."""

    def __init__(self, text: object, what: str) -> None:
        if not isinstance(text, str) or not text:
            raise ConfigurationError(f"{what} template must be a non-empty string, got {text!r}")
        try:
            parts = list(string.Formatter().parse(text))
        except ValueError as exc:
            raise ConfigurationError(f"{what} template {text!r} does not parse: {exc}") from None
        fields: set[str] = set()
        for _, name, spec, conversion in parts:
            if name is None:
                continue
            if name not in TEMPLATE_FIELDS:
                raise ConfigurationError(f"{what} template {text!r} names unknown field {{{name}}}; "
                                         f"known: {', '.join('{' + f + '}' for f in sorted(TEMPLATE_FIELDS))}")
            if spec or conversion:
                raise ConfigurationError(f"{what} template {text!r}: {{{name}}} takes no conversion or format spec")
            fields.add(name)
        self.text = text
        self.what = what
        self.fields = frozenset(fields)

    def render(self, message: Message) -> str:
        """The address of ``message``. Raises :class:`ValueError` naming the message when the
        template names ``{key}`` and the event has none (a permanent failure)."""
        if "key" in self.fields and message.key is None:
            raise ValueError(f"event {message.event_id} has no key, and the {self.what} template {self.text!r} "
                             "needs one")
        return self.text.format(topic=message.topic, key=message.key or "", consumer=message.consumer)

    def __repr__(self) -> str:
        return f"Template({self.text!r})"


class Sink(abc.ABC):
    """A broker a forwarder sends to. Subclasses validate every option in ``__init__``
    (raising :class:`ConfigurationError`), import their client library only in
    :meth:`connect`, and implement the three coroutines below. A sink is used by one relay,
    from one event loop; :meth:`send_many` may be called again while earlier calls still
    wait for their acknowledgements."""

    #: The pip extra that installs the client library (``"nats"``, ``"rabbitmq"``, ``"kafka"``).
    extra: str = ""

    @abc.abstractmethod
    def describe(self) -> str:
        """Where it sends, for logs and ``status``, without credentials
        (``"nats://127.0.0.1:4222 subject orders.{topic}"``)."""

    @abc.abstractmethod
    async def connect(self) -> None:
        """Open the connection (and what it needs: a channel with publisher confirms).
        Raises :class:`SinkUnavailableError` when the broker cannot be reached."""

    @property
    @abc.abstractmethod
    def connected(self) -> bool:
        """Whether the connection is up now (a dropped one reports False until reconnected)."""

    @property
    def destination_problem(self) -> str | None:
        """Why the broker takes no message now although the connection is up (RabbitMQ: the
        exchange does not exist), as the last batch or connect found it; None when nothing
        is known to stand in the way (the default). The forwarder reports its broker back
        only once this is None."""
        return None

    @abc.abstractmethod
    async def send_many(self, messages: Sequence[Message], timeout: float,
                        answered: Answered | None = None) -> list[SendResult]:
        """Send ``messages`` without waiting for each acknowledgement in turn, then wait up
        to ``timeout`` seconds in all for the acknowledgements; one result per message, in
        order. A message whose ``deadline`` has passed when its turn to be handed to the
        broker comes is not sent (:class:`Expired`). ``answered``, when given, is told each
        broker answer as it arrives, before the call returns (at most once per message; the
        returned list holds those results too). Never raises for one message's failure: that
        message's result says it. (A sink written before ``answered`` existed, whose
        ``send_many`` takes only ``messages`` and ``timeout``, still works: the relay then
        calls it one batch at a time, completes its jobs when the call returns, and checks
        the deadlines only before it.)"""

    @abc.abstractmethod
    async def close(self) -> None:
        """Close the connection; safe to call when it is not open."""

    def expect_resends(self, within: float, why: str) -> None:
        """Called by the relay before :meth:`connect`: a message this sink sends may be sent
        again up to ``within`` seconds later (a crash, a lost acknowledgement; ``why`` names
        the parts, as :func:`resend_span` gives them). A sink whose broker drops repeated
        message ids within a window checks the window against it; the default ignores it."""
        return None


def resend_span(*, lease: float, reap_interval: float, poll_interval: float, timeout: float, max_attempts: int,
                backoff_base: float, backoff_cap: float) -> tuple[float, str]:
    """Seconds within which a relay may send a forwarder's message again after a send the
    broker may have stored, and the parts it is made of (for a log line). A message is sent
    again after one fault in two ways, and the span is the longer:

    * the relay dies, pauses or loses its database after the send and before the completion
      commits: the job stays ``running`` until its lease runs out (at most ``lease`` after
      the send, the lease being renewed before it), the reaper hands it back within
      ``reap_interval``, and a relay claims it within ``poll_interval`` (DESIGN 4 and 6);
    * the acknowledgement does not come within the forwarder's ``timeout``: the attempt
      fails and the job is sent again after its backoff, at most the delay after the
      next-to-last attempt, :func:`outbox.backoff.retry_delay` without jitter (DESIGN 5);
      the last attempt is not retried.

    Faults in a row add up (a retry whose acknowledgement is lost too); an outage of the
    broker itself (jobs handed back, no attempt counted) lasts as long as it lasts."""
    crash = lease + reap_interval + poll_interval
    why = (f"after a relay dies, lease {lease:g} s + reap interval {reap_interval:g} s + poll interval "
           f"{poll_interval:g} s = {crash:g} s")
    if max_attempts < 2:  # a failed attempt is the last one: never sent again
        return crash, why
    backoff = retry_delay(max_attempts - 1, base=backoff_base, cap=backoff_cap, jitter=0)
    unacknowledged = timeout + backoff
    return max(crash, unacknowledged), (
        f"the longer of: {why}; after an acknowledgement that does not come, timeout {timeout:g} s + the retry "
        f"delay after attempt {max_attempts - 1} of {max_attempts}, {backoff:g} s = {unacknowledged:g} s")
