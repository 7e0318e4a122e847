"""How the CLI shows things: JSON when piped or asked, readable text on a terminal; errors on stderr."""

from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING, Any, NoReturn

import click

from ksi_common.errors import ErrorCode, KsiError

if TYPE_CHECKING:
    from ksi_common.locate import Location

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3
EXIT_PENDING = 4  # a wait ended before the result: the request still runs in the daemon
EXIT_INTERRUPTED = 130  # Ctrl-C, as shells report it


def wants_json(flag: bool) -> bool:
    return flag or not sys.stdout.isatty()


def dumps(data: Any) -> str:
    return json.dumps(data, ensure_ascii=False, default=str)


def show(data: Any, as_json: bool) -> None:
    if wants_json(as_json):
        click.echo(dumps(data))
        return
    if isinstance(data, dict) and isinstance(data.get("content"), str):
        click.echo(data["content"])
        rest = {k: v for k, v in data.items() if k != "content"}
        click.secho(json.dumps(rest, indent=2, ensure_ascii=False, default=str), dim=True)
        return
    click.echo(json.dumps(data, indent=2, ensure_ascii=False, default=str))


def start_hint(location: Location | None) -> str:
    """How to start the daemon this command looked for, naming where it looked."""
    if location is None:
        return "Is the daemon running? Start it with: ksi daemon start"
    command = "ksi daemon start"
    if location.found_by == "--var-dir":
        command += f" --var-dir {location.var_dir}"
    if location.socket_given:
        command += f" --socket {location.socket}"
    return f"No daemon answers at {location.socket}; var dir {location.describe()}.\nStart it with: {command}"


def report_error(error: KsiError, as_json: bool, location: Location | None = None) -> None:
    """Print an error on stderr: a JSON line when JSON is wanted, else a readable message."""
    if wants_json(as_json):
        click.echo(dumps({"error": error.to_wire()}), err=True)
    else:
        click.secho(f"error [{error.code}]: {error.message}", fg="red", err=True)
        if error.details:
            click.echo(json.dumps(error.details, indent=2, ensure_ascii=False, default=str), err=True)
    if error.code == ErrorCode.DAEMON_UNREACHABLE:
        click.echo(start_hint(location), err=True)


def fail(error: KsiError, as_json: bool, location: Location | None = None) -> NoReturn:
    """Report an error and exit: 3 when the daemon is unreachable, else 1."""
    report_error(error, as_json, location)
    sys.exit(EXIT_UNREACHABLE if error.code == ErrorCode.DAEMON_UNREACHABLE else EXIT_ERROR)


def color_enabled() -> bool:
    """False with --no-color or NO_COLOR, for output not printed through click (rich tables)."""
    context = click.get_current_context(silent=True)
    return not os.environ.get("NO_COLOR") and (context is None or context.color is not False)


def table(rows: list[dict[str, Any]], columns: list[str], title: str | None = None,
          whole: tuple[str, ...] = ()) -> None:
    """A table on the terminal; the `whole` columns (ids) are never wrapped or cut, so they can be
    copied: the other columns give way."""
    from rich.console import Console
    from rich.table import Table

    grid = Table(title=title)
    for column in columns:
        if column in whole:
            widest = max((len(str(row.get(column) or "")) for row in rows), default=0)
            grid.add_column(column, no_wrap=True, overflow="ignore", min_width=max(widest, len(column)))
        else:
            grid.add_column(column)
    for row in rows:
        grid.add_row(*("" if row.get(c) is None else str(row.get(c)) for c in columns))
    Console(color_system="auto" if color_enabled() else None).print(grid)
