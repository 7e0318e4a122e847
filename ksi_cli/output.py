"""How the CLI shows things: JSON when piped or asked, readable text on a terminal."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from ksi_common.errors import ErrorCode, KsiError

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3


def wants_json(flag: bool) -> bool:
    return flag or not sys.stdout.isatty()


def show(data: Any, as_json: bool) -> None:
    if wants_json(as_json):
        click.echo(json.dumps(data, ensure_ascii=False, default=str))
        return
    if isinstance(data, dict) and isinstance(data.get("content"), str):
        click.echo(data["content"])
        rest = {k: v for k, v in data.items() if k != "content"}
        click.secho(json.dumps(rest, indent=2, ensure_ascii=False, default=str), dim=True)
        return
    click.echo(json.dumps(data, indent=2, ensure_ascii=False, default=str))


def fail(error: KsiError, as_json: bool) -> None:
    """Print an error reply and exit: 3 when the daemon is unreachable, else 1."""
    unreachable = error.code == ErrorCode.DAEMON_UNREACHABLE
    if wants_json(as_json):
        click.echo(json.dumps({"error": error.to_wire()}, ensure_ascii=False, default=str))
    else:
        click.secho(f"error [{error.code}]: {error.message}", fg="red", err=True)
        if error.details:
            click.echo(json.dumps(error.details, indent=2, ensure_ascii=False, default=str), err=True)
    if unreachable:
        click.echo("Is the daemon running? Start it with: ksi daemon start", err=True)
    sys.exit(EXIT_UNREACHABLE if unreachable else EXIT_ERROR)


def table(rows: list[dict[str, Any]], columns: list[str], title: str | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    grid = Table(title=title)
    for column in columns:
        grid.add_column(column)
    for row in rows:
        grid.add_row(*("" if row.get(c) is None else str(row.get(c)) for c in columns))
    Console().print(grid)
