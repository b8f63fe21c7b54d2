"""Job: payload and headers decoded from the claim's JSON text on first use; replace()."""

from __future__ import annotations

import copy
import pickle

import pytest

from outbox import Job


def claimed(payload_json: str = '{"order_id": 4, "items": [1, 2]}', headers_json: str | None = '{"trace": "x"}') -> Job:
    return Job.from_json(10, 20, "send_receipt", "order.placed", "order:4", payload_json, headers_json,
                         1, 5, 99, 30.0)


def test_payload_and_headers_decode_on_first_use_once():
    job = claimed()
    assert job.payload == {"order_id": 4, "items": [1, 2]}
    assert job.payload is job.payload  # decoded once, the same object afterwards
    assert job.headers == {"trace": "x"} and job.headers is job.headers
    assert job.payload_json == '{"order_id": 4, "items": [1, 2]}'  # the stored text, untouched


def test_a_job_without_headers_reads_them_as_empty():
    assert claimed(headers_json=None).headers == {}


@pytest.mark.parametrize("text, value", [("null", None), ("3", 3), ('"s"', "s"), ("[]", []), ("true", True)])
def test_any_json_payload_decodes(text, value):
    assert claimed(payload_json=text).payload == value


def test_a_handler_may_mutate_the_decoded_payload():
    job = claimed()
    job.payload["order_id"] = 5
    assert job.payload["order_id"] == 5


def test_replace_copies_and_changes_only_what_it_names():
    job = claimed()
    job.mark_lease_lost()
    copy = job.replace(fence=100)
    assert (copy.fence, job.fence) == (100, 99)
    assert (copy.id, copy.consumer, copy.payload, copy.headers) == (10, "send_receipt", job.payload, job.headers)
    assert job.lease_lost and not copy.lease_lost  # relay state starts afresh
    assert copy.payload_json == job.payload_json


def test_replace_payload_drops_the_stored_text():
    copy = claimed().replace(payload={"order_id": 7})
    assert copy.payload == {"order_id": 7}
    assert copy.payload_json == '{"order_id": 7}'


def test_replace_refuses_unknown_names():
    with pytest.raises(TypeError, match="unknown field.*_lost"):
        claimed().replace(_lost=True)


def test_reading_headers_leaves_the_payload_undecoded():
    """A forwarder reads the headers and sends payload_json: the payload is never decoded
    (a text that is not JSON shows it: only reading the payload fails)."""
    job = claimed(payload_json="not json", headers_json='{"h": "1"}')
    assert job.headers == {"h": "1"} and job.payload_json == "not json"
    with pytest.raises(ValueError):
        _ = job.payload


def test_a_copied_or_pickled_job_still_decodes():
    for twin in (copy.copy(claimed()), pickle.loads(pickle.dumps(claimed()))):
        assert twin.payload == {"order_id": 4, "items": [1, 2]} and twin.headers == {"trace": "x"}


def test_assigning_the_payload_replaces_the_stored_one():
    job = claimed()
    job.payload = {"other": 1}
    assert job.payload == {"other": 1}
    assert job.payload_json == '{"other": 1}'


@pytest.mark.parametrize("stored", ["null", "[]", '""'])
def test_empty_stored_headers_read_as_an_empty_dict(stored):
    """publish always writes an object; a row SQL wrote with an empty value reads as ``{}``,
    as the driver's loader with ``or {}`` gave it (tracing iterates the headers)."""
    assert claimed(headers_json=stored).headers == {}


def test_restore_input_gives_back_the_stored_payload_and_headers():
    """A transactional handler run again in place must see the input its first run saw."""
    job = claimed()
    job.payload.pop("order_id")
    job.headers["seen"] = True
    job.restore_input()
    assert job.payload == {"order_id": 4, "items": [1, 2]} and job.headers == {"trace": "x"}
    empty = claimed(headers_json="{}")
    empty.headers["seen"] = True
    empty.restore_input()
    assert empty.headers == {}
