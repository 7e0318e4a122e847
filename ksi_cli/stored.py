"""Reading what the daemon stored, with the daemon stopped: the backend `KSI_STORAGE` names."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import TypeVar

from ksi_common.errors import ErrorCode, KsiError
from ksi_common.events import SYSTEM_CONFIG
from ksi_common.locate import Location
from ksi_common.reading import StoredReader, open_reader
from ksi_common.storage_backends import needs_url

T = TypeVar("T")


def running_storage(where: Location) -> Location:
    """`where` reading what the running daemon reads, when KSI_STORAGE is unset: a daemon on
    PostgreSQL keeps nothing of its conversations in the var dir, which would read as empty.
    A URL the daemon shows masked (it holds a password) cannot be used: storage_unavailable,
    naming the two settings to give."""
    if where.storage_given:
        return where
    from ksi_common import oneshot
    from ksi_common.dburl import MASK

    try:
        running = oneshot.request(where.socket, SYSTEM_CONFIG, timeout=2.0)
    except KsiError:  # no daemon answers: the var dir is what there is
        return where
    storage = str(running.get("storage") or "")
    if not needs_url(storage):
        return where
    url = str(running.get("database_url") or "")
    if not url or MASK in url:
        raise KsiError(ErrorCode.STORAGE_UNAVAILABLE,
                       f"the running daemon keeps its conversations in a database ({storage}: {url or 'no URL shown'}); "
                       f"set KSI_STORAGE={storage} and KSI_DATABASE_URL (with its password) as the daemon has them",
                       fields={"KSI_STORAGE": storage, "KSI_DATABASE_URL": url})
    return replace(where, storage=storage, database_url=url, storage_given=True)


def read_stored(where: Location, work: Callable[[StoredReader], Awaitable[T]]) -> T:
    """Run `work` over the reader of the configured backend (or the running daemon's, see
    running_storage), then release it; a bad KSI_STORAGE (or postgres without a URL) is a
    validation_error."""
    where = running_storage(where)

    async def run() -> T:
        try:
            reader = open_reader(where.storage, where.layout, where.database_url)
        except ValueError as error:
            raise KsiError(ErrorCode.VALIDATION_ERROR, str(error), fields={"KSI_STORAGE": str(error)}) from None
        try:
            return await work(reader)
        finally:
            await reader.aclose()

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(run())
    # called from inside an event loop (a program embedding the CLI, a test): a loop of its own
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, run()).result()
