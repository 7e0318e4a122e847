"""`ksi daemon start|stop|restart|status|run`."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any, NoReturn

import click

from ksi_cli.options import json_option, location_options
from ksi_cli.output import EXIT_ERROR, EXIT_UNREACHABLE, EXIT_USAGE, show, wants_json
from ksi_cli.params import Seconds
from ksi_common.limits import MAX_TIMEOUT
from ksi_common.locate import Location, locate

if TYPE_CHECKING:
    from ksi_common.kept_settings import KeptSettings
    from ksi_common.settings import Settings


@click.group()
def daemon() -> None:
    """Start, stop and query the background daemon."""


def http_option(command: Any) -> Any:
    return click.option("--http", "http_addr", metavar="[HOST:]PORT",
                        help="Also serve the HTTP front (OpenAI-compatible API) here; default KSI_HTTP_ADDR.")(command)


def _fail(message: str, code: int) -> NoReturn:
    click.secho(f"error: {message}", fg="red", err=True)
    sys.exit(code)


def _here(location: Location, http_addr: str | None, running_pid: Any,
          kept: dict[str, Any] | None = None) -> Settings:
    """The settings a start here would use; exit 2 naming each variable when one does not fit."""
    from ksi_cli.daemon_settings import settings_here
    from ksi_common.errors import KsiError

    try:
        return settings_here(location.var_dir, location.socket, http_addr, kept)
    except KsiError as invalid:
        kept_said = f"; the running daemon (pid {running_pid}) was left as it is" if running_pid else ""
        _fail(f"{invalid.code}: {invalid.message}{kept_said}", EXIT_USAGE)


def _restart_hint(http_addr: str | None) -> str:
    return "ksi daemon restart" + (f" --http {http_addr}" if http_addr else "")


def _start(location: Location, http_addr: str | None) -> None:
    from ksi_cli import daemon_control  # imported here: `ksi send` does not need it
    from ksi_cli.daemon_settings import asked_for, describe, differences, file_changes

    running = daemon_control.running_config(location)
    pending: list[str] = []
    if running is not None:
        pid = (daemon_control.health(location) or {}).get("pid")
        here = _here(location, http_addr, pid)
        changed = differences(running, here.public_view(), only=asked_for(here))
        if changed:  # "already running" would hide that these settings are not in effect
            _fail(f"the daemon (pid {pid}) already runs, with other settings than this start asks for:\n"
                  f"{describe(changed)}\napply them with: {_restart_hint(http_addr)}", EXIT_ERROR)
        pending = file_changes(running, daemon_control.running_origins(location), here)
    try:
        _pid, message = daemon_control.start(location, http_addr=http_addr)
    except daemon_control.StartFailed as exc:
        _fail(str(exc), exc.exit_code)
    click.echo(message)
    if pending:
        click.echo(f"note: the configuration file changed {', '.join(pending)} since the daemon started; "
                   "`ksi daemon restart` applies it")


@daemon.command()
@location_options
@http_option
def start(var_dir: str | None, socket_path: str | None, http_addr: str | None) -> None:
    """Start the daemon in the background; returns once its socket answers.

    When this var dir's daemon already runs, say so and exit 0; when this start asks (by a flag,
    a KSI_* variable or .env) for settings other than the running ones, name each and exit 1
    (`ksi daemon restart` applies them).
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
@click.option("--reset", is_flag=True, help="Drop the running daemon's settings: start from the configuration "
                                            "file, this shell's KSI_* variables and the flags only.")
def restart(var_dir: str | None, socket_path: str | None, http_addr: str | None, reset: bool) -> None:
    """Restart the daemon with the settings it runs with, under what this command gives anew (a
    flag, a KSI_* variable, .env) and the configuration file's changes; say what changed.

    The new settings, the HTTP address and the database are checked first: what does not fit
    leaves the running daemon as it is (exit 2).
    """
    from ksi_cli import daemon_control
    from ksi_cli.daemon_settings import differences, one_line
    from ksi_common.kept_settings import KeptSettings, read_kept

    location = locate(var_dir, socket_path)
    running = daemon_control.running_config(location)
    pid = (daemon_control.health(location) or {}).get("pid") if running is not None else None
    keep = running is not None and not reset
    kept = read_kept(location.layout.kept_settings_file) if keep else KeptSettings()
    here = _here(location, http_addr, pid, kept.values)
    problem = _cannot_restart(here, kept, running)
    if problem is not None:
        _fail(problem + (f"; the running daemon (pid {pid}) was left as it is" if pid else ""), EXIT_USAGE)
    click.echo(daemon_control.stop(location))
    try:
        _pid, message = daemon_control.start(location, http_addr=http_addr, keep_settings=keep)
    except daemon_control.StartFailed as exc:
        _fail(f"{exc} (the previous daemon was stopped)", exc.exit_code)
    click.echo(message)
    if running is not None:
        now = daemon_control.running_config(location) or {}
        click.echo(one_line(differences(running, now, any_front=False)))


def _cannot_restart(here: Settings, kept: KeptSettings, running: dict[str, Any] | None) -> str | None:
    """Why a restart onto `here` must not stop the running daemon, or None."""
    from ksi_cli.daemon_settings import database_unreachable, http_unavailable, missing_secrets

    if missing := missing_secrets(here, kept.secrets):
        names = ", ".join(missing)
        return (f"the running daemon was given {names} at its start, and KSI keeps no secret on disk by itself: "
                f"give it again in this shell's environment, or keep it in the configuration file "
                f"(`ksi config set {missing[0].removeprefix('KSI_').lower()} -`, owner-only), "
                f"or drop it with `ksi daemon restart --reset`")
    return (http_unavailable(here.http_addr, (running or {}).get("http_addr"))
            or database_unreachable(here))


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
