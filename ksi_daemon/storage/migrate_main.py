"""`python -m ksi_daemon.storage.migrate_main --to NAME [--from NAME]`: the copy behind `ksi storage migrate`.

It runs in a process of its own so the `ksi` client never imports the daemon's storage layer. The
var dir and the database URL come from the environment (KSI_VAR_DIR, KSI_DATABASE_URL), never the
command line where other users could read the password. Stdout carries one JSON object: the
report, or `{"error": {...}}`; progress and log lines go to stderr. Exit 2: no database URL; 1: a
daemon holds the var dir, or the copy failed; 0: copied (the report says whether it verified).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

import filelock
import orjson
import structlog

from ksi_common.dburl import mask_url
from ksi_common.errors import KsiError
from ksi_common.settings import Settings, load_settings
from ksi_common.storage_backends import STORAGE_NAMES, needs_url
from ksi_daemon.storage.backends import build_storage
from ksi_daemon.storage.migrate import migrate


def report(kind: str, copied: int) -> None:
    if copied % 1000 == 0:
        print(f"  {kind}: {copied}", file=sys.stderr, flush=True)


async def copy(settings: Settings, source_name: str, target: str) -> dict[str, Any]:
    source = build_storage(settings.model_copy(update={"storage": source_name}))
    destination = build_storage(settings.model_copy(update={"storage": target}))
    await source.open()
    try:
        await destination.open()
        try:
            tally = await migrate(source, destination, report)
        finally:
            await destination.close()
    finally:
        await source.close()
    return tally.to_dict()


def the_other(target: str) -> str | None:
    """The backend a copy to `target` comes from when the table leaves one choice, else None."""
    others = [name for name in STORAGE_NAMES if name != target]
    return others[0] if len(others) == 1 else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--to", dest="target", choices=STORAGE_NAMES, required=True)
    parser.add_argument("--from", dest="source", choices=STORAGE_NAMES,
                        help="the backend copied from (default: the other one, when there are two)")
    arguments = parser.parse_args(argv)
    target, source_name = arguments.target, arguments.source or the_other(arguments.target)
    if source_name is None or source_name == target:
        print(f"--from: one of {', '.join(name for name in STORAGE_NAMES if name != target)}", file=sys.stderr)
        return 2
    # the storage layer logs (a schema migrated, ...): to stderr, so stdout stays the report
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    try:
        settings = load_settings()  # the configuration file too: a database URL may live there
    except KsiError as invalid:
        print(f"{invalid.code}: {invalid.message}", file=sys.stderr)
        return 2
    if settings.database_url is None and (needs_url(source_name) or needs_url(target)):
        print("a database URL is needed: --database-url or KSI_DATABASE_URL", file=sys.stderr)
        return 2
    settings.layout.run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    lock = filelock.FileLock(str(settings.layout.lock_file))
    try:
        lock.acquire(timeout=0)
    except filelock.Timeout:
        print(f"a daemon is running on {settings.layout.root}; stop it first (ksi daemon stop)", file=sys.stderr)
        return 1
    try:
        result = asyncio.run(copy(settings, source_name, target))
    except KsiError as error:  # storage_unavailable: the database does not answer
        sys.stdout.write(orjson.dumps({"error": error.to_wire()}).decode() + "\n")
        return 1
    finally:
        lock.release()
    result = {"from": source_name, "to": target, "var_dir": str(settings.layout.root),
              "database": mask_url(settings.database_url.get_secret_value()) if settings.database_url else None,
              **result}
    sys.stdout.write(orjson.dumps(result).decode() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
