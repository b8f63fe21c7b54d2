"""Typed events: pydantic models as payloads, on both sides.

Publishing: ``publish(s, "order.placed", OrderPlaced(...))`` or, when the model names its
topic in a class variable ``__topic__``, ``publish(s, OrderPlaced(...))``. The model is
dumped in JSON mode (``model_dump(mode="json")``: datetimes, decimals, UUIDs and enums
become JSON values) and validated again from that dump, so what is stored is exactly what a
subscriber of that model can read back; a model that does not survive the round trip (a
field assigned a bad value after construction, with ``validate_assignment`` off) raises
:class:`~outbox.errors.InvalidEventError` naming ``payload``, before anything is written.
From there the dump is an ordinary payload, with every rule of :func:`outbox.publish`.

Subscribing: ``@ob.subscriber("order.placed", payload=OrderPlaced)``, or the handler's
annotation ``def handler(job: Job[OrderPlaced])``. Before each attempt the stored JSON is
validated as the model (``model_validate_json``, in the handler's thread) and
``job.payload`` is that instance (a type checker sees it: ``Job[OrderPlaced].payload`` is
an ``OrderPlaced``). A payload that does not validate fails the attempt with
:class:`~outbox.errors.PermanentError`: the job is dead at once with the validation error
as its ``last_error``, never retried, since no retry changes the stored payload (fix the
model or the publisher, then redrive). Handlers without a model get ``json.loads``' value,
as before; forwarders send the stored text and take no model.
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ValidationError

from outbox.errors import ConfigurationError, InvalidEventError, PermanentError
from outbox.job import Job

#: The class variable a model names its topic in.
TOPIC_ATTRIBUTE = "__topic__"
#: Longest validation error kept in a message (the job's last_error is bounded anyway).
MAX_ERROR_CHARS = 2000


def topic_of(model: type[BaseModel]) -> str | None:
    """The topic ``model`` declares in ``__topic__`` (a class variable), or None."""
    topic = getattr(model, TOPIC_ATTRIBUTE, None)
    return topic if isinstance(topic, str) else None


def topic_and_payload(topic: Any, payload: Any, missing: Any) -> tuple[Any, Any]:
    """(topic, payload) of a publish given a model alone (``payload`` is ``missing``): the
    model's ``__topic__`` and the model; any other call as given, when it has a payload.
    Raises InvalidEventError naming ``topic`` (a model alone that declares no topic) or
    ``payload`` (none given, or given beside a model in the topic's place)."""
    if isinstance(topic, BaseModel):
        if payload is not missing:
            raise InvalidEventError("payload", f"is given beside a {type(topic).__name__} in the topic's place; "
                                               "pass publish(session, model) or publish(session, topic, model)")
        declared = topic_of(type(topic))
        if declared is None:
            raise InvalidEventError("topic", f"is missing: {type(topic).__name__} declares no {TOPIC_ATTRIBUTE} "
                                             "(a ClassVar[str]); pass the topic before the model")
        return declared, topic
    if payload is missing:
        raise InvalidEventError("payload", "is missing; pass publish(session, topic, payload)")
    return topic, payload


def dump(payload: BaseModel) -> Any:
    """``payload`` as the JSON value publish stores: ``model_dump(mode="json", by_alias=True)``
    (an alias is the name a field has in JSON, and what validation reads), checked by
    validating it again as ``type(payload)``. Raises InvalidEventError naming ``payload``
    with pydantic's error when that validation fails: a subscriber of the model could not
    read it either (a field assigned a bad value after construction, a required field
    excluded from dumps, computed fields under ``extra="forbid"``)."""
    data = payload.model_dump(mode="json", by_alias=True)
    model = type(payload)
    try:
        model.model_validate(data)
    except ValidationError as exc:
        raise InvalidEventError("payload", f"does not validate as {model.__name__} once dumped: "
                                           f"{_shown(exc)}") from None
    return data


def _shown(exc: ValidationError) -> str:
    text = str(exc)
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS - 3] + "..."


def declared_payload(handler: Callable[..., Any], payload: type[BaseModel] | None, where: str) -> type[BaseModel] | None:
    """The payload model of a subscriber: ``payload`` if given, else the ``X`` of a first
    parameter annotated ``Job[X]`` (X a pydantic model), else None. Raises
    ConfigurationError naming ``where`` when ``payload`` is not a pydantic model class, when
    it and the annotation name different models, when the annotation names models in a
    union (``Job[Model | None]``), or when an annotation that names ``Job[...]`` does not
    resolve (a model defined inside a function, under ``from __future__ import annotations``)."""
    if payload is not None and not (isinstance(payload, type) and issubclass(payload, BaseModel)):
        raise ConfigurationError(f"{where}: payload= must be a pydantic model class, got {payload!r}")
    annotated = _annotated_model(handler, where)
    if payload is not None and annotated is not None and annotated is not payload:
        raise ConfigurationError(f"{where}: payload={payload.__name__} but the handler's job is annotated "
                                 f"Job[{annotated.__name__}]; name one model")
    return payload if payload is not None else annotated


def _annotated_model(handler: Callable[..., Any], where: str) -> type[BaseModel] | None:
    try:
        parameters = list(inspect.signature(handler).parameters.values())
    except (TypeError, ValueError):  # no signature: the registry says what it needs
        return None
    if not parameters:
        return None
    raw = parameters[0].annotation
    try:
        hint = typing.get_type_hints(handler).get(parameters[0].name)
    except Exception as exc:  # noqa: BLE001 - a NameError, or whatever evaluating an annotation raised
        if isinstance(raw, str) and "Job[" in raw.replace(" ", ""):
            raise ConfigurationError(f"{where}: the job's annotation {raw!r} does not resolve ({exc}): a model "
                                     "defined inside a function, or a forward reference; pass payload=Model "
                                     "or define the model at module level") from None
        return None
    if typing.get_origin(hint) is not Job:
        return None
    (argument,) = typing.get_args(hint)
    if isinstance(argument, type) and issubclass(argument, BaseModel):
        return argument
    if any(isinstance(a, type) and issubclass(a, BaseModel) for a in typing.get_args(argument)):
        raise ConfigurationError(f"{where}: the job is annotated Job[{argument}]; a payload model is one pydantic "
                                 "model class (Optional and unions are not taken: a payload that is not the "
                                 "model is dead at once)")
    return None  # Job[Any], Job[dict[str, Any]]: plain JSON


def decode(job: Job[Any], model: type[BaseModel]) -> None:
    """Make ``job.payload`` the stored payload validated as ``model``. Raises
    PermanentError (the job goes dead at once) with pydantic's error when it does not
    validate, or with the error a validator raised that pydantic does not wrap
    (``TypeError``): no retry changes a stored payload."""
    try:
        job.use_payload(model.model_validate_json(job.payload_json))
    except (ValidationError, TypeError, ValueError) as exc:  # a validator's TypeError is not pydantic's
        shown = _shown(exc) if isinstance(exc, ValidationError) else f"{type(exc).__name__}: {exc}"
        raise PermanentError(f"payload of event {job.event_id} does not validate as {model.__name__}: "
                             f"{shown}") from exc


def typed_handler(handler: Callable[..., Any], model: type[BaseModel]) -> Callable[..., Any]:
    """``handler`` with the payload decoded as ``model`` before each call (:func:`decode`):
    the same arguments, a coroutine function for a coroutine function."""
    if inspect.iscoroutinefunction(handler):
        @functools.wraps(handler)
        async def run_async(job: Job[Any], *rest: Any) -> Any:
            decode(job, model)
            return await handler(job, *rest)
        return run_async

    @functools.wraps(handler)
    def run(job: Job[Any], *rest: Any) -> Any:
        decode(job, model)
        return handler(job, *rest)
    return run
