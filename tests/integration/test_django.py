"""outbox.contrib.django against a real Django project on the real PostgreSQL, no mocks.

``django.setup()`` is process-global, so the Django side runs in subprocesses: each test
writes a project into its tmp_path (settings on the test's database, an app ``shop`` whose
models, view and handler module are the blocks of docs/publishing-django.md, its migration
made by ``manage.py makemigrations``, applied by ``manage.py migrate``), then runs one
scenario of ``scenarios.py`` in it (requests through Django's test ``Client``, publishes in
and out of atomic blocks, a relay with ORM handlers) and reads what it printed and what the
database holds. A relay in the test process, or ``outbox-relay`` itself, handles what the
Django side published."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL

from outbox import Job, Outbox
from outbox.relay.relay import Relay
from outbox.settings import OutboxSettings
from outbox.testing import wait_for
from tests import docs_pages
from tests.docs_pages import ROOT
from tests.integration.helpers import relay_process

pytest.importorskip("django", reason="Django is not installed (pip install 'outbox-relay[django]')")

DOCS_PAGE = ROOT / "docs" / "publishing-django.md"

#: Seconds a Django subprocess may take.
TIMEOUT = 120.0

SETTINGS = '''\
SECRET_KEY = "outbox-tests"
DEBUG = False
ALLOWED_HOSTS = ["testserver"]
INSTALLED_APPS = ["shop"]
MIDDLEWARE = []
ROOT_URLCONF = "shopsite.urls"
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
DATABASES = {
    "default": {"ENGINE": "django.db.backends.postgresql", "NAME": %(name)r, "USER": %(user)r,
                "PASSWORD": %(password)r, "HOST": %(host)r, "PORT": %(port)r},
    "other": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"},
    # says it is PostgreSQL and connects through another driver, as a psycopg2 backend would
    "impostor": {"ENGINE": "impostor", "NAME": ":memory:"},
}
'''

URLS = '''\
from django.urls import path

from shop import more_views, views

urlpatterns = [
    path("orders/", views.place_order),
    path("orders/declined/", more_views.place_declined_order),
]
'''

MORE_VIEWS = '''\
from django.db import transaction
from django.http import HttpRequest, JsonResponse

from outbox.contrib.django import publish
from shop.models import Order


class Declined(Exception):
    pass


def place_declined_order(request: HttpRequest) -> JsonResponse:
    try:
        with transaction.atomic():
            order = Order.objects.create(customer=request.POST["customer"], total_cents=int(request.POST["total_cents"]))
            publish("order.placed", {"order_id": order.pk, "total_cents": order.total_cents}, key=f"order:{order.pk}")
            raise Declined("card declined")
    except Declined:
        return JsonResponse({"declined": True}, status=402)
'''

IMPOSTOR_BACKEND = '''\
from django.db.backends.sqlite3.base import DatabaseWrapper as SQLiteDatabaseWrapper


class DatabaseWrapper(SQLiteDatabaseWrapper):
    vendor = "postgresql"
'''

# A handler that breaks its own connection (the server ends it, as on a restart), then one
# that needs a working one, on a relay of one worker thread: keyed, so they run in order.
PROBE_JOBS = '''\
from django.db import connection

from outbox import Job, Outbox
from outbox.contrib.django import orm_handler, setup

setup("shopsite.settings")

from shop.models import Order  # noqa: E402

ob = Outbox()


@ob.subscriber("probe", consumer="probe", ordered=True, on_dead="skip", max_attempts=1)
@orm_handler
def probe(job: Job) -> None:
    if job.payload["terminate"]:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(pg_backend_pid())")
    Order.objects.create(customer=f"probe {job.payload['n']}", total_cents=0)
'''

SCENARIOS = '''\
"""Scenarios of tests/integration/test_django.py, one per run: python scenarios.py NAME."""
import json
import os
import sys

import psycopg

from outbox.contrib.django import setup

setup("shopsite.settings")

from django.db import connection, transaction  # noqa: E402
from django.test import Client  # noqa: E402

from outbox.contrib.django import orm_handler, publish, publish_many  # noqa: E402
from outbox.errors import ConfigurationError  # noqa: E402
from shop.models import Order  # noqa: E402


def views():
    client = Client()
    placed = client.post("/orders/", {"customer": "ann", "total_cents": "2500"})
    declined = client.post("/orders/declined/", {"customer": "bob", "total_cents": "900"})
    return {"placed": [placed.status_code, placed.json()], "declined": [declined.status_code, declined.json()]}


def autocommit():
    with psycopg.connect(os.environ["TEST_LIBPQ_URL"], autocommit=True) as other:
        def committed(topic):
            return other.execute("SELECT count(*) FROM outbox_events WHERE topic = %s", (topic,)).fetchone()[0]

        seen = {}
        publish("t.alone", {"n": 1}, key="k")
        seen["alone"] = committed("t.alone")
        publish_many([("t.many", {"n": 1}), {"topic": "t.many", "payload": {"n": 2}, "delay": 60}])
        seen["many"] = committed("t.many")
        seen["autocommit_after"] = connection.get_autocommit()
        with transaction.atomic():
            Order.objects.create(customer="cy", total_cents=1)
            publish("t.block", {"n": 1})
            seen["block_inside"] = committed("t.block")
        seen["block_after"] = committed("t.block")
        return seen


class Declined(Exception):
    pass


def savepoint():
    with transaction.atomic():
        kept = Order.objects.create(customer="ann", total_cents=100)
        publish("order.placed", {"order_id": kept.pk}, key=f"order:{kept.pk}")
        try:
            with transaction.atomic():
                gone = Order.objects.create(customer="bob", total_cents=200)
                publish("order.placed", {"order_id": gone.pk}, key=f"order:{gone.pk}")
                publish_many([("order.audited", {"order_id": gone.pk})])
                raise Declined
        except Declined:
            pass
        after = Order.objects.create(customer="cy", total_cents=300)  # the outer block goes on
        publish("order.placed", {"order_id": after.pk}, key=f"order:{after.pk}")
        with transaction.atomic():
            flagged = Order.objects.create(customer="dee", total_cents=400)
            publish("order.placed", {"order_id": flagged.pk}, key=f"order:{flagged.pk}")
            transaction.set_rollback(True)
    return {"kept": kept.pk, "gone": gone.pk, "after": after.pk, "flagged": flagged.pk}


def options():
    from datetime import datetime, timezone

    with transaction.atomic():
        first = publish("t.options", {"n": 1}, dedup_key="d-1", priority=-5)
        again = publish("t.options", {"n": 2}, dedup_key="d-1")
        later = publish("t.later", {"n": 3}, run_at=datetime(2100, 1, 1, tzinfo=timezone.utc), headers={"h": "v"})
        many = publish_many([{"topic": "t.options", "payload": {"n": 4}, "dedup_key": "d-1"},
                             {"topic": "t.options", "payload": {"n": 5}, "dedup_key": "d-2"}])
    return {"first": first, "again": again, "later": later, "many": many}


def refused():
    found = {}
    for name, call in [("sqlite", lambda: publish("t.refused", {}, using="other")),
                       ("sqlite_many", lambda: publish_many([("t.refused", {})], using="other")),
                       ("impostor", lambda: publish("t.refused", {}, using="impostor")),
                       ("missing", lambda: publish("t.refused", {}, using="missing"))]:
        try:
            call()
            found[name] = "published"
        except ConfigurationError as exc:
            found[name] = str(exc)

    async def handler(job):
        pass

    try:
        orm_handler(handler)
        found["async"] = "wrapped"
    except ConfigurationError as exc:
        found["async"] = str(exc)
    with transaction.atomic():  # a refusal sends nothing: the block is still usable
        try:
            publish("t.refused", {}, using="other")
        except ConfigurationError:
            pass
        publish("t.after_refusal", {})
    return found


def errors():
    from django.db import DatabaseError, IntegrityError
    from django.db.transaction import TransactionManagementError

    from outbox.errors import InvalidEventError

    found = {}
    big = "x" * (9 * 1024 * 1024)  # two events of 9 MiB: two statements (publish's batches hold 16 Mi characters)
    try:
        publish_many([("t.big", {"s": big}), ("t.big", {"s": big, "explode": True})], max_payload_bytes=10 << 20)
        found["many"] = "published"
    except DatabaseError as exc:
        found["many"] = [f"{type(exc).__module__}.{type(exc).__name__}", isinstance(exc.__cause__, psycopg.Error),
                         str(exc).splitlines()[0]]
    with transaction.atomic():
        try:
            publish("t.bad", {1, 2})
        except InvalidEventError as exc:
            found["invalid"] = str(exc)
        order = Order.objects.create(customer="ann", total_cents=1)  # the block is still usable
        publish("t.after_invalid", {"order_id": order.pk})
    try:
        with transaction.atomic():
            try:
                Order.objects.create(customer="bob", total_cents=None)
            except IntegrityError:
                pass
            publish("t.broken", {})
            found["broken"] = "published"
    except TransactionManagementError as exc:
        found["broken"] = str(exc)
    return found


def probe():
    from outbox.relay.relay import Relay
    from outbox.settings import OutboxSettings
    from outbox.testing import wait_for
    from shop.probe_jobs import ob

    publish_many([{"topic": "probe", "payload": {"n": 1, "terminate": True}, "key": "p"},
                  {"topic": "probe", "payload": {"n": 2, "terminate": False}, "key": "p"}])
    settings = OutboxSettings(_env_file=None, database_url=os.environ["OUTBOX_DATABASE_URL"], concurrency=1,
                              poll_interval=0.2, reap_interval=0.2, shutdown_grace=2.0)
    relay = Relay(ob, settings)
    relay.start()
    with psycopg.connect(os.environ["TEST_LIBPQ_URL"], autocommit=True) as db:
        def finished():
            rows = db.execute("SELECT e.payload->>'n', j.status, j.last_error FROM outbox_jobs j "
                              "JOIN outbox_events e ON e.id = j.event_id WHERE j.consumer = 'probe' "
                              "AND j.status IN ('done', 'dead') ORDER BY e.id").fetchall()
            return rows if len(rows) == 2 else None

        try:
            rows = wait_for(finished, timeout=30, what="both probe jobs to finish")
        finally:
            relay.stop()
    return {"jobs": [list(row) for row in rows], "orders": sorted(Order.objects.values_list("customer", flat=True))}


if __name__ == "__main__":
    print(json.dumps(globals()[sys.argv[1]]()))
'''


# ------------------------------------------------------------------ the project


def documented_modules() -> dict[str, str]:
    """The python blocks of the Django page run by this module's tests, by the path their
    first line names (``# shop/views.py``)."""
    found = {}
    for block in docs_pages.blocks(DOCS_PAGE):
        if block.language == "python" and block.marker == "tested-by":
            assert block.argument.startswith("tests/integration/test_django.py::"), block
            first = block.text.splitlines()[0]
            assert first.startswith("# shop/"), f"{block}: its first line names its module"
            found[first.removeprefix("# ").split(":")[0]] = block.text
    assert set(found) == {"shop/models.py", "shop/views.py", "shop/jobs.py"}
    return found


class DjangoProject:
    """A Django project in ``folder`` on the test's database, migrated."""

    def __init__(self, folder: Path, db_url: URL) -> None:
        self.folder = folder
        self.env = {**os.environ, "DJANGO_SETTINGS_MODULE": "shopsite.settings",
                    "OUTBOX_DATABASE_URL": db_url.render_as_string(hide_password=False),
                    "TEST_LIBPQ_URL": db_url.set(drivername="postgresql").render_as_string(hide_password=False)}
        self.env.pop("OUTBOX_SCHEMA", None)
        files = {
            "manage.py": "import sys\nfrom django.core.management import execute_from_command_line\n"
                         "execute_from_command_line(sys.argv)\n",
            "shopsite/__init__.py": "",
            "shopsite/settings.py": SETTINGS % {"name": db_url.database, "user": db_url.username,
                                                "password": db_url.password or "",
                                                # the embedded server's socket folder is the URL's ?host=
                                                "host": db_url.host or db_url.query.get("host") or "",
                                                "port": str(db_url.port or db_url.query.get("port") or "")},
            "shopsite/urls.py": URLS,
            "shop/__init__.py": "",
            "shop/migrations/__init__.py": "",
            "shop/more_views.py": MORE_VIEWS,
            "shop/probe_jobs.py": PROBE_JOBS,
            "impostor/__init__.py": "",
            "impostor/base.py": IMPOSTOR_BACKEND,
            "scenarios.py": SCENARIOS,
            **documented_modules(),
        }
        for name, text in files.items():
            path = folder / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
        self.run("manage.py", "makemigrations", "shop")
        self.run("manage.py", "migrate")

    def run(self, *argv: str) -> str:
        done = subprocess.run([sys.executable, *argv], cwd=self.folder, env=self.env, capture_output=True, text=True,
                              timeout=TIMEOUT)
        assert done.returncode == 0, f"{' '.join(argv)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
        return done.stdout

    def scenario(self, name: str) -> Any:
        """Run scenarios.py's ``name`` and return what it printed (JSON, its last line)."""
        return json.loads(self.run("scenarios.py", name).splitlines()[-1])


@pytest.fixture
def project(tmp_path: Path, db_url: URL) -> DjangoProject:
    return DjangoProject(tmp_path, db_url)


def rows(engine: sa.Engine, sql: str) -> list[tuple[Any, ...]]:
    with engine.connect() as c:
        return [tuple(row) for row in c.exec_driver_sql(sql)]


# ------------------------------------------------------------------ publishing


def test_a_view_publishes_in_its_transaction_and_a_relay_handles_the_event(
        project: DjangoProject, engine: sa.Engine, settings: Callable[..., OutboxSettings]) -> None:
    seen = project.scenario("views")
    assert seen["declined"] == [402, {"declined": True}]
    status, body = seen["placed"]
    assert status == 201
    order_id = body["order_id"]
    assert rows(engine, "SELECT id, customer, total_cents FROM shop_order") == [(order_id, "ann", 2500)]
    assert rows(engine, "SELECT topic, key FROM outbox_events") == [("order.placed", f"order:{order_id}")]

    ob = Outbox()
    handled: list[tuple[str | None, Any]] = []

    @ob.subscriber("order.placed", consumer="ledger")
    def ledger(job: Job) -> None:
        handled.append((job.key, job.payload))

    relay = Relay(ob, settings())
    relay.start()
    try:
        wait_for(lambda: handled, timeout=20, what="the job of the committed order")
    finally:
        relay.stop()
    assert handled == [(f"order:{order_id}", {"order_id": order_id, "total_cents": 2500})]


def test_outside_an_atomic_block_an_event_commits_at_once(project: DjangoProject, engine: sa.Engine) -> None:
    seen = project.scenario("autocommit")
    assert seen == {"alone": 1, "many": 2, "autocommit_after": True, "block_inside": 0, "block_after": 1}
    assert rows(engine, "SELECT topic, payload->>'n', run_at IS NOT NULL FROM outbox_events ORDER BY id") == [
        ("t.alone", "1", False), ("t.many", "1", False), ("t.many", "2", True), ("t.block", "1", False)]


def test_a_rolled_back_savepoint_publishes_nothing_while_the_outer_block_commits(
        project: DjangoProject, engine: sa.Engine) -> None:
    ids = project.scenario("savepoint")
    assert rows(engine, "SELECT id FROM shop_order ORDER BY id") == [(ids["kept"],), (ids["after"],)]
    assert rows(engine, "SELECT topic, key FROM outbox_events ORDER BY id") == [
        ("order.placed", f"order:{ids['kept']}"), ("order.placed", f"order:{ids['after']}")]


def test_the_publish_options_reach_the_event(project: DjangoProject, engine: sa.Engine) -> None:
    ids = project.scenario("options")
    assert ids["again"] == ids["first"] and ids["many"][0] == ids["first"]
    assert rows(engine, "SELECT id, topic, payload->>'n', priority, dedup_key, run_at IS NOT NULL, headers->>'h' "
                        "FROM outbox_events ORDER BY id") == [
        (ids["first"], "t.options", "1", -5, "d-1", False, None),
        (ids["later"], "t.later", "3", None, None, True, "v"),
        (ids["many"][1], "t.options", "5", None, "d-2", False, None)]


def test_a_backend_other_than_postgresql_on_psycopg_3_is_refused(project: DjangoProject, engine: sa.Engine) -> None:
    found = project.scenario("refused")
    assert "alias 'other' is sqlite" in found["sqlite"] and "PostgreSQL only" in found["sqlite"]
    assert "alias 'other' is sqlite" in found["sqlite_many"]
    assert "alias 'impostor' connects through sqlite3.Connection, not psycopg 3" in found["impostor"]
    assert found["missing"] == "outbox.contrib.django: no database alias 'missing' in DATABASES"
    assert "is async def" in found["async"]
    assert rows(engine, "SELECT topic FROM outbox_events") == [("t.after_refusal",)]


def test_errors_are_djangos_and_one_call_commits_whole(project: DjangoProject, engine: sa.Engine) -> None:
    with engine.begin() as c:  # a database error in the second statement of a publish_many
        c.exec_driver_sql("CREATE FUNCTION explode() RETURNS trigger LANGUAGE plpgsql AS "
                          "$$ BEGIN RAISE EXCEPTION 'exploded'; END $$")
        c.exec_driver_sql("CREATE TRIGGER explode BEFORE INSERT ON outbox_events FOR EACH ROW "
                          "WHEN (NEW.payload ? 'explode') EXECUTE FUNCTION explode()")
    found = project.scenario("errors")
    assert found["many"] == ["django.db.utils.ProgrammingError", True, "exploded"]  # RAISE: P0001
    assert found["invalid"] == "payload: set is not JSON-serialisable"
    assert found["broken"].startswith("An error occurred in the current transaction.")
    assert rows(engine, "SELECT topic FROM outbox_events") == [("t.after_invalid",)]  # nothing of the first batch


def test_importing_outbox_needs_no_django_and_the_integration_names_the_extra() -> None:
    code = textwrap.dedent("""
        import sys
        sys.modules["django"] = None  # as if Django were not installed
        import outbox
        assert not any(name == "django" or name.startswith("django.") for name in sys.modules if sys.modules[name])
        try:
            import outbox.contrib.django
        except ImportError as exc:
            print(exc)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT, check=True)
    assert done.stdout.strip() == "outbox.contrib.django needs Django 4.2 or later: pip install 'outbox-relay[django]'"


# ------------------------------------------------------------------ handlers


def test_the_orm_handler_wrapper_replaces_a_connection_the_server_closed(
        project: DjangoProject, engine: sa.Engine) -> None:
    seen = project.scenario("probe")
    first, second = seen["jobs"]
    assert first[:2] == ["1", "dead"] and "terminating connection" in first[2]
    assert second == ["2", "done", None]  # the next job on the same worker thread got a fresh connection
    assert seen["orders"] == ["probe 2"]


def test_the_documented_view_and_handler_module_run_as_written(project: DjangoProject, engine: sa.Engine) -> None:
    """The blocks of docs/publishing-django.md (written into the project as shop/models.py,
    shop/views.py and shop/jobs.py): an order placed through the view, handled by
    ``outbox-relay --app shop.jobs:ob``, whose handler reads it and writes its receipt
    through the ORM."""
    argv = [str(Path(sys.executable).parent / "outbox-relay"), "--app", "shop.jobs:ob"]
    with relay_process(argv, env=project.env, cwd=project.folder, timeout=TIMEOUT) as (relay, log):
        seen = project.scenario("views")
        order_id = seen["placed"][1]["order_id"]
        receipts = wait_for(lambda: rows(engine, "SELECT order_id, total_cents FROM shop_receipt"), timeout=30,
                            what="the receipt written by the documented handler")
    assert receipts == [(order_id, 2500)]
    assert relay.returncode == 0, "".join(log)[-3000:]
    assert rows(engine, "SELECT status FROM outbox_jobs WHERE consumer = 'write_receipt'") == [("done",)]
