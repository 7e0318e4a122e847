"""Options shared by the `ksi` commands, so each command module declares them the same way."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

Command = TypeVar("Command", bound=Callable[..., Any])

VAR_DIR_HELP = ("The var directory (default: KSI_VAR_DIR, else a project `var/` found upward from here, "
                "else the per-user state dir).")


def var_dir_option(command: Command) -> Command:
    return click.option("--var-dir", help=VAR_DIR_HELP)(command)


def location_options(command: Command) -> Command:
    """`--socket` and `--var-dir`: which daemon to talk to."""
    command = click.option("--socket", "socket_path", help="Unix socket of the daemon.")(command)
    return var_dir_option(command)


def json_option(command: Command) -> Command:
    return click.option("--json", "as_json", is_flag=True, help="Print JSON even on a terminal.")(command)
