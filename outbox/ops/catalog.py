"""The event catalog: what an application's registry says about its topics, as a document.

``outbox-relay catalog --app myapp.jobs:ob`` reads the registry (no database): every topic a
subscriber or forwarder listens to, each consumer's mode and delivery settings (attempts,
lease, priority, ordering, flow control, timeout), each forwarder's destination (its sink's
``describe()``, which holds no credentials), and the payload's JSON Schema where a consumer
declares a pydantic model (:mod:`outbox.typed_events`). Three formats:

* ``asyncapi`` (the default): an AsyncAPI 3.0.0 document. A topic is a channel (its id the
  topic with every character outside ``[A-Za-z0-9_-]`` replaced by ``_``, made unique; its
  ``address`` the topic itself); each consumer is a ``receive`` operation on its topic's
  channels; a declared model is the channel's message payload, its JSON Schema (validation
  mode, by alias: what publish stores) and its nested models' in ``components.schemas``, all
  made at once by pydantic so that models of one name in two modules stay apart; outbox's
  settings are ``x-outbox`` extensions of the operation, a forwarder's destination
  ``x-outbox-forward-to``.
  A test validates the document against the AsyncAPI 3.0.0 JSON Schema.
* ``json``: the catalog itself, one object (``topics``: name -> consumers and schemas;
  ``intakes``: see below).
* ``markdown``: a page per application, a section per topic.

The registry's intakes (:mod:`outbox.intake`) are listed beside the topics: name, source
(its ``describe()``, no credentials or secrets), the topics they write (or how a message's
topic is found), whether ordered; in AsyncAPI as the root extension ``x-outbox-intakes``.

Two consumers of one topic that declare different models give the channel two messages
(one per model). The catalog says what the registry declares; what publishers send is not
checked here (a typed subscriber's job is dead at once when its payload does not validate).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from outbox.registry import Outbox, Subscriber

FORMATS = ("asyncapi", "json", "markdown")
ASYNCAPI_VERSION = "3.0.0"


@dataclass(frozen=True)
class Consumer:
    """One consumer of a topic as the catalog shows it."""

    name: str
    kind: str  # "handler" or "forwarder"
    mode: str  # "lease" or "transactional"
    is_async: bool
    max_attempts: int
    lease: float | None
    priority: int
    ordered: bool
    on_dead: str
    concurrency: int | None
    rate_limit: float | None
    timeout: float | None
    topics: tuple[str, ...]
    payload: str | None = None  # the model's name
    forward_to: str | None = None


@dataclass
class Topic:
    """One topic: its consumers, and the models they declare by the name the catalog gives
    them (the class's name; ``module.qualname`` where two models share a name)."""

    name: str
    consumers: list[Consumer] = field(default_factory=list)
    models: dict[str, type[BaseModel]] = field(default_factory=dict)

    @property
    def schemas(self) -> dict[str, dict[str, Any]]:
        """Each model's JSON Schema, whole (its nested models under ``$defs``)."""
        return {name: model.model_json_schema() for name, model in self.models.items()}


@dataclass(frozen=True)
class IntakeEntry:
    """One intake as the catalog shows it."""

    name: str
    source: str
    topics: str  # the topics it writes, comma-separated, or how a message's topic is found
    ordered: bool


def intakes(registry: Outbox) -> list[IntakeEntry]:
    """The registry's intakes, by name."""
    out = []
    for intake in sorted(registry.intakes, key=lambda i: i.name):
        known = intake.topics()
        topics = (", ".join(known) if known is not None else
                  "the sender's Outbox-Topic header" if intake.topic is None else "chosen per message by a function")
        out.append(IntakeEntry(intake.name, intake.source.describe(), topics, intake.ordered))
    return out


def build(registry: Outbox) -> dict[str, Topic]:
    """The catalog of ``registry``: topic name -> :class:`Topic`, sorted by name."""
    models = {sub.payload_type for sub in registry if sub.payload_type is not None}
    short = [m.__name__ for m in models]
    names = {m: m.__name__ if short.count(m.__name__) == 1 else f"{m.__module__}.{m.__qualname__}" for m in models}
    topics: dict[str, Topic] = {}
    for sub in sorted(registry, key=lambda s: s.consumer):
        consumer = _consumer(sub, names)
        for name in sub.topics:
            topic = topics.setdefault(name, Topic(name))
            topic.consumers.append(consumer)
            if sub.payload_type is not None:
                topic.models[names[sub.payload_type]] = sub.payload_type
    return dict(sorted(topics.items()))


def _consumer(sub: Subscriber, names: dict[type[BaseModel], str]) -> Consumer:
    return Consumer(
        name=sub.consumer, kind="forwarder" if sub.sink is not None else "handler",
        mode="transactional" if sub.transactional else "lease", is_async=sub.is_async,
        max_attempts=sub.max_attempts, lease=sub.lease, priority=sub.priority, ordered=sub.ordered,
        on_dead=sub.on_dead, concurrency=sub.concurrency, rate_limit=sub.rate_limit, timeout=sub.timeout,
        topics=sub.topics, payload=names[sub.payload_type] if sub.payload_type is not None else None,
        forward_to=sub.sink.describe() if sub.sink is not None else None)


def as_json(catalog: dict[str, Topic], taken: list[IntakeEntry] | None = None) -> dict[str, Any]:
    """The catalog (and the intakes ``taken``) as one JSON-ready object."""
    return {"topics": {name: {"consumers": [asdict(c) for c in topic.consumers], "schemas": topic.schemas}
                       for name, topic in catalog.items()},
            "intakes": [asdict(i) for i in taken or []]}


def _key(name: str) -> str:
    """``name`` as an AsyncAPI component key (``^[A-Za-z0-9_.-]+$``): a generic model's
    ``Page[Item]`` becomes ``Page_Item_``."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def _ids(names: list[str]) -> dict[str, str]:
    """name -> an AsyncAPI key (``^[A-Za-z0-9_-]+$``), unique among ``names``."""
    taken: set[str] = set()
    out: dict[str, str] = {}
    for name in names:
        base = re.sub(r"[^A-Za-z0-9_-]", "_", name) or "_"
        key, n = base, 2
        while key in taken:
            key, n = f"{base}_{n}", n + 1
        taken.add(key)
        out[name] = key
    return out


def as_asyncapi(catalog: dict[str, Topic], title: str = "outbox application", version: str = "1.0.0",
                taken: list[IntakeEntry] | None = None) -> dict[str, Any]:
    """The catalog as an AsyncAPI 3.0.0 document (module notes); the intakes ``taken`` as
    the root extension ``x-outbox-intakes``."""
    channel_ids = _ids(list(catalog))
    consumers = {c.name: c for topic in catalog.values() for c in topic.consumers}
    operation_ids = _ids(sorted(consumers))
    models = {name: model for topic in catalog.values() for name, model in topic.models.items()}
    # All models at once: pydantic names their definitions apart (two Items of two modules)
    # and a recursive model's definition is kept whole.
    refs, definitions = models_json_schema([(m, "validation") for m in models.values()],
                                           ref_template="#/components/schemas/{model}")
    schemas: dict[str, Any] = definitions.get("$defs", {})
    messages: dict[str, Any] = {}
    channels: dict[str, Any] = {}
    for name, topic in catalog.items():
        channel: dict[str, Any] = {"address": name, "title": name}
        if topic.models:
            channel["messages"] = {}
            for model_name, model in topic.models.items():
                key = _key(model_name)
                messages[key] = {"name": model_name, "contentType": "application/json",
                                 "payload": refs[(model, "validation")]}
                channel["messages"][key] = {"$ref": f"#/components/messages/{key}"}
        channels[channel_ids[name]] = channel
    operations: dict[str, Any] = {}
    for name, consumer in sorted(consumers.items()):
        operation: dict[str, Any] = {
            "action": "receive",
            "channel": {"$ref": f"#/channels/{channel_ids[consumer.topics[0]]}"},
            "title": name,
            "summary": (f"forwarded to {consumer.forward_to}" if consumer.kind == "forwarder"
                        else f"{consumer.mode} handler{' (async)' if consumer.is_async else ''}"),
            "x-outbox": {k: v for k, v in asdict(consumer).items()
                         if k not in ("name", "topics", "forward_to", "payload") and v is not None},
        }
        if len(consumer.topics) > 1:  # one consumer of several topics: the others as an extension
            operation["x-outbox"]["topics"] = list(consumer.topics)
        if consumer.forward_to is not None:
            operation["x-outbox-forward-to"] = consumer.forward_to
        if consumer.payload is not None:
            operation["messages"] = [{"$ref": f"#/channels/{channel_ids[consumer.topics[0]]}/messages/"
                                             f"{_key(consumer.payload)}"}]
        operations[operation_ids[name]] = operation
    document: dict[str, Any] = {"asyncapi": ASYNCAPI_VERSION, "info": {"title": title, "version": version},
                                "defaultContentType": "application/json", "channels": channels,
                                "operations": operations}
    if schemas or messages:
        document["components"] = {"schemas": schemas, "messages": messages}
    if taken:
        document["x-outbox-intakes"] = [asdict(i) for i in taken]
    return document


def as_markdown(catalog: dict[str, Topic], title: str = "outbox application",
                taken: list[IntakeEntry] | None = None) -> str:
    """The catalog as a markdown page: a section per topic, a table of its consumers, and
    each declared model's JSON Schema; then the intakes ``taken``, when any."""
    lines = [f"# {title}: event catalog", ""]
    if not catalog:
        lines.append("No topics: the registry declares no subscriber or forwarder.")
    for name, topic in catalog.items():
        lines += [f"## `{name}`", "", "| consumer | kind | mode | attempts | lease (s) | priority | timeout (s) "
                  "| ordered | concurrency | rate limit | payload | forwarded to |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for c in topic.consumers:
            lines.append(f"| `{c.name}` | {c.kind} | {c.mode}{' (async)' if c.is_async else ''} | {c.max_attempts} "
                         f"| {_or_dash(c.lease, 'default')} | {c.priority} | {_or_dash(c.timeout)} "
                         f"| {'yes, dead ' + c.on_dead + 's' if c.ordered else 'no'} | {_or_dash(c.concurrency)} "
                         f"| {_or_dash(c.rate_limit, suffix='/s')} | {c.payload or '-'} | {c.forward_to or '-'} |")
        for model, schema in topic.schemas.items():
            lines += ["", f"`{model}`:", "", "```json", json.dumps(schema, indent=2), "```"]
        lines.append("")
    if taken:
        lines += ["## Intakes", "", "| intake | takes in from | writes topics | ordered |", "|---|---|---|---|"]
        lines += [f"| `{i.name}` | {i.source} | {i.topics} | {'yes' if i.ordered else 'no'} |" for i in taken]
    return "\n".join(lines).rstrip("\n") + "\n"


def _or_dash(value: float | None, none: str = "-", suffix: str = "") -> str:
    return none if value is None else f"{value:g}{suffix}"


def render(registry: Outbox, fmt: str = "asyncapi", title: str = "outbox application") -> str:
    """The catalog of ``registry`` in format ``fmt`` (:data:`FORMATS`), as text. Raises
    ValueError for an unknown format."""
    catalog, taken = build(registry), intakes(registry)
    if fmt == "asyncapi":
        return json.dumps(as_asyncapi(catalog, title, taken=taken), indent=2) + "\n"
    if fmt == "json":
        return json.dumps(as_json(catalog, taken), indent=2) + "\n"
    if fmt == "markdown":
        return as_markdown(catalog, title, taken)
    raise ValueError(f"unknown catalog format {fmt!r}; one of {', '.join(FORMATS)}")
