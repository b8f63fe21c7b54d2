"""The package's layout holds its dependency direction (STYLE.md, "Layout"):

    errors, settings, resources, job  ->  db  ->  the public API (registry, publish, fencing,
    schedule, sinks) and telemetry  ->  relay  ->  admin, testing  ->  ops (dashboard, grants)  ->  cli

``Job`` (what a handler sees) sits with the errors: it imports nothing but them, and the
job statements' wrappers (:mod:`outbox.db.jobs`) build it from their rows.

Each module may import its own layer and the layers before it, never one after. Besides,
the operator's API (:mod:`outbox.admin`) and what presents it (the dashboard, the command
line) import no module of the relay (``RELAY_FREE``): every operator action and query lives
in admin, on the db layer's statements and rules; only the command line's ``run`` starts the
relay process (:mod:`outbox.relay.relay`). Read from
the source (every ``import``, including those inside functions), so an import added for a
single call counts as much as one at the top of a module."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import outbox

PACKAGE = Path(outbox.__file__).resolve().parent

#: Layers in dependency order; a module belongs to the first prefix it matches, longest first.
LAYERS: list[tuple[str, ...]] = [
    ("outbox.errors", "outbox.settings", "outbox.resources", "outbox.redaction", "outbox.job"),
    ("outbox.db",),
    ("outbox", "outbox.registry", "outbox.publish", "outbox.typed_events", "outbox.intake", "outbox.fencing", "outbox.schedule", "outbox.backoff",
     "outbox.sinks", "outbox.telemetry"),
    ("outbox.relay",),
    ("outbox.admin", "outbox.testing", "outbox.pytest_plugin", "outbox.demo"),
    ("outbox.ops",),
    ("outbox.ops.cli",),
]


#: Modules that import no module of ``outbox.relay``, each with the ones it may import
#: nevertheless (a module belongs to the longest prefix it matches).
RELAY_FREE: dict[str, tuple[str, ...]] = {
    "outbox.admin": (),
    "outbox.ops.dashboard": (),
    "outbox.ops.cli": ("outbox.relay.relay",),  # `run` starts the relay process
}


def relay_allowed(module: str) -> tuple[str, ...] | None:
    """The relay modules ``module`` may import when it is in ``RELAY_FREE``; None when it
    is not (then only the layers decide)."""
    prefixes = [p for p in RELAY_FREE if module == p or module.startswith(p + ".")]
    return RELAY_FREE[max(prefixes, key=len)] if prefixes else None


def layer_of(module: str) -> int:
    best, level = "", -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(best):
                best, level = prefix, index
    assert level >= 0, f"{module} is in no layer: add it to LAYERS"
    return level


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    path = PACKAGE.parent / Path(*name.split("."))
    return path.with_suffix(".py").exists() or path.is_dir()


def imports(module: str, is_package: bool, source: str) -> list[tuple[int, str]]:
    """(line, module) of every import of an outbox module in ``source``, the text of
    ``module``; relative imports resolved, ``from outbox import admin`` read as the module."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "outbox" or target.startswith("outbox."):
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    found.append((node.lineno, sub if is_module(sub) else target))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("outbox")]
    return found


def violations(modules: dict[str, tuple[bool, str]]) -> list[str]:
    """What breaks the layering in ``modules`` (name -> (is a package, source text))."""
    found = []
    for here, (is_package, source) in sorted(modules.items()):
        for line, target in imports(here, is_package, source):
            if target == "outbox.ops.cli" and here != "outbox.ops.cli":
                found.append(f"{here}:{line} imports the command line")
            elif layer_of(target) > layer_of(here):
                found.append(f"{here}:{line} imports {target}, a later layer")
            elif (target == "outbox.relay" or target.startswith("outbox.relay.")) and \
                    (allowed := relay_allowed(here)) is not None and target not in allowed:
                found.append(f"{here}:{line} imports {target}: the operator's tools reach the relay through "
                             "outbox.admin only")
    return found


def package_modules() -> dict[str, tuple[bool, str]]:
    paths = [p for p in PACKAGE.rglob("*.py") if "migrations" not in p.relative_to(PACKAGE).parts]
    return {module_name(p): (p.name == "__init__.py", p.read_text()) for p in paths}


def test_every_module_imports_only_its_own_layer_and_earlier_ones():
    modules = package_modules()
    assert len(modules) > 40 and "outbox.relay.producer" in modules
    assert violations(modules) == []


@pytest.mark.parametrize(("module", "expected"), [
    ("outbox.errors", 0), ("outbox.job", 0), ("outbox.db.queries", 1), ("outbox.db.jobs", 1), ("outbox.publish", 2),
    ("outbox.telemetry.metrics", 2),
    ("outbox.relay.producer", 3), ("outbox.admin", 4), ("outbox.ops.dashboard.app", 5), ("outbox.ops.cli", 6),
])
def test_layers_are_found_by_the_longest_prefix(module, expected):
    assert layer_of(module) == expected


def test_the_check_reports_what_breaks_the_layering():
    modules = {
        "outbox.db.tables": (False, "def f():\n    from outbox.relay import executor\n"),
        "outbox.relay.router": (False, "from ..ops import cli\n"),
        "outbox.publish": (False, "from .telemetry import tracing\nfrom . import errors\n"),
        "outbox.admin": (False, "import outbox.ops.dashboard\nfrom outbox.relay import maintenance\n"),
        "outbox.ops.dashboard.app": (False, "def f():\n    from outbox.relay.ordering import promote\n"),
        "outbox.ops.cli": (False, "from outbox.relay.relay import Relay\nfrom outbox.relay import ordering\n"),
    }
    assert violations(modules) == [
        "outbox.admin:1 imports outbox.ops.dashboard, a later layer",
        "outbox.admin:2 imports outbox.relay.maintenance: the operator's tools reach the relay through outbox.admin only",
        "outbox.db.tables:2 imports outbox.relay.executor, a later layer",
        "outbox.ops.cli:2 imports outbox.relay.ordering: the operator's tools reach the relay through outbox.admin only",
        "outbox.ops.dashboard.app:2 imports outbox.relay.ordering: the operator's tools reach the relay through "
        "outbox.admin only",
        "outbox.relay.router:1 imports the command line",
    ]


@pytest.mark.parametrize("module", ["outbox.admin", "outbox.ops.dashboard.app"])
def test_the_operator_api_and_the_dashboard_load_no_relay_module(module):
    """Not even through another module: importing them leaves ``outbox.relay`` unloaded."""
    loaded = subprocess.run(
        [sys.executable, "-c", f"import sys, {module}; print(sorted(m for m in sys.modules if m.startswith('outbox.relay')))"],
        capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    assert loaded == "[]"
