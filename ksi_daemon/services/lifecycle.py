"""The optional stages of a service's life, as Protocols the composition root checks for."""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class Starts(Protocol):
    """A service with work to do before the socket opens (load records, recover the journal)."""

    async def start(self) -> None: ...


@runtime_checkable
class Stops(Protocol):
    """A service with work to drain at shutdown, within `timeout` seconds."""

    async def stop(self, timeout: float) -> None: ...
