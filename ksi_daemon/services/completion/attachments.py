"""Files attached to requests: where they may come from, and how they reach the model.

A request's `files` are checked when it is submitted: each path must be absolute and resolve
(following symlinks) inside one of `allowed_file_roots`, else `path_not_allowed`; a path inside
the roots that does not exist or is not a regular file is a `validation_error`. The exchange's
user line then records `{path, size, sha256}` of what was sent, never the content.

At send time every file referenced by the selected history or by the new request is read fresh
and embedded once (the newest reference wins) in a block that precedes the new input in its last
user message. That place reaches every provider, resumed CLI sessions included, and keeps
history turns exactly as stored. Files get at most `files_budget_share` of the token budget,
newest reference first; the rest are listed as omitted. Reading runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ksi_daemon.services.completion.file_roots import FileRoots
from ksi_daemon.services.conversations.memory import Exchange

HEADER = "Attached files (read when this message was sent; each file appears once, its newest reference wins):"
FOOTER = "[end of attached files]"
BYTES_PER_TOKEN_MAX = 16  # no text is denser than this: bigger files cannot fit, skip reading them
CHUNK = 1024 * 1024


@dataclass(slots=True)
class FileNote:
    """One file as the model will see it: embedded content or a one-line note."""

    path: str
    status: str  # embedded | changed | missing | not_allowed | binary | omitted
    text: str
    tokens: int

    @property
    def embedded(self) -> bool:
        return self.status in ("embedded", "changed")


@dataclass(slots=True)
class Attached:
    notes: list[FileNote] = field(default_factory=list)  # in the order of their newest reference
    new_files: list[dict[str, Any]] = field(default_factory=list)  # recorded on the user line
    overhead: int = 0

    @property
    def tokens(self) -> int:
        return self.overhead + sum(note.tokens for note in self.notes) if self.notes else 0

    def kept_for(self, exchanges: Sequence[Exchange]) -> Attached:
        """Only the files still referenced once history was cut to leave room for them."""
        referenced = {ref.get("path") for exchange in exchanges for ref in exchange.files}
        referenced |= {ref["path"] for ref in self.new_files}
        return replace(self, notes=[n for n in self.notes if n.path in referenced])

    def stats(self) -> dict[str, int]:
        if not self.notes:
            return {}
        return {
            "files_embedded": sum(1 for n in self.notes if n.embedded),
            "files_omitted": sum(1 for n in self.notes if n.status == "omitted"),
            "files_missing": sum(1 for n in self.notes if n.status == "missing"),
            "files_tokens": self.tokens,
        }

    def block(self) -> str:
        return "\n\n".join([HEADER, *(note.text for note in self.notes), FOOTER])

    def prepend(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The new input with the files block before the text of its last user message."""
        if not self.notes:
            return messages
        out = list(messages)
        for position in range(len(out) - 1, -1, -1):
            if out[position].get("role") == "user":
                out[position] = {**out[position], "content": f"{self.block()}\n\n{out[position]['content']}"}
                break
        return out

    def record_in(self, lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The response file's input lines with the new files' descriptors on the last user line."""
        if not self.new_files:
            return lines
        out = list(lines)
        for position in range(len(out) - 1, -1, -1):
            if out[position].get("type") in ("user", "feedback"):
                out[position] = {**out[position], "files": self.new_files}
                break
        return out


class Attachments:
    def __init__(self, roots: Sequence[Path], count_tokens: Callable[[str], int]) -> None:
        self.file_roots = FileRoots(roots)
        self.count_tokens = count_tokens

    # -- submission ---------------------------------------------------------
    def allowed(self, resolved: Path) -> bool:
        return self.file_roots.allowed(resolved)

    def _check(self, paths: Sequence[str]) -> list[str]:
        checked: list[str] = []
        for position, raw in enumerate(paths):
            resolved = self.file_roots.regular_file(raw, f"files.{position}")
            if str(resolved) not in checked:
                checked.append(str(resolved))
        return checked

    async def check(self, paths: Sequence[str]) -> list[str]:
        """The resolved paths, or the error that refuses the request."""
        if not paths:
            return []
        return await asyncio.to_thread(self._check, list(paths))

    # -- send time ----------------------------------------------------------
    async def embed(self, exchanges: Sequence[Exchange], new_paths: Sequence[str], budget: int) -> Attached:
        """Read every referenced file once, newest reference first, within `budget` tokens."""
        refs: dict[str, dict[str, Any] | None] = {}
        for exchange in exchanges:
            for ref in exchange.files:
                if not isinstance(ref, dict) or ref.get("imported"):
                    continue  # a reference that came with an import is history, never read from disk
                path = ref.get("path")
                if path:
                    refs.pop(path, None)  # re-inserting moves it to the newest position
                    refs[path] = ref
        for path in new_paths:
            refs.pop(path, None)
            refs[path] = None  # attached by this request: read now, so never "changed"
        if not refs:
            return Attached()
        return await asyncio.to_thread(self._read_all, refs, budget)

    def _read_all(self, refs: dict[str, dict[str, Any] | None], budget: int) -> Attached:
        overhead = self.count_tokens(f"{HEADER}\n\n{FOOTER}") + 4
        remaining = budget - overhead
        notes: dict[str, FileNote] = {}
        hashes: dict[str, tuple[int, str] | None] = {}
        for path, ref in reversed(list(refs.items())):  # newest reference first
            note, facts = self._read_one(path, ref, remaining)
            notes[path] = note
            hashes[path] = facts
            remaining -= note.tokens
        new_files = []
        for path, ref in refs.items():
            if ref is None:
                facts = hashes[path]
                new_files.append({"path": path, "size": facts[0], "sha256": facts[1]} if facts
                                 else {"path": path, "missing": True})
        return Attached(notes=[notes[path] for path in refs], new_files=new_files, overhead=overhead)

    def _note(self, path: str, status: str, text: str) -> FileNote:
        return FileNote(path, status, text, self.count_tokens(text) + 2)

    def _read_one(self, path: str, ref: dict[str, Any] | None,
                  remaining: int) -> tuple[FileNote, tuple[int, str] | None]:
        try:
            resolved = Path(path).resolve()
        except (OSError, RuntimeError):
            resolved = None
        if resolved is None or not self.allowed(resolved):
            return self._note(path, "not_allowed", f"----- {path} (no longer inside the allowed file roots; not shown) -----"), None
        try:
            size = resolved.stat().st_size
            if not resolved.is_file():
                raise FileNotFoundError(path)
            if size > max(remaining, 0) * BYTES_PER_TOKEN_MAX:
                facts = (size, _hash_file(resolved)) if ref is None else None
                return self._omitted(path, size), facts
            data = resolved.read_bytes()
        except OSError:
            return self._note(path, "missing", f"----- {path} (missing) -----"), None
        digest = hashlib.sha256(data).hexdigest()
        facts = (len(data), digest)
        if b"\0" in data[:8192]:
            return self._note(path, "binary", f"----- {path} (binary, {len(data)} bytes; not shown) -----"), facts
        changed = ref is not None and bool(ref.get("sha256")) and ref.get("sha256") != digest
        label = f"{path} (changed since attached)" if changed else path
        text = f"----- {label} -----\n{data.decode('utf-8', 'replace')}\n----- end of {path} -----"
        note = self._note(path, "changed" if changed else "embedded", text)
        if note.tokens > remaining:
            return self._omitted(path, len(data), note.tokens), facts
        return note, facts

    def _omitted(self, path: str, size: int, tokens: int | None = None) -> FileNote:
        about = f"about {tokens} tokens" if tokens else f"{size} bytes"
        return self._note(path, "omitted", f"----- {path} (omitted to fit the token budget: {about}) -----")


def _hash_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
