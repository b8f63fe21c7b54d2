"""Files that ship inside the package: the migrations and the documents.

In the repository they live in top-level folders (the migrations in ``alembic`` next to
``alembic.ini``, the documents in ``docs``); the wheel ships the same files inside the package (``outbox/migrations``,
``outbox/docs``) through setuptools package-dir mappings, so a plain install can migrate and
read its notes. A source checkout or an editable install finds them at the top level: the
editable import finder cannot map a folder without ``__init__.py`` into a regular package,
and the migrations folder has none on purpose (as a package it would shadow the alembic library for
code run from the repository).
"""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parent


def shipped_dir(in_package: str, in_repository: str, marker: str) -> Path:
    """The folder holding ``marker``: ``outbox/<in_package>`` in an installed package, else
    ``<repository>/<in_repository>`` beside the ``outbox`` package. Raises
    :class:`FileNotFoundError` naming both places when neither holds it."""
    candidates = (PACKAGE / in_package, PACKAGE.parent / in_repository)
    for candidate in candidates:
        if (candidate / marker).is_file():
            return candidate
    raise FileNotFoundError(f"outbox's {in_package} are missing: neither {candidates[0]} nor {candidates[1]} "
                            f"holds {marker}")


def docs_dir() -> Path:
    """The folder of outbox's documents (``architecture.md``: design, tables, statements,
    failure handling; ``forwarding.md``: forwarders to JetStream and RabbitMQ, the message
    mapping, guarantees and failures; ``reliability.md``: the faults tested and the defects
    they found; ``performance.md``: benchmarks and their findings; ``dashboard.md``: the web
    dashboard, its safety and its cost), shipped with the package."""
    return shipped_dir("docs", "docs", "architecture.md")
