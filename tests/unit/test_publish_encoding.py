"""Validation and encoding of events, without a database: the fast path of ``publish`` and
``publish_many`` accepts and refuses exactly what the full walk of every value (kept below
as the reference, as it was before the fast path existed) accepts and refuses, with the
same JSON text and the same error message. The reference writes its JSON itself, floats
with a positive exponent in positional notation (``publish``'s module notes on numbers);
tests/integration/test_publish.py checks that jsonb gives every number back unchanged."""

from __future__ import annotations

import collections
import datetime as dt
import decimal
import enum
import json
import math
import sys
import types
from collections.abc import Mapping
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from outbox.errors import InvalidEventError
from outbox.publish import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    MAX_DEPTH,
    MAX_HEADERS_BYTES,
    MAX_INT_DIGITS,
    MAX_KEY_LENGTH,
    MAX_NAME_LENGTH,
    EventDraft,
    _encode_many,
    make_event,
)
from tests.hypothesis_profiles import examples

publish_module = sys.modules["outbox.publish"]  # outbox.publish the attribute is the function

# ------------------------------------------------------------- the reference walk

_REF_INT_LIMIT = 10**MAX_INT_DIGITS  # the rule: at most MAX_INT_DIGITS decimal digits
_REF_MAX_INT_BITS = _REF_INT_LIMIT.bit_length() - 1  # around the edge the strategies draw from


def ref_check_name(value: Any, field: str, limit: int = MAX_NAME_LENGTH) -> str:
    if value is None:
        raise InvalidEventError(field, "is required")
    if not isinstance(value, str):
        raise InvalidEventError(field, f"must be a str, got {type(value).__name__}")
    if not value.strip():
        raise InvalidEventError(field, "must not be empty")
    if len(value) > limit:
        raise InvalidEventError(field, f"is {len(value)} characters long, the limit is {limit}")
    ref_check_text(value, field)
    return value


def ref_check_text(value: str, where: str) -> None:
    if "\x00" in value:
        raise InvalidEventError(where, "contains a NUL character (\\u0000), which PostgreSQL cannot store")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidEventError(where, "contains an unpaired surrogate, which is not valid Unicode") from None


def ref_check_json(value: Any, where: str, depth: int = 0) -> None:
    if depth > MAX_DEPTH:
        raise InvalidEventError(where, f"nests deeper than {MAX_DEPTH} levels")
    if value is None or value is True or value is False:
        return
    kind = type(value)
    if kind is str:
        ref_check_text(value, where)
    elif kind is int:
        if abs(value) >= _REF_INT_LIMIT:
            raise InvalidEventError(where, f"is an integer of more than {MAX_INT_DIGITS} digits")
    elif kind is float:
        if not math.isfinite(value):
            raise InvalidEventError(where, f"{value!r} is not a JSON number")
    elif isinstance(value, Mapping):
        for k, v in value.items():
            if not isinstance(k, str):
                raise InvalidEventError(where, f"has a key of type {type(k).__name__}; JSON keys must be str")
            ref_check_text(k, f"{where} key {k[:40]!r}")
            ref_check_json(v, f"{where}[{k[:40]!r}]", depth + 1)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            ref_check_json(v, f"{where}[{i}]", depth + 1)
    elif isinstance(value, (str, int, float)):
        ref_check_json(ref_plain(value), where, depth)
    else:
        raise InvalidEventError(where, f"{type(value).__name__} is not JSON-serialisable")


def ref_plain(value: str | int | float) -> str | int | float:
    for base in (int, float, str):
        if isinstance(value, base):
            return base(value)
    raise AssertionError(type(value))


def ref_mapping_as_dict(value: Any) -> dict:
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError(f"{type(value).__name__} is not JSON-serialisable")


def ref_float(value: float) -> str:
    """``repr`` as jsonb prints it back: a positive exponent moved into the digits (1.5e+300 ->
    15 and 299 zeros, then ".0"), a negative one into zeros after the point (1.5e-07 ->
    0.00000015), and -0.0 as 0.0."""
    if value == 0:
        return "0.0"
    text = repr(value)
    mantissa, _, exponent = text.partition("e")
    if not exponent:
        return text
    sign, mantissa = ("-", mantissa[1:]) if mantissa.startswith("-") else ("", mantissa)
    whole, _, fraction = mantissa.partition(".")
    if exponent.startswith("-"):
        return f"{sign}0.{'0' * (-int(exponent) - 1)}{whole}{fraction}"
    zeros = int(exponent) - len(fraction)
    assert zeros >= 0, text
    return f"{sign}{whole}{fraction}{'0' * zeros}.0"


def ref_dumps(value: Any) -> str:
    """Compact JSON of a value ``ref_check_json`` accepted, written without json's encoder
    except for strings (whose escaping is json's own)."""
    if value is None:
        return "null"
    if value is True or value is False:
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, int):
        return int.__repr__(value)
    if isinstance(value, float):
        return ref_float(float(value))
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{ref_dumps(k)}:{ref_dumps(v)}" for k, v in value.items()) + "}"
    assert isinstance(value, (list, tuple)), type(value)
    return "[" + ",".join(ref_dumps(v) for v in value) + "]"


def ref_encode(value: Any, field: str, limit: int) -> str:
    ref_check_json(value, field)
    text = ref_dumps(value)
    size = len(text.encode("utf-8"))
    if size > limit:
        raise InvalidEventError(field, f"is {size} bytes encoded, the limit is {limit} bytes")
    return text


def ref_make_event(topic: Any, payload: Any, key: Any = None, headers: Any = None, *,
                   max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> EventDraft:
    ref_check_name(topic, "topic")
    if key is not None:
        ref_check_name(key, "key", MAX_KEY_LENGTH)
    if headers is None:
        headers = {}
    elif not isinstance(headers, Mapping):
        raise InvalidEventError("headers", f"must be a mapping, got {type(headers).__name__}")
    return EventDraft(topic=topic, key=key, payload=ref_encode(payload, "payload", max_payload_bytes),
                      headers=ref_encode(dict(headers), "headers", MAX_HEADERS_BYTES))


def outcome(function: Any, *args: Any, **kwargs: Any) -> tuple[str, Any]:
    """("ok", result) or ("refused", message); any other exception propagates."""
    try:
        return "ok", function(*args, **kwargs)
    except InvalidEventError as exc:
        return "refused", (exc.field, exc.problem)


def assert_same(*args: Any, **kwargs: Any) -> None:
    assert outcome(make_event, *args, **kwargs) == outcome(ref_make_event, *args, **kwargs)


# ------------------------------------------------------------------- strategies


class Color(str, enum.Enum):
    RED = "red"


class Size(enum.IntEnum):
    L = 3


class Rate(float, enum.Enum):
    HALF = 0.5


Point = collections.namedtuple("Point", "x y")

# Any code point, unpaired surrogates and NUL included, and the characters JSON escapes.
characters = st.characters(codec=None, categories=None)
texts = st.one_of(
    st.text(characters, max_size=12),
    st.text(st.sampled_from("a\\u0\x00\"\n\ud800\udc00é🙂 "), max_size=12),
    st.sampled_from(["\\u0000", "\\\\u0000", "a\\u0000b", "\\\\\x00", "\x00", "\ud83d", " ", "\t\n", ""]),
    st.sampled_from(["1e+16", "e+", '"1e+16"', '\\"1e+16', "x\\", '":1e+16,"']),  # what the float rewrite must skip
)
# Floats of every magnitude, and the ones at the edges of repr's notations and of numeric.
floats = st.one_of(
    st.floats(), st.floats(allow_subnormal=True, min_value=-1e-300, max_value=1e-300),
    st.floats(min_value=1e15, max_value=1e18).flatmap(lambda x: st.sampled_from([x, -x])),
    st.sampled_from([1e16, -1e16, 1e308, -1e308, 5e-324, -5e-324, 1.5e300, 1e-7, 1e-5, 1e-4, 0.0001, 1e15,
                     9999999999999998.0, 1e16 + 2, float(2**53 + 1), 1.7976931348623157e308,
                     2.2250738585072014e-308, 123456789012345678.0, 0.1, -2.5e-300, 0.0, -0.0]),
)
# Around the size limit (and past the 4,300 digits Python refuses to print), either sign.
big_ints = st.tuples(
    st.one_of(st.sampled_from([999, 1000, 4299, 4300, 5000]).map(lambda digits: 10**digits),
              st.sampled_from([-1, 0, 1]).map(lambda offset: 2**_REF_MAX_INT_BITS + offset),
              st.sampled_from([-1, 0, 1]).map(lambda offset: _REF_INT_LIMIT + offset),
              st.sampled_from([-1, 0, 1]).map(lambda offset: -_REF_INT_LIMIT + offset),
              st.sampled_from([-1, 0]).map(lambda offset: 10**1000 + offset)),
    st.sampled_from([1, -1]),
).map(lambda pair: pair[0] * pair[1])
leaves = st.one_of(
    st.none(), st.booleans(), st.integers(), big_ints,
    floats,  # NaN and infinities included
    texts,
    st.sampled_from([Color.RED, Size.L, Rate.HALF, True, False, 0, -0.0, 1e308]),
    st.sampled_from([b"bytes", {1, 2}, frozenset(), decimal.Decimal("1.5"), dt.date(2024, 1, 1), object, len]),
)
keys = st.one_of(texts, texts, st.integers(), st.none(), st.booleans(), st.floats(), st.tuples(st.integers()),
                 st.sampled_from([Color.RED, Size.L]))


def containers(children: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(keys, children, max_size=4),
        st.dictionaries(texts, children, max_size=4),
        st.dictionaries(texts, children, max_size=3).map(types.MappingProxyType),
        st.dictionaries(texts, children, max_size=3).map(collections.OrderedDict),
        st.tuples(children, children).map(lambda t: Point(*t)),
    )


json_like = st.recursive(leaves, containers, max_leaves=20)


@st.composite
def deep(draw: st.DrawFn) -> Any:
    """A value wrapped in 60..70 levels of lists and dicts, around the depth limit."""
    value = draw(st.one_of(st.sampled_from([1, "x", None, [], {}, (), [1], {"k": None}]), json_like))
    for kind in draw(st.lists(st.sampled_from(["list", "dict", "tuple"]), min_size=MAX_DEPTH - 4,
                              max_size=MAX_DEPTH + 6)):
        value = [value] if kind == "list" else (value,) if kind == "tuple" else {"k": value}
    return value


payloads = st.one_of(json_like, deep())
names = st.one_of(
    texts, st.text(st.characters(codec="ascii"), min_size=1, max_size=20),
    st.sampled_from(["t" * MAX_NAME_LENGTH, "t" * (MAX_NAME_LENGTH + 1), "k" * MAX_KEY_LENGTH,
                     "k" * (MAX_KEY_LENGTH + 1), "\u3000", "a\u3000", "order.placed", Color.RED]),
    st.sampled_from([None, 4, b"t", 1.5]),
)


# ------------------------------------------------------------------- properties


@settings(max_examples=examples(2000), deadline=None)
@given(payload=payloads, limit=st.sampled_from([DEFAULT_MAX_PAYLOAD_BYTES, 2, 40, 100]))
@example(payload={"a": "\x00"}, limit=100)
@example(payload="\\u0000", limit=100)
@example(payload={"\\u0000": 1}, limit=100)
@example(payload=[math.nan], limit=100)
@example(payload={1: 2}, limit=100)
@example(payload={"a": 10**1000}, limit=DEFAULT_MAX_PAYLOAD_BYTES)
@example(payload={"a": 2**_REF_MAX_INT_BITS}, limit=DEFAULT_MAX_PAYLOAD_BYTES)
@example(payload={"a": 2**_REF_MAX_INT_BITS - 1}, limit=DEFAULT_MAX_PAYLOAD_BYTES)
@example(payload="é" * 60, limit=100)
@example(payload="\ud800", limit=100)
def test_payload_same_as_reference(payload: Any, limit: int) -> None:
    assert_same("t", payload, max_payload_bytes=limit)


@settings(max_examples=examples(500), deadline=None)
@given(headers=st.one_of(st.none(), json_like, containers(json_like)))
def test_headers_same_as_reference(headers: Any) -> None:
    assert_same("t", {}, headers=headers)


@settings(max_examples=examples(1500), deadline=None)
@given(topic=names, key=st.one_of(st.none(), names))
def test_names_same_as_reference(topic: Any, key: Any) -> None:
    assert_same(topic, {"n": 1}, key=key)


@settings(max_examples=examples(500), deadline=None)
@given(topic=names, key=st.one_of(st.none(), names), payload=payloads, headers=st.one_of(st.none(), json_like))
def test_whole_event_same_as_reference(topic: Any, key: Any, payload: Any, headers: Any) -> None:
    """Several problems at once: the first one reported is the same (topic, key, headers'
    type, payload, headers in turn)."""
    assert_same(topic, payload, key=key, headers=headers, max_payload_bytes=200)


# ---------------------------------------------------------------- chosen cases


def _circular() -> dict:
    d: dict[str, Any] = {}
    d["self"] = [d]
    return d


@pytest.mark.parametrize("payload", [
    pytest.param(_circular(), id="circular"),
    pytest.param({"a": [1, {"b": "\x00"}]}, id="nul-deep"),
    pytest.param({"a": "\\u0000"}, id="escaped-backslash-not-nul"),
    pytest.param({"a": "\\\x00"}, id="backslash-then-nul"),
    pytest.param({"big": [10**999, 10**1000]}, id="int-one-digit-too-many"),
    pytest.param({"a": [math.inf]}, id="inf-deep"),
    pytest.param({"x": "x" * (DEFAULT_MAX_PAYLOAD_BYTES + 1)}, id="over-limit"),
    pytest.param({"e": Color.RED, "s": Size.L, "m": types.MappingProxyType({"a": 1})}, id="subclasses"),
    pytest.param({"ok": [1, 2.5, "s", None, True, {"n": []}]}, id="plain"),
])
def test_chosen_payloads_same_as_reference(payload: Any) -> None:
    assert_same("t", payload)


@pytest.mark.parametrize("levels", [MAX_DEPTH - 1, MAX_DEPTH, MAX_DEPTH + 1, 10_000])
@pytest.mark.parametrize("kind", ["list", "dict", "tuple"])
@pytest.mark.parametrize("leaf", [1, [], {}, "x"])
def test_depth_limit_same_as_reference(levels: int, kind: str, leaf: Any) -> None:
    value = leaf
    for _ in range(levels):
        value = [value] if kind == "list" else (value,) if kind == "tuple" else {"k": value}
    assert_same("t", value)


def test_plain_payload_encodes_compact_and_keeps_non_ascii() -> None:
    draft = make_event("order.placed", {"id": 4, "name": "ünï 🙂", "tags": ("a", "b"), "x": 0.1}, key="order:4",
                       headers={"trace": "abc"})
    assert draft == EventDraft("order.placed", "order:4", '{"id":4,"name":"ünï 🙂","tags":["a","b"],"x":0.1}',
                               '{"trace":"abc"}')


# ------------------------------------------------------------------ publish_many


#: Stands for the problem of a malformed publish_many item: only the field is compared.
MALFORMED = "malformed item"


def ref_publish_many_drafts(events: Any, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> list[EventDraft]:
    """The validation loop of publish_many, on the reference make_event: a tuple or list of
    2 to 4 items, or a mapping with topic, payload and only key and headers besides (the
    options take another path); anything else is refused naming the item."""
    drafts = []
    for index, item in enumerate(events):
        if isinstance(item, (tuple, list)) and not 2 <= len(item) <= 4:
            raise InvalidEventError(f"events[{index}]", MALFORMED)
        fields = dict(item) if isinstance(item, Mapping) else dict(zip(("topic", "payload", "key", "headers"), item))
        unknown = set(fields) - {"topic", "payload", "key", "headers"}
        if unknown or "topic" not in fields or "payload" not in fields:
            raise InvalidEventError(f"events[{index}]", MALFORMED)
        try:
            drafts.append(ref_make_event(max_payload_bytes=max_payload_bytes, **fields))
        except InvalidEventError as exc:
            raise InvalidEventError(f"events[{index}].{exc.field}", exc.problem) from None
    return drafts


def ref_document(drafts: list[EventDraft]) -> str:
    def string(value: str | None) -> str:
        return json.dumps(value, ensure_ascii=False)
    return "[" + ",".join(f"[{string(d.topic)},{string(d.key)},{d.payload},{d.headers}]" for d in drafts) + "]"


items = st.one_of(
    st.tuples(names, payloads),
    st.tuples(names, payloads, st.one_of(st.none(), names)),
    st.tuples(names, payloads, st.one_of(st.none(), names), st.one_of(st.none(), json_like)),
    st.tuples(names, payloads, st.none(), st.none(), st.integers()),  # a fifth item is refused
    st.tuples(names),
    st.tuples(names, payloads).map(list),
    st.fixed_dictionaries({"topic": names, "payload": payloads},
                          optional={"key": st.one_of(st.none(), names), "headers": st.one_of(st.none(), json_like),
                                    "extra": st.none()}),
    st.fixed_dictionaries({"payload": payloads}),
    st.fixed_dictionaries({"topic": names, "payload": payloads}).map(types.MappingProxyType),
)
# Mostly valid events, so that batches of several events get through.
good_items = st.tuples(st.sampled_from(["order.placed", "a", "ünï", 'q"uote\\']),
                       st.one_of(st.none(), st.integers(), st.dictionaries(st.text(max_size=5), st.integers())),
                       st.one_of(st.none(), st.text(min_size=1, max_size=8).filter(str.strip)))


@settings(max_examples=examples(800), deadline=None)
@given(events=st.lists(st.one_of(good_items, good_items, good_items, items), max_size=6))
def test_publish_many_same_as_reference(events: list[Any]) -> None:
    """Same first refusal, and else one document holding exactly the reference's encoding."""
    new = outcome(_encode_many, events, DEFAULT_MAX_PAYLOAD_BYTES)
    old = outcome(ref_publish_many_drafts, events)
    assert new[0] == old[0], (new, old)
    if old[0] == "refused" and old[1][1] == MALFORMED:
        assert new[1][0] == old[1][0]
    elif old[0] == "refused":
        assert new == old
    else:
        assert new[1] == ([ref_document(old[1])] if events else [], None)


def test_publish_many_splits_documents_past_the_batch_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(publish_module, "MANY_BATCH_CHARS", 100)
    events = [("t", "x" * n, f"k{n}") for n in (10, 20, 30, 300, 10, 10, 10, 10)]  # rows of 27 to 318 characters
    documents, plan = _encode_many(events, DEFAULT_MAX_PAYLOAD_BYTES)
    assert plan is None
    batches = [json.loads(d) for d in documents]
    assert [len(b) for b in batches] == [2, 1, 1, 3, 1]  # as many as fit in 100 characters; the long one alone
    assert [row for b in batches for row in b] == [[t, k, p, {}] for t, p, k in events]
    assert max(len(d) for d, b in zip(documents, batches) if len(b) > 1) <= 100
    for document, following in zip(documents, batches[1:]):  # each document is as full as it can be
        assert len(document) + len(json.dumps(following[0], separators=(",", ":"))) + 1 > 100


# ------------------------------------------------------------------------ numbers


@pytest.mark.parametrize("value, text", [
    (1e16, "10000000000000000.0"),
    (-1e16, "-10000000000000000.0"),
    (1.5e300, "15" + "0" * 299 + ".0"),
    (1e308, "1" + "0" * 308 + ".0"),
    (1.7976931348623157e308, "17976931348623157" + "0" * 292 + ".0"),
    (123456789012345678.0, "123456789012345680.0"),  # repr's shortest digits, not the binary value's
    (float(2**53 + 1), "9007199254740992.0"),
    (9999999999999998.0, "9999999999999998.0"),  # below 1e16 repr is positional already
    (1e-7, "0.0000001"), (5e-324, "0." + "0" * 323 + "5"), (-2.5e-300, "-0." + "0" * 299 + "25"),  # as jsonb prints
    (0.1, "0.1"), (-0.0, "0.0"),  # numeric has no negative zero
])
@pytest.mark.parametrize("where", ["payload", "headers", "full walk"])
def test_floats_are_written_so_jsonb_keeps_them_floats(value: float, text: str, where: str) -> None:
    if where == "payload":
        encoded = make_event("t", [value]).payload
    elif where == "headers":
        encoded = make_event("t", {}, headers={"v": value}).headers
    else:  # a mapping the fast path does not take
        encoded = make_event("t", types.MappingProxyType({"v": value})).payload
    assert encoded == {"payload": f"[{text}]", "headers": f'{{"v":{text}}}', "full walk": f'{{"v":{text}}}'}[where]
    assert float(text) == value and json.loads(text) == value and type(json.loads(text)) is float


@pytest.mark.parametrize("payload, text", [
    ({"1e+16": 1e16}, '{"1e+16":10000000000000000.0}'),
    (["e+", 'a\\"1e+16', 2e16, "x\\", 1e+16], '["e+","a\\\\\\"1e+16",20000000000000000.0,"x\\\\",10000000000000000.0]'),
    (['":1e+16,"', -1e16], '["\\":1e+16,\\"",-10000000000000000.0]'),
])
def test_strings_holding_e_plus_are_left_alone(payload: Any, text: str) -> None:
    assert make_event("t", payload).payload == text
    assert json.loads(text) == payload


@settings(max_examples=examples(3000), deadline=None)
@given(value=st.floats(allow_nan=False, allow_infinity=False))
def test_every_finite_float_is_written_as_jsonb_prints_it(value: float) -> None:
    """What numeric keeps as a number with digits after the point (so it reads back as a
    float), of the same value, as jsonb prints it (no exponent; zero without a sign)."""
    number = make_event("t", [value]).payload[1:-1]
    assert "e" not in number and "." in number, number
    assert float(number) == value and (value == 0 or math.copysign(1, float(number)) == math.copysign(1, value))
