"""`ksi mcp`: KSI as an MCP server on stdin/stdout, for an MCP client to spawn.

A thin client of the daemon's socket; the daemon is started when none answers, as `ksi daemon
start` would. The `mcp` SDK is imported only here, when the command runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import click

from ksi_cli.options import location_options
from ksi_common.locate import Location, locate

if TYPE_CHECKING:
    from ksi_mcp.server import KsiMcp
    from ksi_mcp.socket_caller import SocketCaller


def daemon_starter(location: Location) -> Callable[[], str]:
    """Start the daemon as `ksi daemon start` does; returns the line to show on stderr."""

    def start() -> str:
        from ksi_cli import daemon_control

        _pid, message = daemon_control.start(location)  # raises RuntimeError when it cannot
        return f"ksi mcp: {message}"

    return start


@click.command()
@location_options
@click.option("--no-start", is_flag=True, help="Do not start the daemon when none is running.")
def mcp(var_dir: str | None, socket_path: str | None, no_start: bool) -> None:
    """Serve KSI's conversations, consortia and agents as MCP tools over stdio.

    Register the command `ksi mcp` in an MCP client (see docs/mcp.md). Messages for people go to
    stderr; stdout carries the protocol.
    """
    from ksi_mcp.server import KsiMcp
    from ksi_mcp.socket_caller import SocketCaller

    location = locate(var_dir, socket_path)
    caller = SocketCaller(location.socket, None if no_start else daemon_starter(location),
                          say=lambda text: click.echo(text, err=True))
    try:
        asyncio.run(_serve(KsiMcp(caller, base_dir=Path.cwd()), caller))
    except KeyboardInterrupt:
        pass


async def _serve(app: KsiMcp, caller: SocketCaller) -> None:
    from ksi_mcp.server import serve_stdio

    try:
        await serve_stdio(app)
    finally:
        await caller.close()
