"""What the intake tests share: a transactional subscriber that counts its effects per
order (exactly once means every count is 1), messages shaped as outbox's forwarders send
them, and readers of the receiving database."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from outbox import Job, Outbox

EFFECTS_DDL = """
CREATE TABLE IF NOT EXISTS intake_effects (
    order_id int PRIMARY KEY,
    runs int NOT NULL,
    event_id bigint NOT NULL
)
"""


def counting_subscriber(ob: Outbox, engine: sa.Engine, topic: str = "order.placed") -> None:
    """Subscribe a transactional handler ``book`` to ``topic`` that adds one run per job to
    ``intake_effects`` (created here), in the job's own transaction."""
    with engine.begin() as conn:
        conn.exec_driver_sql(EFFECTS_DDL)

    @ob.subscriber(topic, consumer="book", transactional=True)
    def book(job: Job, session: Session) -> None:
        session.execute(sa.text(
            "INSERT INTO intake_effects (order_id, runs, event_id) VALUES (:o, 1, :e) "
            "ON CONFLICT (order_id) DO UPDATE SET runs = intake_effects.runs + 1"),
            {"o": job.payload["order_id"], "e": job.event_id})


def effects(engine: sa.Engine) -> dict[int, int]:
    """order id -> runs of its effect."""
    with engine.connect() as conn:
        return dict(conn.execute(sa.text("SELECT order_id, runs FROM intake_effects")).all())


def forwarded(order_id: int, *, sender: str = "fwd", topic: str = "order.placed") -> tuple[bytes, dict[str, str]]:
    """A message as an outbox forwarder named ``sender`` sends the event of ``order_id``:
    body and headers."""
    body = f'{{"order_id": {order_id}, "name": "caf\\u00e9"}}'.encode()
    return body, {"Outbox-Event-Id": str(order_id), "Outbox-Topic": topic, "Outbox-Key": f"order:{order_id % 7}",
                  "Outbox-Idempotency-Key": f"{sender}:{order_id}", "Outbox-Created-At": "2026-12-04T00:00:00+00:00",
                  "traceparent": f"00-{order_id:032x}-{order_id:016x}-01"}


def intake_rows(engine: sa.Engine, source: str) -> list[dict[str, Any]]:
    """Every row of ``outbox_intake`` of ``source``."""
    with engine.connect() as conn:
        return [dict(r) for r in conn.execute(sa.text(
            "SELECT * FROM outbox_intake WHERE source = :s ORDER BY identity"), {"s": source}).mappings()]
