"""`ksi conversation pin|unpin`: keep exchanges verbatim in every turn's history (the daemon's
`conversation:pin` / `conversation:unpin`; the daemon must be running)."""

from __future__ import annotations

import click

from ksi_cli import completion
from ksi_cli.options import json_option, location_options
from ksi_cli.output import show
from ksi_cli.send import request_or_exit
from ksi_common.events import CONVERSATION_PIN, CONVERSATION_UNPIN
from ksi_common.locate import locate


def _pins(event: str, conversation_id: str, numbers: tuple[int, ...], as_json: bool, var_dir: str | None,
          socket_path: str | None) -> None:
    location = locate(var_dir, socket_path)
    reply = request_or_exit(location, event, {"conversation_id": conversation_id, "n": list(numbers)}, as_json)
    show(reply, as_json)


@click.command(name="pin")
@location_options
@json_option
@click.argument("conversation_id", shell_complete=completion.conversations)
@click.argument("numbers", nargs=-1, required=True, type=click.IntRange(min=1))
def pin(conversation_id: str, numbers: tuple[int, ...], as_json: bool, var_dir: str | None,
        socket_path: str | None) -> None:
    """Keep exchanges NUMBERS of CONVERSATION_ID verbatim in every turn's history."""
    _pins(CONVERSATION_PIN, conversation_id, numbers, as_json, var_dir, socket_path)


@click.command(name="unpin")
@location_options
@json_option
@click.argument("conversation_id", shell_complete=completion.conversations)
@click.argument("numbers", nargs=-1, required=True, type=click.IntRange(min=1))
def unpin(conversation_id: str, numbers: tuple[int, ...], as_json: bool, var_dir: str | None,
          socket_path: str | None) -> None:
    """Let pinned exchanges NUMBERS of CONVERSATION_ID be left out like any other again."""
    _pins(CONVERSATION_UNPIN, conversation_id, numbers, as_json, var_dir, socket_path)
