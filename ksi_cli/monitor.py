"""`ksi monitor`: the daemon's events as they happen, filtered, readable on a terminal.

JSON lines when piped. The subscription follows the daemon across restarts: when the
connection drops, the monitor says so and subscribes again once the daemon answers.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import click

from ksi_cli.options import json_option, location_options
from ksi_cli.output import EXIT_OK, EXIT_UNREACHABLE, dumps, report_error, wants_json
from ksi_common.errors import ErrorCode, KsiError
from ksi_common.events import MONITOR_SUBSCRIBE
from ksi_common.locate import Location, locate

RETRY_SECONDS = 0.5
COLORS = {"completion": "cyan", "agent": "green", "conversation": "blue", "consortium": "magenta",
          "system": "yellow"}
SHOWN_FIELDS = ("request_id", "conversation_id", "agent_id", "model", "code", "status", "index", "text", "content",
                "message")


def matches(frame: dict[str, Any], agent: str | None, conversation: str | None) -> bool:
    """Keep an event when it concerns the agent and conversation asked for (by data or context)."""
    data, context = frame.get("data") or {}, frame.get("context") or {}
    if agent is not None and agent not in (data.get("agent_id"), context.get("agent_id")):
        return False
    return conversation is None or data.get("conversation_id") == conversation


def readable(frame: dict[str, Any]) -> str:
    """One line: time, event, then the fields people look for, long text shortened."""
    event = str(frame.get("event"))
    stamp = str(frame.get("timestamp") or "")[11:23]
    data = frame.get("data") or {}
    parts = []
    for key in SHOWN_FIELDS:
        if key in data and data[key] is not None:
            value = data[key] if isinstance(data[key], str) else dumps(data[key])
            value = value.replace("\n", " ")
            parts.append(f"{key}={value[:77] + '...' if len(value) > 80 else value}")
    color = COLORS.get(event.split(":", 1)[0])
    if event.endswith((":error", ":denied")) or "code" in data:
        color = "red"
    return f"{click.style(stamp, dim=True)} {click.style(event.ljust(24), fg=color, bold=True)} {' '.join(parts)}"


async def _watch(location: Location, patterns: list[str], agent: str | None, conversation: str | None,
                 as_json: bool) -> int:
    import asyncio

    from ksi_common.client import KsiClient

    announced_loss = False
    while True:
        client = KsiClient(location.socket)
        try:
            await client.connect()
            await client.request(MONITOR_SUBSCRIBE, {"patterns": patterns})
        except KsiError as error:
            await client.close()
            if error.code != ErrorCode.DAEMON_UNREACHABLE:
                report_error(error, as_json, location)
                return 1
            if not announced_loss:
                report_error(error, as_json, location)
                click.echo("waiting for the daemon (Ctrl-C stops)...", err=True)
                announced_loss = True
            await asyncio.sleep(RETRY_SECONDS)
            continue
        if announced_loss:
            click.echo(f"monitoring {', '.join(patterns)} on {location.socket}", err=True)
        announced_loss = False
        try:
            async for frame in client.pushes():
                if not matches(frame, agent, conversation):
                    continue
                click.echo(dumps(frame) if wants_json(as_json) else readable(frame))
                sys.stdout.flush()
        finally:
            await client.close()
        click.echo(f"connection to the daemon lost at {time.strftime('%H:%M:%S')}; reconnecting", err=True)
        announced_loss = True


@click.command()
@location_options
@json_option
@click.option("--namespace", "-n", "namespaces", multiple=True, help="Only events of this namespace (repeatable).")
@click.option("--event", "-e", "events", multiple=True, help="Only this exact event (repeatable).")
@click.option("--agent", help="Only events of this agent.")
@click.option("--conversation", help="Only events of this conversation.")
def monitor(namespaces: tuple[str, ...], events: tuple[str, ...], agent: str | None, conversation: str | None,
            as_json: bool, var_dir: str | None, socket_path: str | None) -> None:
    """Show the daemon's events live: one line each on a terminal, JSON lines when piped."""
    import asyncio

    patterns = [f"{n.rstrip(':*')}:*" for n in namespaces] + list(events) or ["*"]
    location = locate(var_dir, socket_path)
    try:
        code = asyncio.run(_watch(location, patterns, agent, conversation, as_json))
    except KeyboardInterrupt:
        code = EXIT_OK
    sys.exit(code if code != 3 else EXIT_UNREACHABLE)
