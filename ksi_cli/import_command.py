"""`ksi conversation import FILE`: a json or jsonl export becomes a new conversation (the daemon's
`conversation:import`, which checks it whole, items included, before writing anything; the
daemon must be running)."""

from __future__ import annotations

import click

from ksi_cli.options import json_option, location_options
from ksi_cli.output import fail, show
from ksi_cli.send import request_or_exit
from ksi_common.errors import ErrorCode, KsiError
from ksi_common.events import CONVERSATION_IMPORT
from ksi_common.locate import locate


@click.command(name="import")
@location_options
@json_option
@click.option("--format", "fmt", type=click.Choice(["json", "jsonl"]), help="The export's format (guessed when absent).")
@click.option("--new-id", help="Id of the new conversation (generated when absent).")
@click.option("--title", help="Title of the new conversation (the export's when absent).")
@click.argument("source", type=click.Path(dir_okay=False, allow_dash=True))
def import_conversation(source: str, fmt: str | None, new_id: str | None, title: str | None,
                        as_json: bool, var_dir: str | None, socket_path: str | None) -> None:
    """Import SOURCE (a json or jsonl export; - for standard input) as a new conversation."""
    try:
        with click.open_file(source, "r", encoding="utf-8") as handle:
            text = handle.read()
    except (OSError, UnicodeDecodeError) as error:
        fail(KsiError(ErrorCode.VALIDATION_ERROR, f"cannot read {source}: {error}",
                      fields={"source": "a readable json or jsonl export in UTF-8"}), as_json)
    data: dict[str, object] = {"data": text, "origin": "cli"}
    for key, value in (("format", fmt), ("new_id", new_id), ("title", title)):
        if value is not None:
            data[key] = value
    reply = request_or_exit(locate(var_dir, socket_path), CONVERSATION_IMPORT, data, as_json)
    show(reply, as_json)
