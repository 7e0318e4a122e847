"""`ksi config`: the settings in effect, the running daemon's when one answers."""

from __future__ import annotations

from typing import Any

import click

from ksi_cli.locate import locate
from ksi_cli.options import json_option, location_options
from ksi_cli.output import fail, show
from ksi_common import oneshot
from ksi_common.errors import KsiError


@click.command()
@location_options
@json_option
def config(var_dir: str | None, socket_path: str | None, as_json: bool) -> None:
    """Show the effective settings, secrets masked: the running daemon's, else what a start would use."""
    location = locate(var_dir, socket_path)
    try:
        view: dict[str, Any] = oneshot.request(location.socket, "system:config", timeout=2.0)
        source = "the running daemon"
    except KsiError:
        from ksi_common.settings import load_settings  # pydantic: only when no daemon answers

        try:
            view = load_settings(var_dir=location.var_dir, socket_path=location.socket).public_view()
        except KsiError as invalid:
            fail(invalid, as_json, location)
        source = "environment, .env and defaults (no daemon answers)"
    view["settings_source"] = source
    view["var_dir_found_by"] = location.found_by
    show(view, as_json)
