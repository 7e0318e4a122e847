"""Saved consortium definitions (var/state/consortia/NAME.json) and run traces
(var/logs/consortium/RUN_ID.jsonl, append-only)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ksi_common.jsonl import read_records
from ksi_common.layout import VarLayout
from ksi_common.timefmt import utc_now
from ksi_daemon.storage.files import append_lines, jsonl, read_json, replace_json


class ConsortiumStore:
    """Blocking file operations on saved definitions; names are validated by the caller."""

    def __init__(self, layout: VarLayout, fsync: bool) -> None:
        self.directory = layout.consortia_dir
        self.fsync = fsync

    def path(self, name: str) -> Path:
        return self.directory / f"{name}.json"

    def save(self, name: str, definition: dict[str, Any]) -> dict[str, Any]:
        """Write (or replace) a definition; returns the stored record."""
        self.directory.mkdir(parents=True, exist_ok=True)
        earlier = read_json(self.path(name))
        now = utc_now()
        record = {"v": 1, "name": name, **definition,
                  "created": earlier.get("created", now) if isinstance(earlier, dict) else now, "updated": now}
        replace_json(self.path(name), record, self.fsync)
        return record

    def load(self, name: str) -> dict[str, Any] | None:
        try:
            record = read_json(self.path(name))
        except ValueError:  # a damaged file is as good as none
            return None
        return record if isinstance(record, dict) else None

    def load_all(self) -> dict[str, dict[str, Any]]:
        found = {}
        for path in sorted(self.directory.glob("*.json")):
            record = self.load(path.stem)
            if record is not None:
                found[path.stem] = record
        return found

    def remove(self, name: str) -> bool:
        try:
            self.path(name).unlink()
        except FileNotFoundError:
            return False
        return True


class TraceLog:
    """One JSONL file per consortium run, a line per event, appended as the run goes."""

    def __init__(self, layout: VarLayout, fsync: bool) -> None:
        self.directory = layout.consortium_dir
        self.fsync = fsync

    def path(self, run_id: str) -> Path:
        return self.directory / f"{run_id}.jsonl"

    def append(self, run_id: str, record: dict[str, Any], durable: bool = False) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        append_lines(self.path(run_id), jsonl([record]), self.fsync and durable)

    def read(self, run_id: str) -> list[dict[str, Any]] | None:
        path = self.path(run_id)
        if not path.exists():
            return None
        return read_records(path)
