"""`ksi conversation abandon-calls`: give up tool calls a conversation waits for (the daemon's
`conversation:abandon_calls`; the daemon must be running)."""

from __future__ import annotations

import click

from ksi_cli import completion
from ksi_cli.options import json_option, location_options
from ksi_cli.output import show
from ksi_cli.send import request_or_exit
from ksi_common.events import CONVERSATION_ABANDON_CALLS
from ksi_common.locate import locate


@click.command(name="abandon-calls")
@location_options
@json_option
@click.argument("conversation_id", shell_complete=completion.conversations)
@click.option("--call", "call_ids", multiple=True, metavar="ID",
              help="a call to abandon (repeatable); default: every open call")
def abandon_calls(conversation_id: str, call_ids: tuple[str, ...], as_json: bool, var_dir: str | None,
                  socket_path: str | None) -> None:
    """Abandon the open tool calls of CONVERSATION_ID, so its next turn is a plain one."""
    location = locate(var_dir, socket_path)
    data = {"conversation_id": conversation_id, "call_ids": list(call_ids) if call_ids else None}
    show(request_or_exit(location, CONVERSATION_ABANDON_CALLS, data, as_json), as_json)
