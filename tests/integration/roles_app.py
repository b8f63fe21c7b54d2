"""The application of the Roles example's test (``--app tests.integration.roles_app:ob``):
one consumer of ``order.placed`` that does nothing; the test waits for its job to be done."""

from __future__ import annotations

from outbox import Job, Outbox

ob = Outbox()


@ob.subscriber("order.placed", consumer="receipt")
def receipt(job: Job) -> None:
    """Nothing to do: the job's status is what the test reads."""
