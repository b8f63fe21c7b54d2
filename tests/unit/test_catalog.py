"""The event catalog (``outbox-relay catalog``): an application with handlers of every mode,
a forwarder, ordering and flow control, one consumer of two topics and typed payloads gives
an AsyncAPI 3.0.0 document that validates against the AsyncAPI schema, and the same facts as
JSON and markdown.

The schema is tests/data/asyncapi-3.0.0.schema.json: ``schemas/3.0.0-without-$id.json`` of
github.com/asyncapi/spec-json-schemas at commit 7dd3990d9fff9df76e81c8d2ab544e0000f29aff
(Apache License 2.0), unchanged."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from outbox.ops.catalog import as_asyncapi, build, render
from outbox.ops.catalog import intakes as catalog_intakes

jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed (pip install -e '.[dev]')")

SCHEMA = Path(__file__).resolve().parents[1] / "data" / "asyncapi-3.0.0.schema.json"

APP = textwrap.dedent('''
    from datetime import datetime
    from decimal import Decimal
    from typing import ClassVar

    from pydantic import BaseModel
    from sqlalchemy.orm import Session

    from outbox import Job, JetStream, JetStreamSource, Outbox, Webhook


    class Address(BaseModel):
        city: str


    class OrderPlaced(BaseModel):
        __topic__: ClassVar[str] = "order.placed"
        order_id: int
        total: Decimal
        ship_to: Address
        at: datetime


    ob = Outbox()


    @ob.subscriber("order.placed", consumer="send_receipt", max_attempts=7, concurrency=4, rate_limit="10/s")
    def send_receipt(job: Job[OrderPlaced]) -> None: ...


    @ob.subscriber("order.placed", consumer="ledger", transactional=True, ordered=True, on_dead="skip")
    def ledger(job: Job, session: Session) -> None: ...


    @ob.subscriber(["order.placed", "order.cancelled"], consumer="audit.trail")
    async def audit(job: Job) -> None: ...


    ob.forward("order.placed", to=JetStream("nats://user:secret@127.0.0.1:4222", subject="shop.{topic}"),
               consumer="to_nats")

    ob.intake("from_shop", source=JetStreamSource("nats://user:secret@127.0.0.1:4222", stream="SHOP",
                                                  durable="billing"), ordered=True)
    ob.intake("payments", source=Webhook("whsec_c2VjcmV0LXNpZ25pbmcta2V5LTEyMw=="), topic={"paid": "order.paid"})
''')


@pytest.fixture
def app(tmp_path, monkeypatch):
    (tmp_path / "catalog_app.py").write_text(APP)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("catalog_app", None)
    import catalog_app  # type: ignore[import-not-found]

    yield catalog_app.ob
    sys.modules.pop("catalog_app", None)


def test_the_asyncapi_document_validates_and_says_what_the_registry_declares(app):
    document = as_asyncapi(build(app), title="shop", taken=catalog_intakes(app))
    jsonschema.Draft7Validator(json.loads(SCHEMA.read_text())).validate(document)
    channels = document["channels"]
    assert {c["address"] for c in channels.values()} == {"order.placed", "order.cancelled"}
    placed = channels["order_placed"]
    assert set(placed["messages"]) == {"OrderPlaced"}
    schemas = document["components"]["schemas"]
    assert set(schemas["OrderPlaced"]["properties"]) == {"order_id", "total", "ship_to", "at"}
    assert schemas["OrderPlaced"]["properties"]["ship_to"] == {"$ref": "#/components/schemas/Address"}
    assert "Address" in schemas
    operations = document["operations"]
    assert set(operations) == {"send_receipt", "ledger", "audit_trail", "to_nats"}
    assert operations["send_receipt"]["x-outbox"].items() >= {"max_attempts": 7, "concurrency": 4, "rate_limit": 10.0,
                                                              "mode": "lease", "kind": "handler"}.items()
    assert operations["send_receipt"]["messages"] == [{"$ref": "#/channels/order_placed/messages/OrderPlaced"}]
    assert operations["ledger"]["x-outbox"]["ordered"] is True and operations["ledger"]["x-outbox"]["on_dead"] == "skip"
    assert set(operations["audit_trail"]["x-outbox"]["topics"]) == {"order.placed", "order.cancelled"}
    forward = operations["to_nats"]["x-outbox-forward-to"]
    assert "shop.{topic}" in forward and "secret" not in json.dumps(document)  # no credentials
    intakes = {i["name"]: i for i in document["x-outbox-intakes"]}
    assert intakes["from_shop"]["ordered"] is True and "stream SHOP durable billing" in intakes["from_shop"]["source"]
    assert intakes["from_shop"]["topics"] == "the sender's Outbox-Topic header"
    assert intakes["payments"]["topics"] == "order.paid" and "c2VjcmV0" not in json.dumps(document)


def test_a_broken_document_fails_the_validation(app):
    """The validation can fail: an operation without its action is refused."""
    document = as_asyncapi(build(app))
    del document["operations"]["ledger"]["action"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(json.loads(SCHEMA.read_text())).validate(document)


def test_json_and_markdown_say_the_same(app):
    as_json = json.loads(render(app, "json"))
    consumers = {c["name"]: c for c in as_json["topics"]["order.placed"]["consumers"]}
    assert set(consumers) == {"audit.trail", "ledger", "send_receipt", "to_nats"}
    assert consumers["send_receipt"]["payload"] == "OrderPlaced" and consumers["to_nats"]["kind"] == "forwarder"
    page = render(app, "markdown", "shop")
    assert page.startswith("# shop: event catalog")
    assert "## `order.cancelled`" in page and "## `order.placed`" in page
    assert "| `ledger` | handler | transactional | 5 | default | 0 | - | yes, dead skips | - | - | - | - |" in page
    assert "| `send_receipt` | handler | lease | 7 | default | 0 | - | no | 4 | 10/s | OrderPlaced | - |" in page
    assert '"order_id"' in page
    assert "| `payments` | signed webhooks" in page and as_json["intakes"][0]["name"] == "from_shop"


def test_the_command_prints_the_catalog(tmp_path):
    (tmp_path / "catalog_app.py").write_text(APP)
    done = subprocess.run([sys.executable, "-m", "outbox.ops.cli", "catalog", "--app", "catalog_app:ob"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    jsonschema.Draft7Validator(json.loads(SCHEMA.read_text())).validate(json.loads(done.stdout))
    bad = subprocess.run([sys.executable, "-m", "outbox.ops.cli", "catalog", "--app", "nowhere:ob"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "no module named 'nowhere'" in bad.stderr, bad.stderr


RECURSIVE_APP = textwrap.dedent('''
    from __future__ import annotations

    from pydantic import BaseModel

    from outbox import Job, Outbox


    class Node(BaseModel):
        name: str
        children: list[Node] = []


    def module(name: str, fields: dict[str, type]) -> type[BaseModel]:
        return type(name, (BaseModel,), {"__annotations__": fields, "__module__": f"pkg.{name.lower()}s"})


    class ItemA(BaseModel):
        sku: str


    class ItemB(BaseModel):
        weight_kg: float


    ItemA.__name__ = ItemB.__name__ = "Item"
    OrderA = type("Order", (BaseModel,), {"__annotations__": {"item": ItemA}, "__module__": "pkg.a"})
    OrderB = type("Order", (BaseModel,), {"__annotations__": {"items": list[ItemB]}, "__module__": "pkg.b"})

    ob = Outbox()
    ob.subscriber("tree", consumer="tree", payload=Node)(lambda job: None)
    ob.subscriber("orders.a", consumer="a", payload=OrderA)(lambda job: None)
    ob.subscriber("orders.b", consumer="b", payload=OrderB)(lambda job: None)
''')


def test_recursive_models_and_models_of_one_name_stay_whole_and_apart(tmp_path, monkeypatch):
    (tmp_path / "recursive_app.py").write_text(RECURSIVE_APP)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("recursive_app", None)
    import recursive_app  # type: ignore[import-not-found]

    document = as_asyncapi(build(recursive_app.ob))
    jsonschema.Draft7Validator(json.loads(SCHEMA.read_text())).validate(document)
    schemas = document["components"]["schemas"]

    def resolved(message: str) -> dict:
        ref = document["components"]["messages"][message]["payload"]["$ref"]
        return schemas[ref.rsplit("/", 1)[1]]

    assert set(resolved("Node")["properties"]) == {"name", "children"}  # not a reference to itself
    orders = [name for name in document["components"]["messages"] if name.endswith("Order")]
    assert len(orders) == 2, orders
    shapes = sorted(tuple(sorted(resolved(name)["properties"])) for name in orders)
    assert shapes == [("item",), ("items",)]
    item_refs = {json.dumps(resolved(name)["properties"]) for name in orders}
    assert len(item_refs) == 2  # each Order names its own Item
    sys.modules.pop("recursive_app", None)


def test_an_empty_registry():
    from outbox import Outbox

    assert render(Outbox(), "markdown").endswith("No topics: the registry declares no subscriber or forwarder.\n")
    jsonschema.Draft7Validator(json.loads(SCHEMA.read_text())).validate(json.loads(render(Outbox())))
