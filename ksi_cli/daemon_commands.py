"""`ksi daemon start|stop|restart|status|run`."""

from __future__ import annotations

import os
import sys
from typing import Any

import click

from ksi_cli.locate import Location, locate
from ksi_cli.options import json_option, location_options
from ksi_cli.params import Seconds
from ksi_common.limits import MAX_TIMEOUT
from ksi_cli.output import EXIT_ERROR, EXIT_UNREACHABLE, show, wants_json


@click.group()
def daemon() -> None:
    """Start, stop and query the background daemon."""


def http_option(command: Any) -> Any:
    return click.option("--http", "http_addr", metavar="[HOST:]PORT",
                        help="Also serve the HTTP front (OpenAI-compatible API) here; default KSI_HTTP_ADDR.")(command)


def _start(location: Location, http_addr: str | None) -> None:
    from ksi_cli import daemon_control  # imported here: `ksi send` does not need it
    try:
        _pid, message = daemon_control.start(location, http_addr=http_addr)
    except RuntimeError as exc:
        click.secho(f"error: {exc}", fg="red", err=True)
        sys.exit(EXIT_ERROR)
    click.echo(message)


@daemon.command()
@location_options
@http_option
def start(var_dir: str | None, socket_path: str | None, http_addr: str | None) -> None:
    """Start the daemon in the background; returns once its socket answers.

    When this var dir's daemon already runs, say so and exit 0.
    """
    _start(locate(var_dir, socket_path), http_addr)


@daemon.command()
@location_options
@click.option("--timeout", type=Seconds(MAX_TIMEOUT), default=15.0, show_default=True,
              help="Grace period before SIGTERM.")
def stop(var_dir: str | None, socket_path: str | None, timeout: float) -> None:
    """Stop the daemon gracefully (SIGTERM after the timeout)."""
    from ksi_cli import daemon_control
    click.echo(daemon_control.stop(locate(var_dir, socket_path), timeout))


@daemon.command()
@location_options
@http_option
def restart(var_dir: str | None, socket_path: str | None, http_addr: str | None) -> None:
    """Stop the daemon if it runs, then start it."""
    from ksi_cli import daemon_control
    location = locate(var_dir, socket_path)
    click.echo(daemon_control.stop(location))
    _start(location, http_addr)


@daemon.command()
@location_options
@json_option
def status(var_dir: str | None, socket_path: str | None, as_json: bool) -> None:
    """Exit 0 and show health when the daemon answers, exit 3 when it does not; names the var dir."""
    from ksi_cli import daemon_control
    location = locate(var_dir, socket_path)
    info = daemon_control.health(location)
    if info is None:
        click.echo(f"daemon is not running: nothing answers at {location.socket}\n"
                   f"var dir: {location.describe()}", err=True)
        sys.exit(EXIT_UNREACHABLE)
    info.setdefault("var_dir", str(location.var_dir))
    info["var_dir_found_by"] = location.found_by
    info["socket"] = str(location.socket)
    if wants_json(as_json):
        show(info, True)
        return
    click.secho(f"daemon running (pid {info['pid']}, version {info.get('version')}, up {info.get('uptime')}s)",
                bold=True)
    click.echo(f"var dir: {info['var_dir']} ({location.found_by})\nsocket:  {location.socket}")
    rest = {k: v for k, v in info.items() if k not in ("pid", "version", "uptime", "var_dir", "var_dir_found_by",
                                                          "socket", "status")}
    show(rest, False)


@daemon.command()
@location_options
@http_option
def run(var_dir: str | None, socket_path: str | None, http_addr: str | None) -> None:
    """Run the daemon in the foreground (Ctrl-C stops it)."""
    from ksi_common.layout import mark_var_dir
    location = locate(var_dir, socket_path)
    mark_var_dir(location.var_dir)
    extra = ["--http", http_addr] if http_addr else []
    os.execv(sys.executable, [sys.executable, "-m", "ksi_daemon",
                              "--var-dir", str(location.var_dir), "--socket", str(location.socket), *extra])
