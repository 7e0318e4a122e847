"""`ksi http ...`: what a client of the daemon's HTTP front needs to know."""

from __future__ import annotations

import click

from ksi_cli.http_access import front_access
from ksi_cli.options import VAR_DIR_HELP
from ksi_cli.output import fail
from ksi_common.errors import KsiError
from ksi_common.locate import locate


@click.group()
def http() -> None:
    """The daemon's HTTP front (OpenAI-compatible API, MCP, console)."""


@http.command()
@click.option("--var-dir", help=VAR_DIR_HELP)
@click.option("--socket", "socket_path", help="Unix socket of the daemon.")
def token(var_dir: str | None, socket_path: str | None) -> None:
    """Print the bearer token for HTTP requests (KSI_HTTP_TOKEN, else the one generated in the var
    dir); when the daemon serves HTTP, only a token it takes."""
    location = locate(var_dir, socket_path)
    try:
        click.echo(front_access(location).token)
    except KsiError as error:
        fail(error, False, location)
