"""Response files `logs/responses/ID.jsonl`: one per request, the raw inputs then the outcome,
written whole; the `ResponseStore` port."""

from __future__ import annotations

import asyncio
from typing import Any

from ksi_common.layout import VarLayout
from ksi_common.reading import JsonlFiles
from ksi_common.records import ResponseRecord
from ksi_daemon.storage.jsonl.files import jsonl, write_new


class JsonlResponses:
    def __init__(self, layout: VarLayout, fsync: bool) -> None:
        self.layout = layout
        self.fsync = fsync
        self.files = JsonlFiles(layout)

    def write_now(self, response_id: str, lines: list[dict[str, Any]]) -> None:
        write_new(self.layout.response_file(response_id), jsonl(lines), self.fsync)

    async def write(self, response_id: str, lines: list[dict[str, Any]]) -> None:
        """Write the whole response file, durable before the caller indexes it."""
        await asyncio.to_thread(self.write_now, response_id, lines)

    async def read(self, response_id: str) -> ResponseRecord | None:
        return await asyncio.to_thread(self.files.response, response_id)

    async def read_many(self, response_ids: list[str]) -> list[ResponseRecord | None]:
        return await asyncio.to_thread(lambda: [self.files.response(r) for r in response_ids])

    async def ids(self) -> list[str]:
        return await asyncio.to_thread(
            lambda: sorted(p.stem for p in self.layout.responses_dir.glob("*.jsonl") if not p.name.startswith(".")))
