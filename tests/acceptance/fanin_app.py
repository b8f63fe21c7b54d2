"""The application of the fan-in fault test (``--app tests.acceptance.fanin_app:app``): a
two-step workflow. ``fanin.order`` is handled by ``receipt`` (lease mode, fails once now and
then), ``invoice`` (transactional) and ``crm`` (lease mode; refuses every tenth order for good,
so its job ends dead and the fan-in never fires for that order); when all three are done,
``fanin.fulfilled`` follows, handled by ``ship`` (lease mode) and ``notify`` (transactional),
and when both are done, ``fanin.closed``, handled by ``archive``. Each handler works 5..30 ms,
waking early when its lease is lost."""

from __future__ import annotations

import random

from sqlalchemy.orm import Session

from outbox import Job, Outbox, PermanentError

ORDER, FULFILLED, CLOSED = "fanin.order", "fanin.fulfilled", "fanin.closed"
FIRST = ("receipt", "invoice", "crm")
SECOND = ("ship", "notify")


class Transient(Exception):
    """A failure worth retrying."""


def _work(job: Job) -> None:
    job.wait_lease_lost(random.uniform(0.005, 0.03))


def receipt(job: Job) -> None:
    _work(job)
    if job.payload["n"] % 7 == 3 and job.attempt == 1:
        raise Transient(f"order {job.payload['n']}: mail server busy")


def invoice(job: Job, session: Session) -> None:
    _work(job)


def crm(job: Job) -> None:
    _work(job)
    if job.payload["n"] % 10 == 0:
        raise PermanentError(f"order {job.payload['n']}: the CRM refuses it")


def step(job: Job) -> None:
    _work(job)


def step_in_transaction(job: Job, session: Session) -> None:
    _work(job)


def expected_dead(n: int) -> bool:
    """Whether order ``n`` ends with a dead job by its handlers' rules (faults aside)."""
    return n % 10 == 0


def app() -> Outbox:
    ob = Outbox()
    ob.subscriber(ORDER, consumer="receipt", max_attempts=8)(receipt)
    ob.subscriber(ORDER, consumer="invoice", transactional=True, max_attempts=8)(invoice)
    ob.subscriber(ORDER, consumer="crm", max_attempts=8)(crm)
    ob.after(ORDER, consumers=list(FIRST), publish=FULFILLED)
    ob.subscriber(FULFILLED, consumer="ship", max_attempts=8)(step)
    ob.subscriber(FULFILLED, consumer="notify", transactional=True, max_attempts=8)(step_in_transaction)
    ob.after(FULFILLED, consumers=list(SECOND), publish=CLOSED)
    ob.subscriber(CLOSED, consumer="archive", max_attempts=8)(step)
    return ob
