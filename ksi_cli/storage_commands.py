"""`ksi storage migrate --to NAME [--from NAME]`: copy between storage backends (a var dir and a database).

Runs with the daemons stopped (the var dir's lock is taken for the copy). The copy itself runs in
`python -m ksi_daemon.storage.migrate_main`, so the client never imports the daemon's storage layer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import click

from ksi_cli.options import VAR_DIR_HELP
from ksi_cli.output import EXIT_ERROR, fail, show, wants_json
from ksi_common.errors import KsiError
from ksi_common.storage_backends import STORAGE_NAMES


@click.group(name="storage")
def storage() -> None:
    """Move conversations, agents and consortia between storage backends."""


@storage.command(name="migrate")
@click.option("--to", "target", type=click.Choice(STORAGE_NAMES), required=True,
              help="postgres: copy the var dir into the database; jsonl: copy the database into the var dir.")
@click.option("--from", "source", type=click.Choice(STORAGE_NAMES),
              help="The backend copied from (default: the other one; needed once there are more than two).")
@click.option("--var-dir", help=VAR_DIR_HELP)
@click.option("--database-url", help="postgresql://... (default: KSI_DATABASE_URL).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON even on a terminal.")
def migrate(target: str, source: str | None, var_dir: str | None, database_url: str | None, as_json: bool) -> None:
    """Copy everything into the backend TO; run again to resume or to check (it is idempotent)."""
    env = dict(os.environ)
    if var_dir:
        env["KSI_VAR_DIR"] = var_dir
    if database_url:
        env["KSI_DATABASE_URL"] = database_url  # the environment, not argv: others can read argv
    # the daemon's storage layer does the copy in a process of its own; this command only reports
    chosen = ["--to", target, *(["--from", source] if source else [])]
    done = subprocess.run([sys.executable, "-m", "ksi_daemon.storage.migrate_main", *chosen],
                          env=env, stdout=subprocess.PIPE, text=True)
    if done.returncode == 2:
        sys.exit(2)  # usage: it said what is missing on stderr
    try:
        result = json.loads(done.stdout) if done.stdout.strip() else None
    except ValueError:
        result = None
    if not isinstance(result, dict):
        sys.exit(done.returncode or EXIT_ERROR)  # it said why on stderr
    if "error" in result:
        fail(KsiError(result["error"]["code"], result["error"]["message"], **result["error"].get("details", {})),
             as_json)
    if wants_json(as_json):
        show(result, True)
    else:
        click.echo(f"{result['from']} -> {target}: copied {result['copied'] or 'nothing (already there)'}")
        for kind, count in result["source"].items():
            click.echo(f"  {kind:<14} source {count:>8}  destination {result['destination'].get(kind, 0):>8}")
        click.echo("verified: every count carried over" if result["verified"] else
                   f"NOT verified: {result['mismatches']}")
    if not result["verified"]:
        sys.exit(EXIT_ERROR)
