"""`ksi console`: the URL that logs a browser into the daemon's web console, opened when it can be."""

from __future__ import annotations

import sys
import webbrowser
from urllib.parse import quote

import click

from ksi_cli.locate import _setting, locate
from ksi_cli.output import EXIT_ERROR, fail
from ksi_common import http_token, oneshot
from ksi_common.errors import KsiError


@click.command()
@click.option("--socket", "socket_path", help="Unix socket of the daemon.")
@click.option("--var-dir", help="The daemon's var directory (default ./var).")
@click.option("--no-browser", is_flag=True, help="Only print the URL.")
def console(socket_path: str | None, var_dir: str | None, no_browser: bool) -> None:
    """Print the console's login URL and open it in the system's browser (on a terminal)."""
    location = locate(var_dir, socket_path)
    try:
        health = oneshot.request(location.socket, "system:health", {}, timeout=10.0)
    except KsiError as error:
        fail(error, False)
        return
    base = health.get("http")
    if not base:
        click.echo("the daemon does not serve HTTP: start it with `ksi daemon start --http 127.0.0.1:8780` "
                   "(or set KSI_HTTP_ADDR)", err=True)
        sys.exit(EXIT_ERROR)
    token = _setting("KSI_HTTP_TOKEN") or http_token.load_or_create(location.layout)
    # the login link sets a cookie and sends the browser on to the console: the token is needed once
    url = f"{str(base).rstrip('/')}/login?token={quote(token, safe='')}"
    click.echo(url)
    if not no_browser and sys.stdout.isatty() and webbrowser.open(url):
        click.echo("opened in the system's browser", err=True)
