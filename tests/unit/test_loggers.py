"""One logger per module (STYLE.md): a module that logs does so through
``log = logging.getLogger(__name__)``, defined once at its top level, so every record names
the module that wrote it and ``logging.getLogger("outbox.relay.router").setLevel(...)``
tunes that module alone. Read from the source of every module of the package."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import outbox

PACKAGE = Path(outbox.__file__).resolve().parent

#: What a call of ``logging.getLogger`` with another name may do: configure that logger (a
#: library's, or the one a record came from), never log through it.
CONFIGURING = {"setLevel", "addFilter", "removeFilter", "addHandler", "removeHandler", "isEnabledFor"}
#: The root logger's shortcuts, which log as no module at all.
ROOT_SHORTCUTS = {"debug", "info", "warning", "warn", "error", "exception", "critical", "fatal", "log"}


def _is_get_logger(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and (
        (isinstance(node.func, ast.Attribute) and node.func.attr == "getLogger")
        or (isinstance(node.func, ast.Name) and node.func.id == "getLogger"))


def _named_after_module(call: ast.Call) -> bool:
    return len(call.args) == 1 and not call.keywords and isinstance(call.args[0], ast.Name) \
        and call.args[0].id == "__name__"


def problems(source: str) -> list[str]:
    """What breaks the one-logger rule in ``source`` (one module's text), one line each."""
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    own = [node for node in tree.body if isinstance(node, ast.Assign) and _is_get_logger(node.value)]
    if len(own) > 1:
        found.append(f"line {own[1].lineno}: a second module logger")
    for node in ast.walk(tree):
        if _is_get_logger(node):
            assert isinstance(node, ast.Call)
            parent = parents.get(node)
            if _named_after_module(node):
                if not (isinstance(parent, ast.Assign) and parent in tree.body):
                    found.append(f"line {node.lineno}: getLogger(__name__) outside the module's one assignment")
            elif not (isinstance(parent, ast.Attribute) and parent.attr in CONFIGURING):
                found.append(f"line {node.lineno}: a logger not named after the module ({ast.unparse(node)})")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and isinstance(node.func.value, ast.Name) and node.func.value.id == "logging"
              and node.func.attr in ROOT_SHORTCUTS):
            found.append(f"line {node.lineno}: logs through the root logger (logging.{node.func.attr})")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("outbox"):
            found += [f"line {node.lineno}: imports another module's logger ({alias.name})"
                      for alias in node.names if alias.name in {"log", "logger", "LOG", "_log"}]
    return found


def test_every_module_logs_through_one_logger_named_after_it():
    paths = sorted(p for p in PACKAGE.rglob("*.py") if "migrations" not in p.relative_to(PACKAGE).parts)
    assert len(paths) > 40
    offenders = {str(p.relative_to(PACKAGE)): found for p in paths if (found := problems(p.read_text()))}
    assert offenders == {}


@pytest.mark.parametrize(("source", "problem"), [
    ('import logging\nlog = logging.getLogger("outbox.worker")\n', "not named after the module"),
    ("import logging\nlog = logging.getLogger(__name__)\nother = logging.getLogger(__name__)\n",
     "a second module logger"),
    ("import logging\ndef f():\n    logging.getLogger(__name__).info('x')\n", "outside the module's one assignment"),
    ("import logging\nlogging.warning('x')\n", "root logger"),
    ("from outbox.relay.worker import log\n", "another module's logger"),
])
def test_the_check_reports_what_breaks_the_rule(source, problem):
    [found] = problems(source)
    assert problem in found


def test_the_check_lets_a_library_logger_be_configured():
    assert problems('import logging\nlog = logging.getLogger(__name__)\n'
                    'logging.getLogger("pgserver").setLevel(logging.WARNING)\n') == []
