"""Reading the daemon's JSON-lines log (`var/logs/daemon/daemon.log`): filter, render, follow."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson

from ksi_common.jsonl import iter_lines

LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}
_FIRST_KEYS = ("timestamp", "level", "logger", "event")


def parse_line(line: bytes) -> dict[str, Any]:
    """A log line as a record; a line that is not a JSON object is kept as its text."""
    try:
        record = orjson.loads(line)
    except orjson.JSONDecodeError:
        record = None
    if isinstance(record, dict):
        return record
    return {"event": line.decode("utf-8", "replace").rstrip("\r\n"), "level": "info"}


def level_of(record: dict[str, Any]) -> int:
    return LEVELS.get(str(record.get("level") or "info").lower(), 20)


def keep(record: dict[str, Any], line: bytes, level: str | None, grep: str | None) -> bool:
    """At least `level`, and containing `grep` (case-insensitive, anywhere in the line)."""
    if level and level_of(record) < LEVELS.get(level.lower(), 0):
        return False
    if grep and grep.casefold() not in line.decode("utf-8", "replace").casefold():
        return False
    return True


def render(record: dict[str, Any]) -> str:
    """`timestamp LEVEL logger event key=value ...`, one line (an exception follows it)."""
    parts = [str(record.get("timestamp") or "-"), str(record.get("level") or "-").upper().ljust(7)]
    if record.get("logger"):
        parts.append(str(record["logger"]))
    parts.append(str(record.get("event") or ""))
    for key, value in record.items():
        if key in _FIRST_KEYS or key == "exception":
            continue
        text = value if isinstance(value, str) else orjson.dumps(value, default=str).decode()
        parts.append(f"{key}={text}")
    line = " ".join(parts)
    if record.get("exception"):
        line += "\n" + str(record["exception"])
    return line


def read(path: Path, level: str | None = None, grep: str | None = None,
         tail: int | None = None) -> list[dict[str, Any]]:
    """The complete lines of the log that pass the filters (the last `tail` of them)."""
    kept = []
    for line in iter_lines(path):
        record = parse_line(line)
        if keep(record, line, level, grep):
            kept.append(record)
    return kept[-tail:] if tail else kept


def follow(path: Path, start_at_end: bool = True, poll: float = 0.2,
           stop: Callable[[], bool] = lambda: False) -> Iterator[bytes]:
    """New complete lines as they are appended; survives rotation and truncation."""
    position = path.stat().st_size if start_at_end and path.exists() else 0
    identity = _identity(path)
    pending = b""
    while not stop():
        current = _identity(path)
        if current != identity:  # rotated: the new file starts from its beginning
            identity, position, pending = current, 0, b""
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            time.sleep(poll)
            continue
        if size < position:  # truncated in place
            position, pending = 0, b""
        if size == position:
            time.sleep(poll)
            continue
        with open(path, "rb") as handle:
            handle.seek(position)
            chunk = handle.read(size - position)
        position += len(chunk)
        data = pending + chunk
        *lines, pending = data.split(b"\n")
        for line in lines:
            if line.strip():
                yield line


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return None
    return info.st_dev, info.st_ino
