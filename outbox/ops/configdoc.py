"""The settings' reference, the configuration page of the documents, written from
:class:`OutboxSettings` (run from a checkout; the commands are :data:`WRITE_COMMAND` and its
``--check`` twin, which exits 1 when the page is stale).

The page is written by hand except between the two marker lines :data:`BEGIN` and :data:`END`,
which hold one table row per settings field (field, environment variable, type, default,
description), in the order the fields are declared. The fields' descriptions are the one
source: edit them in the settings module and rewrite the page; the unit tests fail while
the page is stale, naming :data:`WRITE_COMMAND`.
"""

from __future__ import annotations

import argparse
import sys
import types
import typing
from dataclasses import dataclass
from pathlib import Path

from pydantic import SecretStr
from pydantic.fields import FieldInfo

from outbox.settings import OutboxSettings

#: The command that rewrites the page; named by ``--check`` and the test when the page is stale.
WRITE_COMMAND = "python -m outbox.ops.configdoc --write docs/configuration.md"
#: First line of the generated part of the page.
BEGIN = "<!-- BEGIN settings table: generated from OutboxSettings by `" + WRITE_COMMAND + "`; do not edit -->"
#: Last line of the generated part of the page.
END = "<!-- END settings table -->"


class StaleError(Exception):
    """The page's generated part does not match the settings, or its markers are missing."""


@dataclass(frozen=True)
class SettingRow:
    """One settings field as the page shows it: its name, environment variable, type,
    default and description, each already written as Markdown."""

    field: str
    env: str
    type: str
    default: str
    description: str


def env_name(name: str, info: FieldInfo) -> str:
    """The environment variable a field is read from: its validation alias in capitals
    (``schema_name`` is ``OUTBOX_SCHEMA``), else ``OUTBOX_`` and the field's name in capitals."""
    alias = info.validation_alias
    if isinstance(alias, str):
        return alias.upper()
    return str(OutboxSettings.model_config.get("env_prefix", "")) + name.upper()


def type_text(annotation: object) -> str:
    """A field's type in words: ``int``, ``float``, ``bool``, ``str``, ``secret`` (never shown
    or logged), one of a Literal's values, and ``or none`` when the field may be unset."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        kinds = [type_text(arg) for arg in args if arg is not type(None)]
        return " or ".join(kinds) + (" or none" if type(None) in args else "")
    if typing.get_origin(annotation) is typing.Literal:
        return " or ".join(f"`{value}`" for value in args)
    if annotation is SecretStr:
        return "secret"
    return getattr(annotation, "__name__", str(annotation))


def default_text(value: object) -> str:
    """A default as the page shows it: ``none``, ``true``/``false``, a number without a
    needless ``.0``, a string in backticks (``empty`` for the empty string)."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}" if value.is_integer() and abs(value) < 1e15 else repr(value)
    if value == "":
        return "empty"
    if isinstance(value, str):
        return f"`{value}`"
    return str(value)


def cell(text: str) -> str:
    """Text made safe for one cell of a Markdown table: no line breaks, pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def rows() -> list[SettingRow]:
    """Every field of :class:`OutboxSettings`, in declaration order."""
    return [
        SettingRow(field=name, env=env_name(name, info), type=type_text(info.annotation),
                   default=default_text(info.get_default()), description=info.description or "")
        for name, info in OutboxSettings.model_fields.items()
    ]


def table() -> str:
    """The generated part of the page, markers included, ending with a newline."""
    lines = [BEGIN, "", "| field | environment variable | type | default | description |", "|---|---|---|---|---|"]
    lines += [f"| `{r.field}` | `{r.env}` | {cell(r.type)} | {cell(r.default)} | {cell(r.description)} |"
              for r in rows()]
    return "\n".join([*lines, "", END]) + "\n"


def render(page: str) -> str:
    """``page`` with its generated part (the lines from :data:`BEGIN` to :data:`END`)
    replaced by the current :func:`table`. Raises :class:`StaleError` when a marker is
    missing or out of order."""
    lines = page.splitlines(keepends=True)
    stripped = [line.rstrip("\n") for line in lines]
    if stripped.count(BEGIN) != 1 or stripped.count(END) != 1 or stripped.index(BEGIN) > stripped.index(END):
        raise StaleError(f"the page needs one line {BEGIN!r} and, after it, one line {END!r}")
    start, end = stripped.index(BEGIN), stripped.index(END)
    return "".join(lines[:start]) + table() + "".join(lines[end + 1:])


def check(path: Path) -> None:
    """Raise :class:`StaleError` naming :data:`WRITE_COMMAND` when the page at ``path`` is
    not what :func:`render` makes of it."""
    page = path.read_text(encoding="utf-8")
    if render(page) != page:
        raise StaleError(f"{path} is stale: the settings changed since it was written; run `{WRITE_COMMAND}`")


def main(argv: list[str] | None = None) -> int:
    """Command line: ``--write PATH`` rewrites the page's generated part (exit 0);
    ``--check PATH`` exits 1 with one line on stderr when it is stale, 0 otherwise."""
    parser = argparse.ArgumentParser(prog="python -m outbox.ops.configdoc",
                                     description="Write or check the settings table of docs/configuration.md.")
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--write", metavar="PATH", type=Path, help="rewrite the page's generated part")
    action.add_argument("--check", metavar="PATH", type=Path, help="exit 1 when the page's generated part is stale")
    args = parser.parse_args(argv)
    try:
        if args.write is not None:
            args.write.write_text(render(args.write.read_text(encoding="utf-8")), encoding="utf-8")
        else:
            check(args.check)
    except (StaleError, OSError) as exc:
        print(f"configdoc: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
