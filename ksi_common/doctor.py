"""Read-only health checks of a var directory: what a crash or a careless hand can leave behind.

Shared by `ksi doctor` and the crash tests; it never writes and never imports the daemon.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ksi_common import http_token
from ksi_common.blob_files import stored_hashes
from ksi_common.exchange_log import logged_exchanges
from ksi_common.jsonl import has_torn_tail, read_records
from ksi_common.layout import VarLayout
from ksi_common.liveness import pid_alive, read_pid, socket_path_state
from ksi_common.privacy import loose_modes
from ksi_common.records import IndexEntry, read_index, read_response


@dataclass(slots=True)
class Finding:
    """One thing found: `kind` is stable (snake_case), `path` the file, `detail` for people."""

    kind: str
    path: str
    detail: str
    repairable: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        if not data["extra"]:
            del data["extra"]
        return data


@dataclass(slots=True)
class Report:
    var_dir: str
    problems: list[Finding] = field(default_factory=list)
    orphans: list[Finding] = field(default_factory=list)  # reported, never counted as problems
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {
            "var_dir": self.var_dir,
            "ok": self.ok,
            "problems": [p.to_dict() for p in self.problems],
            "orphans": [o.to_dict() for o in self.orphans],
            "counts": self.counts,
        }


def _jsonl_files(directory: Path) -> Iterator[Path]:
    """The directory's JSONL files; links are `var_link` findings, never read as files of their own."""
    if directory.is_dir() and not directory.is_symlink():
        yield from sorted(p for p in directory.glob("*.jsonl") if not p.is_symlink())


def check_links(layout: VarLayout) -> list[Finding]:
    """Symbolic links inside the var dir: the daemon refuses to write through them (a write,
    chmod or truncate through one would change its target), and `--repair` leaves them alone."""
    findings: list[Finding] = []
    if not layout.root.is_dir():
        return findings
    for directory, dirnames, filenames in os.walk(layout.root, followlinks=False):
        base = Path(directory)
        for name in sorted([*dirnames, *filenames]):
            path = base / name
            if path.is_symlink():
                target = os.readlink(path)
                findings.append(Finding("var_link", str(path),
                                        f"a symbolic link to {target}; the daemon never writes through one "
                                        "(replace it with the file or directory itself)", extra={"target": target}))
    return findings


def check_run_dir(layout: VarLayout, socket_path: Path | None = None) -> list[Finding]:
    """Permissions of var/run, and a pid file or socket left by a daemon that is gone."""
    findings: list[Finding] = []
    run_dir = layout.run_dir
    # a linked var/run is a var_link finding: what is in its target (a shared directory's mode,
    # files named like ours) is not this var dir's to report or repair
    linked = run_dir.is_symlink()
    if run_dir.is_dir() and not linked:
        mode = stat.S_IMODE(run_dir.stat().st_mode)
        if mode & 0o077:
            findings.append(Finding("run_dir_permissions", str(run_dir),
                                    f"mode {mode:04o}; the daemon wants 0700", True, {"mode": f"{mode:04o}"}))
    pid = None if linked else read_pid(layout)
    if not linked and layout.pid_file.exists() and (pid is None or not pid_alive(pid)):
        findings.append(Finding("stale_pid", str(layout.pid_file),
                                f"pid {pid if pid is not None else '?'} is not running", True, {"pid": pid}))
    sock = socket_path or layout.default_socket
    if linked and sock.parent == run_dir:
        return findings
    state = socket_path_state(sock)
    if state == "foreign":
        findings.append(Finding("socket_path_occupied", str(sock),
                                "not a socket; the daemon will not start on it, and nothing here removes it"))
    elif state == "stale" and (pid is None or not pid_alive(pid)):
        findings.append(Finding("stale_socket", str(sock), "nothing answers on this socket", True))
    return findings


def check_permissions(layout: VarLayout) -> list[Finding]:
    """Directories and files under the var dir that other users may read or enter (var/run has
    its own finding: the daemon refuses to start on a loose one)."""
    return [
        Finding("loose_permissions", str(path), f"mode {mode:04o}; everything here is owner-only", True,
                {"mode": f"{mode:04o}", "wanted": f"{wanted:04o}"})
        for path, mode, wanted in loose_modes(layout.root)
        if path != layout.run_dir
    ]


def check_http_token(layout: VarLayout) -> list[Finding]:
    """A token file left empty or cut (a full disk): the HTTP front would need a new token."""
    path = layout.http_token_file
    try:
        if not path.is_file() or http_token.read(layout) is not None:
            return []
    except http_token.TokenFileError as exc:
        return [Finding("http_token_unusable", str(path), f"{exc}; the daemon cannot start its HTTP front")]
    empty = path.stat().st_size == 0
    return [Finding("http_token_unusable", str(path),
                    ("empty" if empty else "not a usable token") + "; the daemon writes a new one at its next "
                    "start (HTTP clients then need the new one)", extra={"empty": empty})]


def _fork_parents(layout: VarLayout) -> set[str]:
    """Ids of conversations some fork points into (their exchange numbers are referenced)."""
    parents: set[str] = set()
    directory = layout.conversation_meta_dir
    if directory.is_dir():
        for path in directory.glob("*.json"):
            try:
                raw = json.loads(path.read_bytes())
            except (OSError, ValueError):
                continue
            if isinstance(raw, dict) and isinstance(raw.get("parent_id"), str):
                parents.add(raw["parent_id"])
    return parents


def check_numbering(index: Path, entries: list[IndexEntry], forked_from: set[str]) -> Finding | None:
    """Exchange numbers that repeat or go back (two writers, or a failed write counted twice).
    Dropping a line repeated whole is always safe; renumbering is safe when no fork points into
    the conversation (a fork shares exchanges by number)."""
    repeated: list[int] = []
    going_back: list[int] = []
    seen: set[str] = set()
    previous = 0
    for entry in entries:
        if entry.response_id in seen:
            repeated.append(entry.n)
            continue
        seen.add(entry.response_id)
        if entry.n <= previous:
            going_back.append(entry.n)
        previous = max(previous, entry.n)
    if not repeated and not going_back:
        return None
    forked = index.stem in forked_from
    repairable = not going_back or not forked
    detail = []
    if repeated:
        detail.append(f"exchanges {repeated} repeat an earlier line")
    if going_back:
        detail.append(f"exchanges {going_back} are numbered at or below the one before")
        if forked:
            detail.append("forks point into it, so it is not renumbered")
    return Finding("index_numbering", str(index), "; ".join(detail), repairable,
                   {"repeated": repeated, "not_increasing": going_back, "forked": forked})


def check_leftovers(layout: VarLayout) -> list[Finding]:
    """Summaries, or metadata that went through exchanges, of a conversation without an index: a
    background write that outlived its conversation's delete (the id can never be created again)."""
    findings: list[Finding] = []
    for path in _jsonl_files(layout.summaries_dir):
        if not layout.index_file(path.stem).exists():
            findings.append(Finding("summary_without_index", str(path),
                                    f"summaries of conversation {path.stem}, which has no index",
                                    extra={"conversation_id": path.stem}))
    directory = layout.conversation_meta_dir
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
        if layout.index_file(path.stem).exists() or layout.pending_import_file(path.stem).exists():
            continue  # an import whose metadata is written: the next start puts its index in place
        try:
            raw = json.loads(path.read_bytes())
        except (OSError, ValueError):
            continue
        if isinstance(raw, dict) and (raw.get("exchanges") or (raw.get("extra") or {}).get("compaction")):
            findings.append(Finding("metadata_without_index", str(path),
                                    f"conversation {path.stem} counts exchanges or summaries but has no index",
                                    extra={"conversation_id": path.stem}))
    return findings


def blobs_named(lines: list[dict[str, Any]], kinds: tuple[str, ...] = ("image", "file")) -> set[str]:
    """The hashes of the stored bytes a record's parts name (images and files by reference)."""
    named = set()
    for line in lines:
        parts = line.get("parts")
        for part in parts if isinstance(parts, list) else ():
            ref = next((part[kind] for kind in kinds if part.get(kind)), None) if isinstance(part, dict) else None
            if isinstance(ref, dict) and isinstance(ref.get("sha256"), str):
                named.add(ref["sha256"])
    return named


def check(var_dir: Path, socket_path: Path | None = None) -> Report:
    """Every check of the var dir; the files are only read."""
    layout = VarLayout(Path(var_dir))
    report = Report(var_dir=str(layout.root))
    report.problems.extend(check_run_dir(layout, socket_path))
    report.problems.extend(check_permissions(layout))
    report.problems.extend(check_http_token(layout))
    report.problems.extend(check_links(layout))
    report.problems.extend(check_leftovers(layout))

    journal = layout.requests_file
    journal_files = [journal] if journal.is_file() and not journal.is_symlink() else []
    for path in [*_jsonl_files(layout.conversations_dir), *_jsonl_files(layout.responses_dir),
                 *_jsonl_files(layout.consortium_dir), *journal_files]:
        if has_torn_tail(path):
            report.problems.append(Finding("torn_tail", str(path), "the last line has no newline (cut by a crash)",
                                           True))

    referenced: set[str] = set()
    named_blobs: set[str] = set()
    naming: dict[str, str] = {}  # an image's sha256 -> the first record that names it (files are history only)
    indexes = list(_jsonl_files(layout.conversations_dir))
    entries = 0
    forked_from = _fork_parents(layout)
    for index in indexes:
        listed = read_index(index)
        numbering = check_numbering(index, listed, forked_from)
        if numbering is not None:
            report.problems.append(numbering)
        for entry in listed:
            entries += 1
            referenced.add(entry.response_id)
            record = read_response(layout.response_file(entry.response_id))
            if record is not None:
                for sha256 in blobs_named(record.inputs, ("image",)):
                    naming.setdefault(sha256, str(layout.response_file(entry.response_id)))
                named_blobs |= blobs_named(record.inputs)
            if record is None:
                report.problems.append(Finding(
                    "dangling_entry", str(index), f"exchange {entry.n}: response {entry.response_id} is missing",
                    extra={"n": entry.n, "response_id": entry.response_id, "reason": "missing"}))
            elif not record.ok:
                report.problems.append(Finding(
                    "dangling_entry", str(index),
                    f"exchange {entry.n}: response {entry.response_id} has no assistant line",
                    extra={"n": entry.n, "response_id": entry.response_id, "reason": "no_assistant"}))

    responses = 0
    for path in _jsonl_files(layout.responses_dir):
        responses += 1
        if path.stem in referenced:
            continue
        lines = read_records(path)
        for sha256 in blobs_named(lines, ("image",)):
            naming.setdefault(sha256, str(path))
        named_blobs |= blobs_named(lines)
        if any(line.get("type") == "error" for line in lines):
            continue  # a failed request: logged, never indexed
        if any(line.get("run_id") for line in lines):
            continue  # a consortium member or arbiter call
        has_answer = any(line.get("type") == "assistant" for line in lines)
        report.orphans.append(Finding(
            "orphan_response", str(path),
            "not referenced by any index" + ("" if has_answer else " and has no outcome"),
            extra={"has_answer": has_answer}))

    blobs = stored_hashes(layout)
    for sha256 in sorted(set(naming) - set(blobs)):
        report.problems.append(Finding(
            "missing_blob", naming[sha256],
            f"names the stored bytes sha256:{sha256}, which are not in the blob store (a later turn sends "
            "a note in their place)", extra={"sha256": sha256, "blob": str(layout.blob_file(sha256))}))
    for sha256 in blobs:
        if sha256 not in named_blobs:
            report.orphans.append(Finding(
                "unreferenced_blob", str(layout.blob_file(sha256)),
                "stored bytes no response record names (its conversations were deleted, or its request "
                "was refused after its image was stored); kept, never removed by the daemon",
                extra={"sha256": sha256}))

    report.counts = {"indexes": len(indexes), "index_entries": entries, "responses": responses,
                     "blobs": len(blobs), "problems": len(report.problems), "orphans": len(report.orphans),
                     # synced, their files maybe not (a crash of the machine): the next start writes them
                     "exchange_log_records": len(logged_exchanges(layout.exchange_log_dir))}
    return report
