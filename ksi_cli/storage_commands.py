"""`ksi storage migrate --to postgres|jsonl`: copy a var dir into a database, or back.

Runs with the daemons stopped (the var dir's lock is taken for the copy). Imports the daemon's
storage layer, and a database driver, only when it runs.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import click

from ksi_cli.output import EXIT_ERROR, fail, show, wants_json
from ksi_common.errors import KsiError


@click.group(name="storage")
def storage() -> None:
    """Move conversations, agents and consortia between storage backends."""


@storage.command(name="migrate")
@click.option("--to", "target", type=click.Choice(["postgres", "jsonl"]), required=True,
              help="postgres: copy the var dir into the database; jsonl: copy the database into the var dir.")
@click.option("--var-dir", help="The var directory (default: KSI_VAR_DIR, else ./var).")
@click.option("--database-url", help="postgresql://... (default: KSI_DATABASE_URL).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON even on a terminal.")
def migrate(target: str, var_dir: str | None, database_url: str | None, as_json: bool) -> None:
    """Copy everything into the backend TO; run again to resume or to check (it is idempotent)."""
    import filelock
    import structlog

    from ksi_common.dburl import mask_url
    from ksi_common.settings import Settings
    from ksi_daemon.storage.backends import build_storage
    from ksi_daemon.storage.migrate import migrate as copy_all

    # the storage layer logs (a schema migrated, ...): to stderr, so stdout stays the report
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    overrides: dict[str, Any] = {}
    if var_dir:
        overrides["var_dir"] = var_dir
    if database_url:
        overrides["database_url"] = database_url
    settings = Settings(**overrides)
    if settings.database_url is None:
        raise click.UsageError("a database URL is needed: --database-url or KSI_DATABASE_URL")
    source_name = "jsonl" if target == "postgres" else "postgres"
    lock = filelock.FileLock(str(settings.layout.lock_file))
    settings.layout.run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        lock.acquire(timeout=0)
    except filelock.Timeout:
        click.secho(f"a daemon is running on {settings.layout.root}; stop it first (ksi daemon stop)",
                    fg="red", err=True)
        sys.exit(EXIT_ERROR)

    def report(kind: str, copied: int) -> None:
        if copied % 1000 == 0:
            click.echo(f"  {kind}: {copied}", err=True)

    async def run() -> dict[str, Any]:
        source = build_storage(settings.model_copy(update={"storage": source_name}))
        destination = build_storage(settings.model_copy(update={"storage": target}))
        await source.open()
        try:
            await destination.open()
            try:
                tally = await copy_all(source, destination, report)
            finally:
                await destination.close()
        finally:
            await source.close()
        return tally.to_dict()

    try:
        result = asyncio.run(run())
    except KsiError as error:  # storage_unavailable: the database does not answer
        fail(error, as_json)
        return
    finally:
        lock.release()
    result = {"from": source_name, "to": target, "var_dir": str(settings.layout.root),
              "database": mask_url(settings.database_url.get_secret_value()), **result}
    if wants_json(as_json):
        show(result, True)
    else:
        click.echo(f"{source_name} -> {target}: copied {result['copied'] or 'nothing (already there)'}")
        for kind, count in result["source"].items():
            click.echo(f"  {kind:<14} source {count:>8}  destination {result['destination'].get(kind, 0):>8}")
        click.echo("verified: every count carried over" if result["verified"] else
                   f"NOT verified: {result['mismatches']}")
    if not result["verified"]:
        sys.exit(EXIT_ERROR)
