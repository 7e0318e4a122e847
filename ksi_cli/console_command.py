"""`ksi console`: a one-time link that logs a browser into the daemon's web console, opened when it can be.

The link holds a login code signed by the token, never the token: the browser's command line
and history see a code that works once and only for a minute."""

from __future__ import annotations

import sys
import webbrowser
from urllib.parse import quote

import click

from ksi_cli.http_access import front_access
from ksi_cli.options import VAR_DIR_HELP
from ksi_cli.output import EXIT_ERROR, fail
from ksi_common.console_login import make_code
from ksi_common.errors import KsiError
from ksi_common.locate import locate


@click.command()
@click.option("--socket", "socket_path", help="Unix socket of the daemon.")
@click.option("--var-dir", help=VAR_DIR_HELP)
@click.option("--no-browser", is_flag=True, help="Only print the login link (it works once, within a minute).")
def console(socket_path: str | None, var_dir: str | None, no_browser: bool) -> None:
    """Print a one-time login link to the console and open it in the system's browser (on a terminal)."""
    location = locate(var_dir, socket_path)
    try:
        access = front_access(location, need_daemon=True)
    except KsiError as error:
        fail(error, False, location)
    if access.url is None:
        click.echo("the daemon does not serve HTTP: start it with `ksi daemon start --http 127.0.0.1:8780` "
                   "(or set KSI_HTTP_ADDR)", err=True)
        sys.exit(EXIT_ERROR)
    url = f"{access.url}/login?code={quote(make_code(access.token), safe='')}"
    click.echo(url)
    if not no_browser and sys.stdout.isatty() and webbrowser.open(url):
        click.echo("opened in the system's browser", err=True)
