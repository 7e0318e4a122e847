"""Tolerant reading of append-only JSONL files: a torn last line is skipped, not fatal."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson


def iter_lines(path: Path) -> Iterator[bytes]:
    """Complete lines of `path`; a last line without its newline is torn and left out."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return
    end = data.rfind(b"\n")
    if end < 0:
        return
    for line in data[:end].split(b"\n"):
        if line.strip():
            yield line


def read_records(path: Path) -> list[dict[str, Any]]:
    """Every complete JSON-object line of `path`; unparsable lines are skipped."""
    records = []
    for line in iter_lines(path):
        try:
            value = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if isinstance(value, dict):
            records.append(value)
    return records


def iter_lines_reversed(path: Path, block: int = 64 * 1024) -> Iterator[bytes]:
    """Complete lines of `path` from the last to the first, reading from the end in blocks."""
    try:
        handle = open(path, "rb")
    except FileNotFoundError:
        return
    with handle:
        position = handle.seek(0, os.SEEK_END)
        tail = b""
        first_block = True
        while position > 0:
            step = min(block, position)
            position -= step
            handle.seek(position)
            chunk = handle.read(step) + tail
            lines = chunk.split(b"\n")
            if first_block:
                lines.pop()  # text after the last newline is torn (or empty)
                first_block = False
            tail = lines.pop(0)
            for line in reversed(lines):
                if line.strip():
                    yield line
        if tail.strip() and not first_block:
            yield tail


def has_torn_tail(path: Path) -> bool:
    try:
        with open(path, "rb") as handle:
            size = handle.seek(0, os.SEEK_END)
            if size == 0:
                return False
            handle.seek(size - 1)
            return handle.read(1) != b"\n"
    except FileNotFoundError:
        return False
