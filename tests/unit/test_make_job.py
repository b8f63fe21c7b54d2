"""outbox.testing.make_job: a Job for a unit test of a handler, with documented defaults."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from outbox import ConfigurationError, Job, LeaseLostError
from outbox.testing import make_job


def test_defaults():
    before = datetime.now(UTC)
    job = make_job()
    assert isinstance(job, Job)
    assert (job.id, job.event_id, job.consumer, job.topic, job.key, job.payload, job.headers) == (
        1, 1, "test_consumer", "test.topic", None, {}, {})
    assert (job.attempt, job.max_attempts, job.fence, job.lease_seconds) == (1, 5, 1, 30.0)
    assert job.idempotency_key == "test_consumer:1"
    assert before <= job.event_created_at <= datetime.now(UTC)
    assert not job.lease_lost
    job.check_lease()  # does not raise


def test_every_public_field_can_be_overridden():
    created = datetime(2024, 1, 2, tzinfo=UTC)
    job = make_job({"order_id": 4}, id=10, event_id=20, consumer="send_receipt", topic="order.placed",
                   key="order:4", headers={"trace": "x"}, attempt=3, max_attempts=3, fence=99,
                   lease_seconds=5, event_created_at=created)
    assert (job.id, job.event_id, job.consumer, job.topic, job.key, job.payload, job.headers, job.attempt,
            job.max_attempts, job.fence, job.lease_seconds, job.event_created_at) == (
        10, 20, "send_receipt", "order.placed", "order:4", {"order_id": 4}, {"trace": "x"}, 3, 3, 99, 5.0, created)
    assert job.idempotency_key == "send_receipt:20"


def test_each_job_gets_its_own_payload_and_headers():
    a, b = make_job(), make_job()
    a.payload["x"] = 1
    a.headers["y"] = 2
    assert b.payload == {} and b.headers == {}


def test_lease_loss_can_be_simulated():
    job = make_job()
    job.mark_lease_lost()
    with pytest.raises(LeaseLostError):
        job.check_lease()


@pytest.mark.parametrize("overrides, field", [
    ({"id": 0}, "id"),
    ({"event_id": "1"}, "event_id"),
    ({"fence": -1}, "fence"),
    ({"attempt": 6}, "attempt"),
    ({"max_attempts": True}, "max_attempts"),
    ({"topic": ""}, "topic"),
    ({"consumer": 3}, "consumer"),
    ({"lease_seconds": 0}, "lease_seconds"),
    ({"lease_seconds": float("inf")}, "lease_seconds"),
    ({"key": 5}, "key"),
    ({"headers": "x"}, "headers"),
    ({"event_created_at": "now"}, "event_created_at"),
    ({"event_created_at": datetime(2024, 1, 2)}, "event_created_at"),
])
def test_bad_fields_are_refused_by_name(overrides, field):
    with pytest.raises(ConfigurationError, match=field):
        make_job(**overrides)
