"""`ksi send`, `ksi discover`, `ksi help`: any event of the daemon from the shell."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from ksi_cli import completion
from ksi_cli.event_args import EventArgsError, check_payload, event_words, json_value
from ksi_cli.options import json_option, location_options
from ksi_cli.output import EXIT_ERROR, EXIT_OK, EXIT_PENDING, fail, show, wants_json
from ksi_cli.params import Seconds
from ksi_common import oneshot
from ksi_common.errors import KsiError
from ksi_common.events import AGENT_SEND_MESSAGE, COMPLETION_ASYNC, SYSTEM_DISCOVER, SYSTEM_HELP
from ksi_common.limits import MAX_TIMEOUT
from ksi_common.locate import Location, locate
from ksi_common.request_status import PENDING

WAITABLE = {COMPLETION_ASYNC, AGENT_SEND_MESSAGE}
# options of `ksi send` also accepted after the event name, unless the event has a field so named
AFTER_EVENT = {"json", "wait", "timeout", "help", "h"}


def request_or_exit(location: Location, event: str, data: dict[str, Any], as_json: bool,
                    timeout: float | None = None) -> dict[str, Any]:
    try:
        return oneshot.request(location.socket, event, data, timeout=timeout)
    except KsiError as error:
        fail(error, as_json, location)


def wait_or_exit(location: Location, request_id: str, timeout: float, as_json: bool) -> dict[str, Any]:
    """One wait of `timeout` seconds: the request's result, or its status when the wait ended first."""
    from ksi_common.submitting import follow_blocking  # asyncio with it: loaded only to wait

    try:
        with oneshot.Connection(location.socket, timeout=timeout + 5) as connection:
            *_, (_event, reply) = follow_blocking(connection, request_id, timeout, once=True)
            return reply
    except KsiError as error:
        fail(error, as_json, location)


def is_textual(type_text: str) -> bool:
    """A field whose every type is `str`, `None` or a string literal takes the word as written."""
    return all(part in ("str", "None") or part[:1] in "'\"" for part in type_text.split(" | "))


def show_event_help(reply: dict[str, Any], as_json: bool) -> None:
    if wants_json(as_json):
        show(reply, True)
        return
    click.secho(reply["event"], bold=True)
    click.echo(f"  {reply['description']}")
    for name, field in reply["fields"].items():
        need = "required" if field["required"] else f"default {json.dumps(field.get('default'))}"
        click.echo(f"  --{name.replace('_', '-')} ({field['type']}, {need}) {field['description']}")


def _fields(location: Location, event: str) -> dict[str, Any] | None:
    """The event's fields from `system:help`, or None when the daemon does not know it."""
    try:
        return oneshot.request(location.socket, SYSTEM_HELP, {"event": event}, timeout=10.0)["fields"]
    except KsiError:  # unknown event or no daemon: the request itself will say so, words read as JSON
        return None


def _flag(value: str | None, name: str) -> bool:
    if value is None or value.lower() in ("true", "1", "yes"):
        return True
    if value.lower() in ("false", "0", "no"):
        return False
    raise click.UsageError(f"--{name} takes no value (or true/false), not {value!r}")


@click.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@location_options
@json_option
@click.option("--data", "data_json", help="The whole payload as a JSON object.")
@click.option("--wait", is_flag=True, help="For completion:async / agent:send_message: wait for the result.")
@click.option("--timeout", type=Seconds(MAX_TIMEOUT), default=300.0, show_default=True,
              help="Seconds to wait for a reply.")
@click.argument("event", shell_complete=completion.events)
@click.argument("words", nargs=-1, type=click.UNPROCESSED)
def send(event: str, words: tuple[str, ...], data_json: str | None, wait: bool, timeout: float,
         as_json: bool, var_dir: str | None, socket_path: str | None) -> None:
    """Send EVENT with data given as --key value pairs.

    A value is JSON where the event's field is not a string (`--prompt null` is the text
    "null"). --json, --wait, --timeout and --help may also follow EVENT; `ksi send EVENT
    --help` shows the event's fields. Exit 4 when --wait ends before the result.
    """
    data: dict[str, Any] = {}
    if data_json:
        try:
            data = json.loads(data_json, parse_constant=_refused_constant)
        except ValueError as exc:
            raise click.UsageError(f"--data is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise click.UsageError("--data must be a JSON object")
    try:
        check_payload(data)
        pairs = event_words(list(words))
    except EventArgsError as exc:
        raise click.UsageError(str(exc)) from None
    location = locate(var_dir, socket_path)
    # The event's field types are asked for only when a word could be read two ways.
    ambiguous = any(key in AFTER_EVENT or (raw is not None and not _plain_text(raw)) for key, raw in pairs)
    fields = _fields(location, event) if ambiguous else {}
    timeout_given = False
    for key, raw in pairs:
        if key in AFTER_EVENT and (fields is None or key not in fields):
            if key in ("help", "h"):
                show_event_help(request_or_exit(location, SYSTEM_HELP, {"event": event}, as_json), as_json)
                sys.exit(EXIT_OK)
            if key == "json":
                as_json = _flag(raw, key)
            elif key == "wait":
                wait = _flag(raw, key)
            else:
                timeout, timeout_given = _seconds(raw), True
            continue
        if raw is None:
            data[key] = True
        elif fields and key in fields and is_textual(fields[key]["type"]):
            data[key] = raw
        else:
            try:
                data[key] = json_value(raw)
            except EventArgsError as exc:
                raise click.UsageError(str(exc)) from None
        if key == "timeout" and fields and key in fields and isinstance(data[key], int | float):
            timeout, timeout_given = float(data[key]), True  # the event's own timeout bounds the wait too
    if event == AGENT_SEND_MESSAGE:
        if wait:
            data.setdefault("wait", timeout)
        if data.get("wait") is True and timeout_given:
            data["wait"] = timeout  # `--wait --timeout S` after the event: wait that long
        wait = wait or bool(data.get("wait"))
    if event == COMPLETION_ASYNC:
        data.setdefault("origin", "cli")  # recorded on a conversation this request creates
    reply = request_or_exit(location, event, data, as_json, timeout=timeout + 5)
    if wait and event == COMPLETION_ASYNC and "request_id" in reply:
        reply = wait_or_exit(location, reply["request_id"], timeout, as_json)
    show(reply, as_json)
    if wait and event in WAITABLE and reply.get("status") in PENDING and "content" not in reply:
        click.echo(f"the wait ended after {timeout:g}s before the result; request {reply.get('request_id')} is "
                   f"still {reply['status']}. Wait again with: ksi send --wait completion:wait "
                   f"--request-id {reply.get('request_id')}" + ("" if timeout_given else " --timeout 600"), err=True)
        sys.exit(EXIT_PENDING)


def _plain_text(raw: str) -> bool:
    """True when the word means the same as text and as JSON (it does not parse as JSON)."""
    try:
        return isinstance(json_value(raw), str)
    except EventArgsError:
        return False


def _refused_constant(name: str) -> Any:
    raise click.UsageError(f"--data: {name} is not a number JSON can carry")


def _seconds(raw: str | None) -> float:
    try:
        return Seconds(MAX_TIMEOUT).convert(raw or "", None, None)
    except click.BadParameter as exc:
        raise click.UsageError(f"--timeout: {exc.message}") from None


@click.command()
@location_options
@json_option
@click.argument("namespace", required=False)
def discover(namespace: str | None, as_json: bool, var_dir: str | None, socket_path: str | None) -> None:
    """List the daemon's events, optionally of one NAMESPACE."""
    data = {"namespace": namespace} if namespace else {}
    reply = request_or_exit(locate(var_dir, socket_path), SYSTEM_DISCOVER, data, as_json)
    if namespace and not reply["events"]:
        similar = reply.get("similar") or []
        meant = f"; did you mean {' or '.join(similar)}?" if similar else "; `ksi discover` lists them all"
        click.echo(f"no events in the namespace {namespace!r}{meant}", err=True)
        sys.exit(EXIT_ERROR)
    if wants_json(as_json):
        show(reply, as_json)
        return
    width = max((len(name) for name in reply["events"]), default=0)
    for name, description in reply["events"].items():
        click.echo(f"{click.style(name.ljust(width), bold=True)}  {description}")


@click.command(name="help")
@location_options
@json_option
@click.argument("event", shell_complete=completion.events)
def help_event(event: str, as_json: bool, var_dir: str | None, socket_path: str | None) -> None:
    """Describe EVENT: its fields, their types, defaults and whether they are required."""
    show_event_help(request_or_exit(locate(var_dir, socket_path), SYSTEM_HELP, {"event": event}, as_json),
                    as_json)
