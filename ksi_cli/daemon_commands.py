"""`ksi daemon start|stop|restart|status|run`."""

from __future__ import annotations

import os
import sys
from typing import Any, NoReturn

import click

from ksi_cli.locate import Location, locate
from ksi_cli.options import json_option, location_options
from ksi_cli.params import Seconds
from ksi_common.limits import MAX_TIMEOUT
from ksi_cli.output import EXIT_ERROR, EXIT_UNREACHABLE, EXIT_USAGE, show, wants_json


@click.group()
def daemon() -> None:
    """Start, stop and query the background daemon."""


def http_option(command: Any) -> Any:
    return click.option("--http", "http_addr", metavar="[HOST:]PORT",
                        help="Also serve the HTTP front (OpenAI-compatible API) here; default KSI_HTTP_ADDR.")(command)


def _fail(message: str, code: int) -> NoReturn:
    click.secho(f"error: {message}", fg="red", err=True)
    sys.exit(code)


def _wanted(location: Location, http_addr: str | None, running_pid: Any) -> dict[str, Any]:
    """The settings a start here would use; exit 2 naming each variable when one does not fit."""
    from ksi_cli.daemon_settings import wanted_settings
    from ksi_common.errors import KsiError

    try:
        return wanted_settings(location.var_dir, location.socket, http_addr)
    except KsiError as invalid:
        kept = f"; the running daemon (pid {running_pid}) was left as it is" if running_pid else ""
        _fail(f"{invalid.message}{kept}", EXIT_USAGE)


def _restart_hint(http_addr: str | None) -> str:
    return "ksi daemon restart" + (f" --http {http_addr}" if http_addr else "")


def _start(location: Location, http_addr: str | None) -> None:
    from ksi_cli import daemon_control  # imported here: `ksi send` does not need it
    from ksi_cli.daemon_settings import describe, differences

    running = daemon_control.running_config(location)
    if running is not None:
        pid = (daemon_control.health(location) or {}).get("pid")
        changed = differences(running, _wanted(location, http_addr, pid))
        if changed:  # "already running" would hide that these settings are not in effect
            _fail(f"the daemon on {location.socket} (pid {pid}) runs with other settings than this start "
                  f"would use:\n{describe(changed)}\nrun `{_restart_hint(http_addr)}` to apply them "
                  "(it checks them before it stops the running daemon)", EXIT_ERROR)
    try:
        _pid, message = daemon_control.start(location, http_addr=http_addr)
    except daemon_control.StartFailed as exc:
        _fail(str(exc), exc.exit_code)
    click.echo(message)


@daemon.command()
@location_options
@http_option
def start(var_dir: str | None, socket_path: str | None, http_addr: str | None) -> None:
    """Start the daemon in the background; returns once its socket answers.

    When this var dir's daemon already runs with the settings this start would use, say so and
    exit 0; with other settings, name them and exit 1 (`ksi daemon restart` applies them).
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
    """Check the new settings, HTTP address and database, then stop the daemon if it runs and start it.

    Settings that do not fit, an address another program holds or a database that cannot be
    opened leave the running daemon as it is (exit 2).
    """
    from ksi_cli import daemon_control
    from ksi_cli.daemon_settings import database_unreachable, http_unavailable
    location = locate(var_dir, socket_path)
    running = daemon_control.running_config(location)
    pid = (daemon_control.health(location) or {}).get("pid") if running is not None else None
    wanted = _wanted(location, http_addr, pid)
    problem = (http_unavailable(wanted.get("http_addr"), (running or {}).get("http_addr"))
               or database_unreachable(location.var_dir, location.socket, http_addr))
    if problem is not None:
        kept = f"; the running daemon (pid {pid}) was left as it is" if pid else ""
        _fail(problem + kept, EXIT_USAGE)
    click.echo(daemon_control.stop(location))
    try:
        _pid, message = daemon_control.start(location, http_addr=http_addr)
    except daemon_control.StartFailed as exc:
        _fail(f"{exc} (the previous daemon was stopped)", exc.exit_code)
    click.echo(message)


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
