"""`ksi agents`: the daemon's agents as a table (JSON when piped or with --json)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from ksi_cli.options import VAR_DIR_HELP
from ksi_cli.locate import locate
from ksi_cli.output import fail, show, table, wants_json
from ksi_common import oneshot
from ksi_common.errors import ErrorCode, KsiError
from ksi_common.layout import VarLayout

COLUMNS = ["agent_id", "profile", "model", "status", "exchanges", "last_activity"]


def _json_file(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def agents_on_disk(layout: VarLayout, status: str | None) -> dict[str, Any]:
    """What agent:list answers, read from the agents' records and their conversations' metadata."""
    found = []
    for path in sorted(layout.agents_dir.glob("*.json")) if layout.agents_dir.is_dir() else []:
        record = _json_file(path)
        if record is None or "agent_id" not in record or (status and record.get("status") != status):
            continue
        meta = _json_file(layout.meta_file(str(record.get("conversation_id")))) or {}
        found.append({key: record.get(key) for key in ("agent_id", "profile", "model", "status", "conversation_id",
                                                       "created", "last_activity")}
                     | {"exchanges": meta.get("exchanges", 0)})
    found.sort(key=lambda agent: str(agent.get("created")))
    return {"agents": found, "count": len(found)}


@click.command()
@click.option("--status", type=click.Choice(["active", "terminated"]), help="Only agents in this status.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON even on a terminal.")
@click.option("--var-dir", help=VAR_DIR_HELP)
@click.option("--socket", "socket_path", help="Unix socket of the daemon.")
def agents(status: str | None, as_json: bool, var_dir: str | None, socket_path: str | None) -> None:
    """List agents: id, profile, model, status, exchanges and last activity."""
    data: dict[str, Any] = {"status": status} if status else {}
    location = locate(var_dir, socket_path)
    try:
        reply = oneshot.request(location.socket, "agent:list", data, timeout=30.0)
    except KsiError as error:
        if error.code != ErrorCode.DAEMON_UNREACHABLE:
            fail(error, as_json, location)
        # inspection works with the daemon stopped: the agents' records are files under var/state
        reply = agents_on_disk(location.layout, status)
        click.echo(f"daemon not running; agents read from {location.describe()}", err=True)
    if wants_json(as_json):
        show(reply, True)
        return
    if not reply["agents"]:
        click.echo("no agents" + (f" with status {status}" if status else "") + "; start one with: ksi chat --profile assistant")
        return
    table(reply["agents"], COLUMNS, title=f"{reply['count']} agent{'s' if reply['count'] != 1 else ''}")
