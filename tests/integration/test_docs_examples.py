"""Every code block of the README, CONTRIBUTING.md and docs/ runs here, so the documents
stay true (issue 27 item 6). tests/docs_pages.py reads the blocks and says what each
block's marker means.

Each page gets a migrated database of its own and the examples' application, a folder
holding the package ``myapp``: the modules written out by the blocks marked ``file:``
(``myapp/models.py``, ``myapp/mail.py`` and ``myapp/jobs.py`` in the README,
``myapp/ledger.py`` in docs/ordering.md), over a ``myapp/mail.py`` of the test's own (a mail
client that records what it is asked to send, as the README's does). The placeholder URLs of the examples (:data:`PLACEHOLDER_URLS`) are
replaced by the page's database, which is also ``OUTBOX_DATABASE_URL`` of the page's
commands; the application's tables (``myapp.models.md``) are created before any block runs.

- python blocks are executed, each in a namespace of its own, in the order of the page;
- sql blocks are executed on the page's database, json blocks parsed;
- bash blocks run their commands (``VAR=value`` prefixes and ``export`` honoured):
  ``outbox-relay`` commands against the page's database, where the README's example
  has run once (its subscriptions written, an event published and handled), ending 0, or 1 (the documented "matched
  nothing"); a relay (``run``, ``--app``) is started, must log that it started,
  and must stop with status 0 on SIGTERM; ``pip install`` lines must name extras the
  package has, ``pytest`` lines paths that exist (neither runs here);
- an ``output-of`` block must be what its command prints now.

The python, sql and json blocks run in ``test_page_examples``; the bash blocks, which start
processes, in ``test_page_commands`` (marked slow).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL

from outbox.db.engine import make_engine
from tests import docs_pages
from tests.docs_pages import ROOT, Block
from tests.integration.helpers import relay_process

#: URLs the examples show for "your database"; the test puts the page's database in their place.
PLACEHOLDER_URLS = ("postgresql+psycopg://app@localhost/shop", "postgresql://app@localhost/shop")

#: The stand-in for "your mail client" of the README's example.
MAIL_MODULE = '''"""A mail client that records what it is asked to send (the documents' tests)."""
sent = []


class Mailer:
    def send(self, **message):
        sent.append(message)


mailer = Mailer()
'''

#: Seconds a command may take; a relay, to log that it started and then to stop.
COMMAND_TIMEOUT = 120.0


def _pages_with(languages: tuple[str, ...]) -> list[Path]:
    return [page for page in docs_pages.pages()
            if any(block.language in languages and block.marker is None or block.marker in ("pytest", "output-of")
                   for block in docs_pages.blocks(page))]


def _url_text(url: URL) -> str:
    return url.render_as_string(hide_password=False)


def _with_database(text: str, url: URL) -> str:
    for placeholder in PLACEHOLDER_URLS:  # each with its own scheme: libpq's, or SQLAlchemy's psycopg
        text = text.replace(placeholder, _url_text(url.set(drivername=placeholder.split("://")[0])))
    return text


def _write_app(folder: Path, url: URL) -> None:
    """The examples' application in ``folder``: every ``file:`` block, and myapp/mail.py."""
    package = folder / "myapp"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text("", encoding="utf-8")
    (package / "mail.py").write_text(MAIL_MODULE, encoding="utf-8")
    for page in docs_pages.pages():
        for block in docs_pages.blocks(page):
            if block.marker == "file":
                (folder / block.argument).write_text(_with_database(block.text, url), encoding="utf-8")


@pytest.fixture
def app(db_url: URL, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The examples' application on this test's database, importable and the current
    directory; its tables created. Yields the module ``myapp.models``."""
    _write_app(tmp_path, db_url)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("OUTBOX_DATABASE_URL", _url_text(db_url))
    for name in [n for n in sys.modules if n == "myapp" or n.startswith("myapp.")]:
        monkeypatch.delitem(sys.modules, name)
    import importlib

    models = importlib.import_module("myapp.models")
    models.md.create_all(models.engine)
    yield models
    models.engine.dispose()
    for name in [n for n in sys.modules if n == "myapp" or n.startswith("myapp.")]:
        del sys.modules[name]


def _run_python(block: Block, db_url: URL) -> None:
    namespace: dict[str, Any] = {"__name__": f"docs_example_{block.line}"}
    try:
        exec(compile(_with_database(block.text, db_url), str(block), "exec"), namespace)  # noqa: S102 - the docs' own code
    except Exception as exc:
        raise AssertionError(f"{block}: {type(exc).__name__}: {exc}") from exc
    if block.marker == "pytest":
        tests = {name: value for name, value in namespace.items() if name.startswith("test_") and callable(value)}
        assert tests, f"{block}: a pytest block defines test functions"
        engine = make_engine(db_url)
        try:
            for test in tests.values():
                arguments = test.__code__.co_varnames[:test.__code__.co_argcount]
                test(**{argument: engine for argument in arguments if argument == "outbox_engine"})
        finally:
            engine.dispose()


def _run_sql(block: Block, db_url: URL) -> None:
    engine = make_engine(db_url)
    try:
        with engine.connect() as connection:
            connection = connection.execution_options(isolation_level="AUTOCOMMIT")  # VACUUM runs outside a transaction
            connection.exec_driver_sql(block.text)
    finally:
        engine.dispose()


@pytest.mark.parametrize("page", _pages_with(("python", "sql", "json")), ids=lambda p: p.name)
def test_page_examples(page: Path, app: Any, db_url: URL) -> None:
    """The page's python, sql and json blocks, in order, on a database of the page's own."""
    ran = 0
    for block in docs_pages.blocks(page):
        if block.marker == "fragment-of" and block.language == "python":
            compile(block.text, str(block), "exec")
        elif block.marker not in (None, "pytest", "file"):
            continue
        elif block.language == "python":
            if block.marker == "file":
                module = block.argument.removesuffix(".py").replace("/", ".")
                __import__(module)
            else:
                _run_python(block, db_url)
            ran += 1
        elif block.language == "sql":
            _run_sql(block, db_url)
            ran += 1
        elif block.language == "json":
            json.loads(block.text)
            ran += 1
    assert ran, f"{page.name}: nothing ran"


def test_readme_example_delivers(app: Any, db_url: URL) -> None:
    """The README's example end to end: its publish block, then the relay's work done by
    ``drain``: the receipt sent with the job's idempotency key, the invoice written."""
    from outbox.testing import drain

    readme = [b for b in docs_pages.blocks(ROOT / "README.md") if b.language == "python" and b.marker is None]
    assert readme, "the README has its publish block"
    for block in readme:
        _run_python(block, db_url)
    import myapp.jobs
    import myapp.mail

    results = drain(app.engine, myapp.jobs.ob)
    assert sorted((r.consumer, r.outcome) for r in results) == [("create_invoice", "done"), ("send_receipt", "done")]
    assert myapp.mail.sent == [{"order": 4, "idempotency_key": f"send_receipt:{results[0].event_id}"}]
    with app.engine.connect() as c:
        assert c.execute(sa.select(app.invoices.c.order_id, app.invoices.c.total_cents)).all() == [(4, 2500)]


# Commands of the bash blocks.


def commands(block: Block) -> list[tuple[dict[str, str], list[str]]]:
    """(environment assignments, argv) of each command of a bash block: continued lines
    joined, comments dropped; ``export VAR=value`` lines give assignments only."""
    found: list[tuple[dict[str, str], list[str]]] = []
    for line in block.text.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if not words:
            continue
        export = words[0] == "export"
        words = words[1:] if export else words
        env = {}
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
            name, _, value = words.pop(0).partition("=")
            env[name] = value
        found.append((env, [] if export else words))
    return found


def _extras() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    return set(project["optional-dependencies"])


def _check_pip(argv: list[str], block: Block) -> None:
    for word in argv[2:]:
        extras = re.search(r"\[([^\]]*)\]", word)
        if extras:
            unknown = set(extras[1].split(",")) - _extras()
            assert not unknown, f"{block}: no extra {sorted(unknown)} in pyproject.toml"


def _check_pytest(argv: list[str], block: Block) -> None:
    for word in argv[1:]:
        if word.startswith("tests/"):
            assert (ROOT / word.split("::")[0]).exists(), f"{block}: {word} does not exist"


def _is_relay(argv: list[str]) -> bool:
    return argv[1:2] == ["run"] or any(word.startswith("--app") for word in argv[1:2])


def _run_relay(argv: list[str], env: dict[str, str], block: Block) -> None:
    with relay_process(argv, env=env, timeout=COMMAND_TIMEOUT, what=f"{block}: {shlex.join(argv)}") as (process, lines):
        pass
    assert process.returncode == 0, f"{block}: {shlex.join(argv)} exited {process.returncode}: {''.join(lines)[-2000:]}"


def _run_command(argv: list[str], env: dict[str, str], block: Block) -> str:
    done = subprocess.run(argv, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=COMMAND_TIMEOUT)
    assert done.returncode in (0, 1), (
        f"{block}: {shlex.join(argv)} exited {done.returncode}: {done.stderr.strip()[-2000:]}")
    if done.returncode == 1:  # "matched nothing": one line on stderr
        assert len(done.stderr.strip().splitlines()) == 1, f"{block}: {shlex.join(argv)}: {done.stderr}"
    return done.stdout


def _executable(name: str) -> str:
    return str(Path(sys.executable).parent / name)


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in docs_pages.pages()
                                  if any(b.language == "bash" and b.marker is None or b.marker == "output-of"
                                         for b in docs_pages.blocks(p))], ids=lambda p: p.name)
def test_page_commands(page: Path, app: Any, db_url: URL) -> None:
    """The page's bash blocks, command by command, against a database of the page's own."""
    import myapp.jobs

    from outbox.testing import drain

    for block in docs_pages.blocks(ROOT / "README.md"):
        if block.language == "python" and block.marker is None:
            _run_python(block, db_url)  # an order placed
    drain(app.engine, myapp.jobs.ob)  # and handled: the application's subscriptions and an event exist
    base = {**os.environ, "OUTBOX_DATABASE_URL": _url_text(db_url)}
    base.pop("OUTBOX_SCHEMA", None)
    ran = 0
    for block in docs_pages.blocks(page):
        if block.marker == "output-of":
            argv = shlex.split(block.argument)
            assert argv[0] == "outbox-relay", block
            printed = _run_command([_executable("outbox-relay"), *argv[1:]], base, block)
            assert printed.strip() == block.text.strip(), f"{block}: the output of {block.argument} changed"
            ran += 1
            continue
        if block.language != "bash" or block.marker is not None:
            continue
        env = dict(base)
        for assignments, argv in commands(block):
            env_here = {**env, **{k: _with_database(v, db_url) for k, v in assignments.items()}}
            if not argv:
                env = env_here  # export
                continue
            argv = [_with_database(word, db_url) for word in argv]
            if argv[:2] == ["pip", "install"]:
                _check_pip(argv, block)
            elif argv[0] == "pytest":
                _check_pytest(argv, block)
            elif argv[0] == "outbox-relay":
                argv = [_executable("outbox-relay"), *argv[1:]]
                if _is_relay(argv):
                    _run_relay(argv, env_here, block)
                else:
                    _run_command(argv, env_here, block)
            else:
                pytest.fail(f"{block}: the test does not know how to run {shlex.join(argv)}; mark the block")
            ran += 1
    assert ran, f"{page.name}: nothing ran"
