"""The JSON and text log formats and the once-a-minute warning about topics with no subscriber."""

from __future__ import annotations

import json
import logging

from outbox.relay.router import UnsubscribedTopics
from outbox.telemetry.logs import JsonFormatter, TextFormatter, job_fields
from outbox.testing import make_job


def _record(message: str, *args: object, **extra: object) -> logging.LogRecord:
    record = logging.LogRecord("outbox.relay.worker", logging.ERROR, __file__, 1, message, args, None)
    for key, value in extra.items():
        setattr(record, key, value)
    return record


def test_a_json_line_holds_the_message_and_the_structured_fields():
    job = make_job({"n": 1}, consumer="c", id=7, event_id=3, fence=11, attempt=2)
    record = _record("dead-lettered job %s (%s)", 7, "c", **job_fields(job, outcome="dead", error="x\ny"))
    line = JsonFormatter().format(record)
    assert "\n" not in line  # one line, whatever the fields hold
    entry = json.loads(line)
    assert entry["message"] == "dead-lettered job 7 (c)" and entry["level"] == "ERROR"
    assert entry["logger"] == "outbox.relay.worker" and entry["ts"].endswith("+00:00")
    assert {k: entry[k] for k in ("job_id", "event_id", "consumer", "fence", "attempt", "outcome", "error")} == {
        "job_id": 7, "event_id": 3, "consumer": "c", "fence": 11, "attempt": 2, "outcome": "dead", "error": "x\ny"}
    assert "args" not in entry and "msg" not in entry  # the record's own attributes stay out


def test_a_field_json_cannot_encode_is_written_as_text_and_a_traceback_kept():
    try:
        raise ValueError("boom")
    except ValueError:
        import sys

        record = _record("failed", when=object)
        record.exc_info = sys.exc_info()
    entry = json.loads(JsonFormatter().format(record))
    assert entry["when"] == str(object) and "ValueError: boom" in entry["exc_info"]


def test_an_unsubscribed_topic_is_warned_about_once_a_minute_with_the_events_since(caplog):
    now = [1000.0]
    topics = UnsubscribedTopics(clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="outbox.relay.router"):
        topics.routed({"order.palced": 2})
        now[0] += 10
        topics.routed({"order.palced": 3, "other": 1})
        now[0] += 49
        topics.routed({"order.palced": 1})
        assert [(r.topic, r.events) for r in caplog.records] == [("order.palced", 2), ("other", 1)]
        now[0] += 1  # 60 s after the first warning: the next one reports the events met since
        topics.routed({"order.palced": 1})
    assert [(r.topic, r.events) for r in caplog.records] == [("order.palced", 2), ("other", 1), ("order.palced", 5)]
    assert "'order.palced'" in caplog.records[0].getMessage() and "in the last 60s" in caplog.records[2].getMessage()
    assert all(r.levelno == logging.WARNING for r in caplog.records)


def test_unsubscribed_topics_remembered_are_bounded():
    topics = UnsubscribedTopics(clock=lambda: 0.0, max_topics=3)
    for n in range(10):
        topics.routed({f"t{n}": 1})
    assert topics.warnings == 10 and len(topics._warned_at) == 3


def test_a_summary_names_the_count_the_consumers_and_a_few_ids():
    from outbox.telemetry.logs import SUMMARY_IDS, job_summary

    jobs = [make_job({}, consumer="a" if i % 3 else "b", id=100 + i) for i in range(12)]
    text, fields = job_summary(jobs, "lease_lost")
    assert text == "12 jobs (a 8, b 4; ids 100, 101, 102, 103, 104 and 7 more)"
    assert fields == {"count": 12, "consumers": {"a": 8, "b": 4}, "job_ids": [100, 101, 102, 103, 104],
                      "outcome": "lease_lost"}
    assert len(fields["job_ids"]) == SUMMARY_IDS
    assert job_summary(jobs[:1], "stale")[0] == "1 job (b 1; id 100)"
    line = json.loads(JsonFormatter().format(_record("lease lost on %s", text, **fields)))
    assert line["count"] == 12 and line["job_ids"] == [100, 101, 102, 103, 104]


def _client_record(name: str, level: int, msg: str, *args: object) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, msg, args, None)


def test_broker_client_noise_is_written_at_debug_and_other_records_pass():
    from outbox.telemetry.logs import ClientNoise

    noise = ClientNoise()
    closed = _client_record("aiormq.connection", logging.ERROR, 'Unexpected connection close from remote "%s", '
                            "Connection.Close(reply_code=%r, reply_text=%r)", "amqp://x", 504, "CHANNEL_ERROR")
    reader = _client_record("aiormq.connection", logging.WARNING, "Cancelling cause reader exited abnormally")
    blocked = _client_record("aiormq.connection", logging.WARNING, "Connection %r was blocked by: %r", "c", "memory")
    ours = _client_record("outbox.forward", logging.WARNING, "Unexpected connection close from remote")
    logging.getLogger("aiormq.connection").setLevel(logging.INFO)
    try:
        assert not noise.filter(closed) and not noise.filter(reader)  # below the logger's level: dropped
        assert closed.levelno == reader.levelno == logging.DEBUG and closed.levelname == "DEBUG"
        assert noise.filter(blocked) and blocked.levelno == logging.WARNING  # news outbox does not log
        assert noise.filter(ours) and ours.levelno == logging.WARNING
        logging.getLogger("aiormq.connection").setLevel(logging.DEBUG)
        again = _client_record("aiormq.connection", logging.ERROR, "Unexpected connection close from remote")
        assert noise.filter(again) and again.levelno == logging.DEBUG  # kept, at DEBUG, when DEBUG is on
    finally:
        logging.getLogger("aiormq.connection").setLevel(logging.NOTSET)


def test_an_aio_pika_callback_error_is_noise_only_when_the_error_is_aiormqs():
    from outbox.telemetry.logs import ClientNoise

    class ConnectionChannelError(Exception):  # as aiormq's, by module
        __module__ = "aiormq.exceptions"

    closed = _client_record("aio_pika.tools", logging.ERROR, "Callback %r error: %s: %s", "cb",
                            "ConnectionChannelError", ConnectionChannelError("CHANNEL_ERROR"))
    bug = _client_record("aio_pika.tools", logging.ERROR, "Callback %r error: %s: %s", "cb", "AttributeError",
                         AttributeError("x"))
    assert not ClientNoise().filter(closed) and closed.levelno == logging.DEBUG
    assert ClientNoise().filter(bug) and bug.levelno == logging.ERROR


def test_the_text_format_escapes_what_could_drive_a_terminal_and_keeps_lines():
    hostile = "boom\x1b]0;owned\x07\x1b[2J\r\u202e\x9b31m"
    try:
        raise ValueError(hostile)
    except ValueError:
        import sys

        record = _record("job 7 failed: %s", hostile)
        record.exc_info = sys.exc_info()
    line = TextFormatter().format(record)
    assert "\x1b" not in line and "\x07" not in line and "\r" not in line and "\u202e" not in line
    assert "\x9b" not in line
    assert "job 7 failed: boom\\x1b]0;owned\\x07\\x1b[2J\\r\\u202e\\x9b31m" in line
    assert "\nTraceback (most recent call last):\n" in line  # the traceback keeps its lines
    assert line.count("\\x1b") == 4  # the message's two and the traceback's two
