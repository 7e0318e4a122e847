"""Saved consortium definitions (`state/consortia/NAME.json`) and run traces
(`logs/consortium/RUN_ID.jsonl`, append-only); the `ConsortiumStore` and `TraceStore` ports."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from ksi_common.jsonl import read_records
from ksi_common.layout import VarLayout
from ksi_common.timefmt import utc_now
from ksi_daemon.storage.jsonl.files import append_lines, jsonl, read_json, replace_json


class JsonlConsortia:
    """Definitions by name; names are validated by the caller."""

    def __init__(self, layout: VarLayout, fsync: bool) -> None:
        self.directory = layout.consortia_dir
        self.fsync = fsync

    def _path(self, name: str) -> Path:
        return self.directory / f"{name}.json"

    def _save(self, name: str, definition: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        self.directory.mkdir(parents=True, exist_ok=True)
        try:
            earlier = read_json(self._path(name))
        except ValueError:  # a damaged file is replaced
            earlier = {}
        now = utc_now()
        record = {"v": 1, "name": name, **definition,
                  "created": earlier.get("created", now) if isinstance(earlier, dict) else now, "updated": now}
        replace_json(self._path(name), record, self.fsync)
        return record, earlier is not None

    async def save(self, name: str, definition: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        return await asyncio.to_thread(self._save, name, definition)

    def _load(self, name: str) -> dict[str, Any] | None:
        try:
            record = read_json(self._path(name))
        except ValueError:  # a damaged file is as good as none
            return None
        return record if isinstance(record, dict) else None

    async def load(self, name: str) -> dict[str, Any] | None:
        return await asyncio.to_thread(self._load, name)

    def _load_all(self) -> dict[str, dict[str, Any]]:
        found = {}
        for path in sorted(self.directory.glob("*.json")):
            record = self._load(path.stem)
            if record is not None:
                found[path.stem] = record
        return found

    async def load_all(self) -> dict[str, dict[str, Any]]:
        return await asyncio.to_thread(self._load_all)

    def _remove(self, name: str) -> bool:
        try:
            self._path(name).unlink()
        except FileNotFoundError:
            return False
        return True

    async def remove(self, name: str) -> bool:
        return await asyncio.to_thread(self._remove, name)


class JsonlTraces:
    """One JSONL file per consortium run, a line per event, appended as the run goes."""

    def __init__(self, layout: VarLayout, fsync: bool) -> None:
        self.directory = layout.consortium_dir
        self.fsync = fsync

    def _path(self, run_id: str) -> Path:
        return self.directory / f"{run_id}.jsonl"

    def _append(self, run_id: str, line: dict[str, Any], durable: bool) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        append_lines(self._path(run_id), jsonl([line]), self.fsync and durable)

    async def append(self, run_id: str, line: dict[str, Any], durable: bool = False) -> None:
        await asyncio.to_thread(self._append, run_id, line, durable)

    def _read(self, run_id: str) -> list[dict[str, Any]] | None:
        path = self._path(run_id)
        if not path.exists():
            return None
        return read_records(path)

    async def read(self, run_id: str) -> list[dict[str, Any]] | None:
        return await asyncio.to_thread(self._read, run_id)

    async def run_ids(self) -> list[str]:
        return await asyncio.to_thread(
            lambda: sorted(p.stem for p in self.directory.glob("*.jsonl") if not p.name.startswith(".")))
