"""The application of the log-count tests (``--app tests.acceptance.slow_app:app``): one
lease-mode consumer, ``slow``, of topic ``sa.work``, whose handler sleeps ``SA_WORK_MS``
milliseconds (default 500) and returns. Read when the relay calls :func:`app`, never at
import time."""

from __future__ import annotations

import os
import time

from outbox import Job, Outbox

TOPIC = "sa.work"
CONSUMER = "slow"


def app() -> Outbox:
    """The registry: ``slow`` sleeps ``SA_WORK_MS`` milliseconds per job."""
    ob = Outbox()
    seconds = float(os.environ.get("SA_WORK_MS", "500")) / 1000

    @ob.subscriber(TOPIC, consumer=CONSUMER, max_attempts=10)
    def slow(job: Job) -> None:
        time.sleep(seconds)

    return ob
