"""`ksi conversation import FILE`: a json or jsonl export becomes a new conversation (the daemon's
`conversation:import`, which checks it whole, items included, before writing anything; the
daemon must be running)."""

from __future__ import annotations

import click

from ksi_cli.locate import locate
from ksi_cli.options import json_option, location_options
from ksi_cli.output import show
from ksi_cli.send import request_or_exit


@click.command(name="import")
@location_options
@json_option
@click.option("--format", "fmt", type=click.Choice(["json", "jsonl"]), help="The export's format (guessed when absent).")
@click.option("--new-id", help="Id of the new conversation (generated when absent).")
@click.option("--title", help="Title of the new conversation (the export's when absent).")
@click.argument("source", type=click.File("r", encoding="utf-8"))
def import_conversation(source: click.utils.LazyFile, fmt: str | None, new_id: str | None, title: str | None,
                        as_json: bool, var_dir: str | None, socket_path: str | None) -> None:
    """Import SOURCE (a json or jsonl export; - for standard input) as a new conversation."""
    data: dict[str, object] = {"data": source.read(), "origin": "cli"}
    for key, value in (("format", fmt), ("new_id", new_id), ("title", title)):
        if value is not None:
            data[key] = value
    reply = request_or_exit(locate(var_dir, socket_path), "conversation:import", data, as_json)
    show(reply, as_json)
