"""`ksi`: talk to the daemon, manage it, and inspect what it wrote."""

from __future__ import annotations

import importlib
import json
import os
import sys
from typing import Any

import click

from ksi_cli.event_args import EventArgsError, check_payload, parse_event_args
from ksi_cli.params import Seconds
from ksi_common.limits import MAX_TIMEOUT
from ksi_cli.locate import Location, locate
from ksi_cli.output import EXIT_ERROR, EXIT_OK, EXIT_UNREACHABLE, EXIT_USAGE, fail, show
from ksi_common import __version__, oneshot
from ksi_common.errors import KsiError

WAITABLE = {"completion:async", "agent:send_message"}


def location_options(command: Any) -> Any:
    command = click.option("--socket", "socket_path", help="Unix socket of the daemon.")(command)
    command = click.option("--var-dir", help="The daemon's var directory (default ./var).")(command)
    return command


def json_option(command: Any) -> Any:
    return click.option("--json", "as_json", is_flag=True, help="Print JSON even on a terminal.")(command)


class LazyGroup(click.Group):
    """Commands defined in other modules are imported only when used or listed.

    `ksi send` pays for its own imports only, not for inspection, doctor, chat or agents
    (together they tripled its start-up). A command added in another module goes in LAZY."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *LAZY})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        command = super().get_command(ctx, cmd_name)
        if command is None and cmd_name in LAZY:
            module, attribute = LAZY[cmd_name]
            command = getattr(importlib.import_module(module), attribute)
            self.add_command(command, cmd_name)
        return command


# command name -> (module, attribute)
LAZY: dict[str, tuple[str, str]] = {
    "ask": ("ksi_cli.ask", "ask"),
    "chat": ("ksi_cli.chat", "chat"),
    "agents": ("ksi_cli.agents", "agents"),
    "doctor": ("ksi_cli.doctor", "doctor"),
    "conversations": ("ksi_cli.inspect_commands", "conversations"),
    "conversation": ("ksi_cli.inspect_commands", "conversation"),
    "response": ("ksi_cli.inspect_commands", "response"),
    "logs": ("ksi_cli.inspect_commands", "logs"),
    "http": ("ksi_cli.http_commands", "http"),
    "mcp": ("ksi_cli.mcp_command", "mcp"),
}


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ksi")
def cli() -> None:
    """KSI: a local daemon for LLM agents whose conversations continue by id."""


def request_or_exit(location: Location, event: str, data: dict[str, Any], as_json: bool,
                    timeout: float | None = None) -> dict[str, Any]:
    try:
        return oneshot.request(location.socket, event, data, timeout=timeout)
    except KsiError as error:
        fail(error, as_json)
        raise  # unreachable: fail() exits


def _refused(message: str) -> Any:
    raise click.UsageError(message)


@cli.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@location_options
@json_option
@click.option("--data", "data_json", help="The whole payload as a JSON object.")
@click.option("--wait", is_flag=True, help="For completion:async / agent:send_message: wait for the result.")
@click.option("--timeout", type=Seconds(MAX_TIMEOUT), default=300.0, show_default=True,
              help="Seconds to wait for a reply.")
@click.argument("event")
@click.argument("words", nargs=-1, type=click.UNPROCESSED)
def send(event: str, words: tuple[str, ...], data_json: str | None, wait: bool, timeout: float,
         as_json: bool, var_dir: str | None, socket_path: str | None) -> None:
    """Send EVENT with data given as --key value pairs (values parse as JSON when they can)."""
    data: dict[str, Any] = {}
    if data_json:
        try:
            data = json.loads(data_json, parse_constant=lambda name: _refused(f"--data: {name} is not a number JSON can carry"))
        except ValueError as exc:
            raise click.UsageError(f"--data is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise click.UsageError("--data must be a JSON object")
    try:
        check_payload(data)
        data.update(parse_event_args(list(words)))
    except EventArgsError as exc:
        raise click.UsageError(str(exc)) from None
    location = locate(var_dir, socket_path)
    if wait and event == "agent:send_message":
        data.setdefault("wait", timeout)
    reply = request_or_exit(location, event, data, as_json, timeout=timeout + 5)
    if wait and event == "completion:async" and "request_id" in reply:
        reply = request_or_exit(location, "completion:wait",
                                {"request_id": reply["request_id"], "timeout": timeout},
                                as_json, timeout=timeout + 5)
    show(reply, as_json)


@cli.command()
@location_options
@json_option
@click.argument("namespace", required=False)
def discover(namespace: str | None, as_json: bool, var_dir: str | None, socket_path: str | None) -> None:
    """List the daemon's events, optionally of one NAMESPACE."""
    data = {"namespace": namespace} if namespace else {}
    reply = request_or_exit(locate(var_dir, socket_path), "system:discover", data, as_json)
    if as_json or not sys.stdout.isatty():
        show(reply, as_json)
        return
    width = max((len(name) for name in reply["events"]), default=0)
    for name, description in reply["events"].items():
        click.echo(f"{click.style(name.ljust(width), bold=True)}  {description}")


@cli.command(name="help")
@location_options
@json_option
@click.argument("event")
def help_event(event: str, as_json: bool, var_dir: str | None, socket_path: str | None) -> None:
    """Describe EVENT: its fields, their types, defaults and whether they are required."""
    reply = request_or_exit(locate(var_dir, socket_path), "system:help", {"event": event}, as_json)
    if as_json or not sys.stdout.isatty():
        show(reply, as_json)
        return
    click.secho(reply["event"], bold=True)
    click.echo(f"  {reply['description']}")
    for name, field in reply["fields"].items():
        need = "required" if field["required"] else f"default {json.dumps(field.get('default'))}"
        click.echo(f"  --{name.replace('_', '-')} ({field['type']}, {need}) {field['description']}")


@cli.command()
@json_option
def config(as_json: bool) -> None:
    """Show the effective settings (environment, .env and defaults), secrets masked."""
    from ksi_common.settings import Settings

    show(Settings().public_view(), as_json)


@cli.group()
def daemon() -> None:
    """Start, stop and query the background daemon."""


def http_option(command: Any) -> Any:
    return click.option("--http", "http_addr", metavar="[HOST:]PORT",
                        help="Also serve the HTTP front (OpenAI-compatible API) here; default KSI_HTTP_ADDR.")(command)


@daemon.command()
@location_options
@http_option
def start(var_dir: str | None, socket_path: str | None, http_addr: str | None) -> None:
    """Start the daemon in the background; returns once its socket answers."""
    from ksi_cli import daemon_control  # imported here: `ksi send` does not need it
    try:
        _pid, message = daemon_control.start(locate(var_dir, socket_path), http_addr=http_addr)
    except RuntimeError as exc:
        click.secho(f"error: {exc}", fg="red", err=True)
        sys.exit(EXIT_ERROR)
    click.echo(message)


@daemon.command()
@location_options
@click.option("--timeout", type=Seconds(MAX_TIMEOUT), default=15.0, show_default=True,
              help="Grace period before SIGTERM.")
def stop(var_dir: str | None, socket_path: str | None, timeout: float) -> None:
    """Stop the daemon gracefully (SIGTERM after the timeout)."""
    from ksi_cli import daemon_control  # imported here: `ksi send` does not need it
    click.echo(daemon_control.stop(locate(var_dir, socket_path), timeout))


@daemon.command()
@location_options
def restart(var_dir: str | None, socket_path: str | None) -> None:
    """Stop the daemon if it runs, then start it."""
    from ksi_cli import daemon_control  # imported here: `ksi send` does not need it
    location = locate(var_dir, socket_path)
    click.echo(daemon_control.stop(location))
    try:
        _pid, message = daemon_control.start(location)
    except RuntimeError as exc:
        click.secho(f"error: {exc}", fg="red", err=True)
        sys.exit(EXIT_ERROR)
    click.echo(message)


@daemon.command()
@location_options
@json_option
def status(var_dir: str | None, socket_path: str | None, as_json: bool) -> None:
    """Exit 0 and show health when the daemon answers, exit 3 when it does not."""
    from ksi_cli import daemon_control  # imported here: `ksi send` does not need it
    info = daemon_control.health(locate(var_dir, socket_path))
    if info is None:
        click.echo("daemon is not running", err=True)
        sys.exit(EXIT_UNREACHABLE)
    show(info, as_json)


@daemon.command()
@location_options
@http_option
def run(var_dir: str | None, socket_path: str | None, http_addr: str | None) -> None:
    """Run the daemon in the foreground (Ctrl-C stops it)."""
    location = locate(var_dir, socket_path)
    extra = ["--http", http_addr] if http_addr else []
    os.execv(sys.executable, [sys.executable, "-m", "ksi_daemon",
                              "--var-dir", str(location.var_dir), "--socket", str(location.socket), *extra])



def main() -> None:
    try:
        cli.main(standalone_mode=False)
    except click.UsageError as exc:
        exc.show()
        sys.exit(EXIT_USAGE)
    except click.ClickException as exc:
        exc.show()
        sys.exit(EXIT_ERROR)
    except click.Abort:
        sys.exit(EXIT_ERROR)
    sys.exit(EXIT_OK)
