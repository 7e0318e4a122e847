"""`ksi config`: the settings in effect and where each came from, and the configuration file
(`ksi config set|unset|edit|path`)."""

from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING, Any

import click

from ksi_cli.options import json_option, location_options
from ksi_cli.output import EXIT_USAGE, fail, report_error, show, wants_json
from ksi_common import oneshot
from ksi_common.errors import KsiError
from ksi_common.events import SYSTEM_CONFIG
from ksi_common.locate import Location, locate

if TYPE_CHECKING:
    from ksi_common.settings import Settings


@click.group(invoke_without_command=True)
@location_options
@json_option
@click.pass_context
def config(ctx: click.Context, var_dir: str | None, socket_path: str | None, as_json: bool) -> None:
    """Show the effective settings, secrets masked: the running daemon's, else what a start would use.

    `ksi config show --origin` says where each came from; `ksi config set KEY VALUE` and
    `ksi config edit` change the configuration file (ksi.toml), applied at the next restart.
    """
    ctx.obj = (var_dir, socket_path)
    if ctx.invoked_subcommand is None:
        _show(locate(var_dir, socket_path), as_json, origin=False)


def _location(ctx: click.Context, var_dir: str | None, socket_path: str | None) -> Location:
    """Options given after the subcommand win over those given before it."""
    parent_var_dir, parent_socket = ctx.obj or (None, None)
    return locate(var_dir or parent_var_dir, socket_path or parent_socket)


@config.command("show")
@location_options
@json_option
@click.option("--origin", is_flag=True, help="Say where each value came from: default, file, env, .env, flag or "
                                             "kept (by a restart).")
@click.pass_context
def show_command(ctx: click.Context, var_dir: str | None, socket_path: str | None, as_json: bool,
                 origin: bool) -> None:
    """Show the effective settings, secrets masked (the running daemon's, else what a start would use)."""
    _show(_location(ctx, var_dir, socket_path), as_json, origin)


def _show(location: Location, as_json: bool, origin: bool) -> None:
    try:
        answer: dict[str, Any] = oneshot.request(location.socket, SYSTEM_CONFIG, {"origins": True} if origin else {},
                                                 timeout=2.0)
        source = "the running daemon"
    except KsiError:
        try:
            settings = _load(location)
        except KsiError as invalid:
            fail(invalid, as_json, location)
        view = settings.public_view()
        answer = ({"settings": view, "origins": settings.origins, "config_file": str(settings.config_file)}
                  if origin else view)
        source = "configuration file, environment, .env and defaults (no daemon answers)"
    answer["settings_source"] = source
    answer["var_dir_found_by"] = location.found_by
    if not origin or wants_json(as_json):
        show(answer, as_json)
        return
    click.echo(f"settings of {source}; configuration file {answer['config_file']}")
    origins = answer["origins"]
    width = max(map(len, answer["settings"]))
    for name, value in answer["settings"].items():
        shown = json.dumps(value, ensure_ascii=False, default=str)
        origin = f"{origins.get(name, 'default'):<7}"  # padded before styling: escapes have no width
        click.echo(f"{name:<{width}}  {click.style(origin, dim=True)}  {shown}")


def _load(location: Location) -> Settings:
    from ksi_common.settings import load_settings  # pydantic: only when no daemon answers

    # only what the command line gave is a flag: a var dir or socket from KSI_* is the
    # environment's, and one found by search is the settings' own default (the same search)
    given: dict[str, object] = {}
    if location.found_by == "--var-dir":
        given.update(var_dir=location.var_dir, socket_path=location.socket)
    if location.socket_given:
        given["socket_path"] = location.socket
    return load_settings(**given)


@config.command("path")
@location_options
@click.pass_context
def path_command(ctx: click.Context, var_dir: str | None, socket_path: str | None) -> None:
    """Print where the configuration file of this var dir's daemon is (it may not exist yet)."""
    from ksi_common.config_file import config_path

    click.echo(str(config_path(_location(ctx, var_dir, socket_path).var_dir)))


@config.command("set", context_settings={"ignore_unknown_options": True})  # VALUE may be -3
@location_options
@json_option
@click.argument("key")
@click.argument("value")
@click.pass_context
def set_command(ctx: click.Context, var_dir: str | None, socket_path: str | None, as_json: bool,
                key: str, value: str) -> None:
    """Write KEY = VALUE into the configuration file, checked first (KEY as `default_model` or
    `KSI_DEFAULT_MODEL`; VALUE as the KSI_* variable takes it; `-` reads it from standard input,
    for a secret kept out of the shell's history). A running daemon applies it at its restart."""
    location = _location(ctx, var_dir, socket_path)
    try:
        from ksi_cli.config_edit import set_setting

        said = set_setting(location, key, sys.stdin.read().rstrip("\n") if value == "-" else value)
    except KsiError as invalid:
        report_error(invalid, as_json, location)
        sys.exit(EXIT_USAGE)
    click.echo(said)


@config.command("unset")
@location_options
@json_option
@click.argument("key")
@click.pass_context
def unset_command(ctx: click.Context, var_dir: str | None, socket_path: str | None, as_json: bool,
                  key: str) -> None:
    """Remove KEY from the configuration file (its default applies at the next restart)."""
    location = _location(ctx, var_dir, socket_path)
    try:
        from ksi_cli.config_edit import unset_setting

        said = unset_setting(location, key)
    except KsiError as invalid:
        report_error(invalid, as_json, location)
        sys.exit(EXIT_USAGE)
    click.echo(said)


@config.command("edit")
@location_options
@json_option
@click.pass_context
def edit_command(ctx: click.Context, var_dir: str | None, socket_path: str | None, as_json: bool) -> None:
    """Open the configuration file in $VISUAL or $EDITOR (a new one lists every setting, commented
    out), then check it: a setting that does not fit is named, exit 1."""
    from ksi_cli.config_edit import ensure_file

    location = _location(ctx, var_dir, socket_path)
    path = ensure_file(location)
    editor = os.environ.get("VISUAL") or os.environ.get("EDITOR") or "vi"
    click.edit(filename=str(path), editor=editor)
    try:
        _load(location)
    except KsiError as invalid:
        fail(invalid, as_json, location)
    if invalid_mode := (os.stat(path).st_mode & 0o077):
        click.echo(f"note: {path} may be read by other users (mode bits {invalid_mode:o}); it must not hold "
                   "secrets then", err=True)
    click.echo(f"{path} checked; a running daemon applies it at `ksi daemon restart`")

