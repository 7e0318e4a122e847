"""Reading what the daemon stored, with the daemon stopped: the backend `KSI_STORAGE` names."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from ksi_cli.locate import Location
from ksi_common.errors import ErrorCode, KsiError
from ksi_common.reading import StoredReader, open_reader

T = TypeVar("T")


def read_stored(where: Location, work: Callable[[StoredReader], Awaitable[T]]) -> T:
    """Run `work` over the reader of the configured backend, then release it; a bad KSI_STORAGE
    (or postgres without a URL) is a validation_error."""

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
