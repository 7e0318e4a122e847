"""`ksi cluster`: the daemons serving the same storage, as the running daemon last saw them."""

from __future__ import annotations

from typing import Any

import click

from ksi_cli.options import VAR_DIR_HELP
from ksi_cli.output import fail, show, table, wants_json
from ksi_common import oneshot
from ksi_common.errors import KsiError
from ksi_common.events import SYSTEM_CLUSTER
from ksi_common.locate import locate

COLUMNS = ["daemon_id", "host", "pid", "version", "started", "heartbeat", "in_flight", "queued", "leases", "state"]


def rows(reply: dict[str, Any]) -> list[dict[str, Any]]:
    """Each daemon as a table row: its heartbeat age in seconds, this daemon's state marked."""
    return [{**daemon, "started": str(daemon["started"])[:19] + "Z", "heartbeat": f"{daemon['heartbeat_age']:.1f} s ago",
             "state": f"{daemon['state']} (this)" if daemon.get("this") else daemon["state"]}
            for daemon in reply.get("daemons", [])]


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON even on a terminal.")
@click.option("--var-dir", help=VAR_DIR_HELP)
@click.option("--socket", "socket_path", help="Unix socket of the daemon.")
def cluster(as_json: bool, var_dir: str | None, socket_path: str | None) -> None:
    """List the daemons serving this storage: host, pid, load, leases held, last heartbeat, alive or stale."""
    location = locate(var_dir, socket_path)
    try:
        reply = oneshot.request(location.socket, SYSTEM_CLUSTER, {}, timeout=10.0)
    except KsiError as error:
        fail(error, as_json, location)
    if wants_json(as_json):
        show(reply, True)
        return
    daemons = reply.get("daemons", [])
    stale = sum(1 for daemon in daemons if daemon["state"] == "stale")
    title = f"{len(daemons)} daemon{'s' if len(daemons) != 1 else ''}" + (f", {stale} stale" if stale else "")
    table(rows(reply), COLUMNS, title=title, whole=("daemon_id",))
    if reply.get("error"):
        click.secho(f"the last heartbeat failed: {reply['error']}", fg="yellow", err=True)
