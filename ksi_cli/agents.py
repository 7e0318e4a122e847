"""`ksi agents`: the daemon's agents as a table (JSON when piped or with --json)."""

from __future__ import annotations

from typing import Any

import click

from ksi_cli.options import VAR_DIR_HELP
from ksi_cli.locate import locate
from ksi_cli.output import fail, show, table, wants_json
from ksi_common import oneshot
from ksi_common.errors import KsiError

COLUMNS = ["agent_id", "profile", "model", "status", "exchanges", "last_activity"]


@click.command()
@click.option("--status", type=click.Choice(["active", "terminated"]), help="Only agents in this status.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON even on a terminal.")
@click.option("--var-dir", help=VAR_DIR_HELP)
@click.option("--socket", "socket_path", help="Unix socket of the daemon.")
def agents(status: str | None, as_json: bool, var_dir: str | None, socket_path: str | None) -> None:
    """List agents: id, profile, model, status, exchanges and last activity."""
    data: dict[str, Any] = {"status": status} if status else {}
    try:
        reply = oneshot.request(locate(var_dir, socket_path).socket, "agent:list", data, timeout=30.0)
    except KsiError as error:
        fail(error, as_json)
        return
    if wants_json(as_json):
        show(reply, True)
        return
    if not reply["agents"]:
        click.echo("no agents" + (f" with status {status}" if status else "") + "; start one with: ksi chat --profile assistant")
        return
    table(reply["agents"], COLUMNS, title=f"{reply['count']} agent{'s' if reply['count'] != 1 else ''}")
