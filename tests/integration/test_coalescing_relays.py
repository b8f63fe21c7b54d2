"""Coalescing under concurrent relays (docs/coalescing.md): three relays in this process
route and run a stream of events over five keys for two coalescing consumers (one
ordered); the handlers must see the newest event of every key, never a superseded job, and
never an older event of a key after a newer one (:func:`tests.acceptance.coalesce_app.check`).
The same with relays killed (SIGKILL) is in tests/acceptance/test_coalescing_faults.py."""

from __future__ import annotations

from outbox.testing import wait_for
from tests.acceptance import coalesce_app

from .helpers import running_relays


def test_concurrent_relays_run_the_newest_event_of_every_key_and_nothing_superseded(engine, db_url, settings):
    coalesce_app.create_tables(engine)
    registry = coalesce_app.app(db_url.render_as_string(hide_password=False))
    relay_settings = settings(concurrency=4, route_batch=7, default_lease=10.0, backoff_base=0.01, backoff_cap=0.05)
    with running_relays(3, registry, relay_settings):
        ids = coalesce_app.publish_stream(engine, 400, duration=4.0)
        wait_for(lambda: coalesce_app.drained(engine, ids), timeout=120, interval=0.2,
                 what=f"the work to drain ({coalesce_app.progress(engine)})")
    counts = coalesce_app.check(engine, ids)
    assert counts["done"] + counts["superseded"] == 2 * len(ids), counts
