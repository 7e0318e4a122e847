"""`ksi http ...`: what a client of the daemon's HTTP front needs to know."""

from __future__ import annotations

import click

from ksi_cli.locate import _setting, locate
from ksi_common import http_token


@click.group()
def http() -> None:
    """The daemon's HTTP front (OpenAI-compatible API, MCP, console)."""


@http.command()
@click.option("--var-dir", help="The daemon's var directory (default ./var).")
def token(var_dir: str | None) -> None:
    """Print the bearer token for HTTP requests (KSI_HTTP_TOKEN, else the one generated in the var dir)."""
    explicit = _setting("KSI_HTTP_TOKEN")
    click.echo(explicit or http_token.load_or_create(locate(var_dir).layout))
