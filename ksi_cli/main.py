"""`ksi`: talk to the daemon, manage it, and inspect what it wrote.

Every command lives in its own module and is imported only when it runs or is listed: `ksi
send` pays for its own imports only (the others together tripled its start-up). A new command
is one line in COMMANDS.
"""

from __future__ import annotations

import difflib
import importlib
import os
import sys

import click

from ksi_cli.output import EXIT_ERROR, EXIT_OK, EXIT_USAGE, fail
from ksi_common import __version__
from ksi_common.errors import KsiError

# command name -> (module, attribute)
COMMANDS: dict[str, tuple[str, str]] = {
    "send": ("ksi_cli.send", "send"),
    "discover": ("ksi_cli.send", "discover"),
    "help": ("ksi_cli.send", "help_event"),
    "config": ("ksi_cli.config_command", "config"),
    "daemon": ("ksi_cli.daemon_commands", "daemon"),
    "ask": ("ksi_cli.ask", "ask"),
    "models": ("ksi_cli.models", "models"),
    "chat": ("ksi_cli.chat", "chat"),
    "monitor": ("ksi_cli.monitor", "monitor"),
    "agents": ("ksi_cli.agents", "agents"),
    "doctor": ("ksi_cli.doctor", "doctor"),
    "conversations": ("ksi_cli.inspect_commands", "conversations"),
    "conversation": ("ksi_cli.inspect_commands", "conversation"),
    "response": ("ksi_cli.inspect_commands", "response"),
    "logs": ("ksi_cli.inspect_commands", "logs"),
    "http": ("ksi_cli.http_commands", "http"),
    "mcp": ("ksi_cli.mcp_command", "mcp"),
    "console": ("ksi_cli.console_command", "console"),
    "storage": ("ksi_cli.storage_commands", "storage"),
    "cluster": ("ksi_cli.cluster", "cluster"),
}


class LazyGroup(click.Group):
    """Commands named in COMMANDS are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *COMMANDS})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        command = super().get_command(ctx, cmd_name)
        if command is None and cmd_name in COMMANDS:
            module, attribute = COMMANDS[cmd_name]
            command = getattr(importlib.import_module(module), attribute)
            self.add_command(command, cmd_name)
        return command

    def resolve_command(self, ctx: click.Context, args: list[str]) -> tuple[str | None, click.Command | None,
                                                                             list[str]]:
        """Click suggests only among the commands imported so far: suggest among all of them."""
        name = args[0] if args else ""
        if name and not name.startswith("-") and not ctx.resilient_parsing \
                and self.get_command(ctx, name) is None:
            similar = difflib.get_close_matches(name, self.list_commands(ctx), n=3, cutoff=0.6)
            hint = f" (Did you mean {' or '.join(repr(s) for s in similar)}?)" if similar else ""
            raise click.UsageError(f"No such command {name!r}.{hint}", ctx)
        return super().resolve_command(ctx, args)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ksi")
@click.option("--no-color", is_flag=True, help="No colours (also when NO_COLOR is set).")
@click.pass_context
def cli(ctx: click.Context, no_color: bool) -> None:
    """KSI: a local daemon for LLM agents whose conversations continue by id."""
    if no_color or os.environ.get("NO_COLOR"):
        ctx.color = False  # inherited by every subcommand's context; click strips the styles
        os.environ["NO_COLOR"] = "1"  # and rich, used for tables, reads this


def main() -> None:
    try:
        cli.main(prog_name="ksi", complete_var="_KSI_COMPLETE", standalone_mode=False)
    except click.UsageError as exc:
        exc.show()
        sys.exit(EXIT_USAGE)
    except click.ClickException as exc:
        exc.show()
        sys.exit(EXIT_ERROR)
    except click.Abort:
        sys.exit(EXIT_ERROR)
    except KsiError as exc:  # raised before a command could report it its own way (a var dir that is a file)
        fail(exc, False)
    sys.exit(EXIT_OK)
