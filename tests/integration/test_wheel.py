"""The built wheel carries the migrations: a plain (non-editable) install migrates a fresh
database with `outbox-relay migrate`, run from outside the repository."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest
import sqlalchemy as sa

from outbox.db.engine import make_engine
from outbox.db.migrate import head_revision

REPO = Path(__file__).resolve().parents[2]


def run(*args: str | os.PathLike[str], cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "PYTHON"))}
    result = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, f"{args} failed:\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """outbox's wheel, built from a copy of the source (the work tree stays clean)."""
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    src.mkdir()
    shutil.copy2(REPO / "pyproject.toml", src)
    for name in ("README.md", "LICENSE"):
        if (REPO / name).exists():
            shutil.copy2(REPO / name, src)
    for folder in ("outbox", "alembic", "docs"):  # shipped as outbox/migrations and outbox/docs
        shutil.copytree(REPO / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    dist = root / "dist"
    run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", dist, src, cwd=root)
    [built] = dist.glob("outbox_relay-*.whl")  # the distribution's name is outbox-relay
    return built


def test_wheel_ships_the_migrations(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for required in ("outbox/migrations/env.py", "outbox/migrations/script.py.mako",
                     f"outbox/migrations/versions/{_revision_file()}", "outbox/db/tables.py",
                     "outbox/docs/architecture.md", "outbox/docs/reliability.md", "outbox/docs/performance.md",
                     "outbox/docs/forwarding.md",
                     "outbox/docs/img/throughput.png",  # the images performance.md shows
                     "outbox/ops/dashboard/templates/base.html", "outbox/ops/dashboard/templates/overview.html",
                     "outbox/ops/dashboard/static/htmx.min.js", "outbox/ops/dashboard/static/style.css",
                     "outbox/ops/dashboard/static/NOTICE", "outbox/docs/dashboard.md",
                     "outbox/docs/img/dashboard-overview.png"):
        assert required in names, sorted(names)
    shipped = {f"outbox/ops/dashboard/{p.relative_to(REPO / 'outbox' / 'ops' / 'dashboard').as_posix()}"
               for folder in ("templates", "static") for p in (REPO / "outbox" / "ops" / "dashboard" / folder).iterdir()}
    assert shipped <= names, sorted(shipped - names)  # every template and asset of the dashboard
    assert not any(name.startswith("tests/") for name in names)
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "outbox-relay = outbox.ops.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def _revision_file() -> str:
    [path] = [p.name for p in (REPO / "alembic" / "versions").glob(f"{head_revision()}_*.py")]
    return path


def test_wheel_is_typed(wheel):
    """PEP 561: without ``outbox/py.typed`` in the wheel, mypy treats an installed outbox as
    untyped and checks nothing an application does with it."""
    assert "outbox/py.typed" in zipfile.ZipFile(wheel).namelist()


def test_installed_wheel_migrates_a_fresh_database(wheel, tmp_path, empty_db_url):
    # A fresh venv holding only the wheel's outbox; its dependencies come from the dev
    # venv's site-packages through a .pth line, which (unlike a site directory) does not
    # run the editable install's hook, so the source tree can never be imported.
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False, symlinks=True).create(env_dir)
    python = env_dir / "bin" / "python"
    run(sys.executable, "-m", "pip", "--python", python, "install", "--quiet", "--no-deps", "--no-index",
        wheel, cwd=tmp_path)
    purelib = Path(run(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))",
                       cwd=tmp_path).stdout.strip())
    (purelib / "zz_outbox_test_deps.pth").write_text(sysconfig.get_path("purelib") + "\n")

    elsewhere = tmp_path / "elsewhere"  # not the repository, so no ./outbox to import
    elsewhere.mkdir()
    probe = run(python, "-c", "import outbox, outbox.db.migrate as m; print(outbox.__file__); print(m.migrations_dir()); "
                "print(outbox.docs_dir())",
                cwd=elsewhere)
    for path in probe.stdout.split():
        assert Path(path).resolve().is_relative_to(purelib.resolve()), probe.stdout
        assert not Path(path).resolve().is_relative_to(REPO), probe.stdout

    assert (env_dir / "bin" / "outbox-relay").exists()  # the console script was installed

    url = empty_db_url.render_as_string(hide_password=False)
    result = run(python, "-m", "outbox.ops.cli", "migrate", "--database-url", url, cwd=elsewhere)
    assert result.stdout == f"outbox schema public at revision {head_revision()}\n"

    engine = make_engine(empty_db_url)
    try:
        with engine.connect() as conn:
            tables = set(sa.inspect(conn).get_table_names())
            version = conn.exec_driver_sql("SELECT version_num FROM outbox_alembic_version").scalar_one()
    finally:
        engine.dispose()
    assert {"outbox_events", "outbox_subscriptions", "outbox_jobs", "outbox_alembic_version"} <= tables
    assert version == head_revision()
