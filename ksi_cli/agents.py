"""`ksi agents`: the daemon's agents as a table (JSON when piped or with --json)."""

from __future__ import annotations

from typing import Any

import click

from ksi_cli.options import VAR_DIR_HELP
from ksi_cli.output import fail, show, table, wants_json
from ksi_cli.stored import read_stored
from ksi_common import oneshot
from ksi_common.errors import ErrorCode, KsiError
from ksi_common.events import AGENT_LIST
from ksi_common.locate import locate
from ksi_common.reading import StoredReader

COLUMNS = ["agent_id", "profile", "model", "status", "exchanges", "last_activity"]


async def stored_agents(reader: StoredReader, status: str | None) -> dict[str, Any]:
    """What agent:list answers, from the stored agent records and their conversations' metadata."""
    records = [r for r in await reader.agent_records() if not status or r.get("status") == status]
    metas = await reader.metas([str(r.get("conversation_id")) for r in records])
    found = []
    for record, meta in zip(records, metas, strict=True):
        exchanges = int((meta or {}).get("exchanges") or 0)
        last = str(record.get("last_activity") or "")
        if exchanges and meta and str(meta.get("last_activity") or "") > last:
            last = str(meta["last_activity"])
        found.append({key: record.get(key) for key in ("agent_id", "conversation_id", "profile", "model", "status",
                                                       "created", "spawned_by")}
                     | {"last_activity": last or None, "exchanges": exchanges})
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
        reply = oneshot.request(location.socket, AGENT_LIST, data, timeout=30.0)
    except KsiError as error:
        if error.code != ErrorCode.DAEMON_UNREACHABLE:
            fail(error, as_json, location)
        # inspection works with the daemon stopped: the agents' records are read where the daemon
        # keeps them (files under var/state, or the database with KSI_STORAGE=postgres)
        try:
            reply = read_stored(location, lambda reader: stored_agents(reader, status))
        except KsiError as stored_error:
            fail(stored_error, as_json, location)
        click.echo(f"daemon not running; agents read from {location.describe_storage()}", err=True)
    if wants_json(as_json):
        show(reply, True)
        return
    if not reply["agents"]:
        click.echo("no agents" + (f" with status {status}" if status else "") + "; start one with: ksi chat --profile assistant")
        return
    table(reply["agents"], COLUMNS, title=f"{reply['count']} agent{'s' if reply['count'] != 1 else ''}")
