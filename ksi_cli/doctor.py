"""`ksi doctor`: check a var directory for what crashes leave behind, and repair what is safe."""

from __future__ import annotations

import errno
import json
import os
import stat
import sys
from pathlib import Path
from typing import Any

import click

from ksi_cli.options import VAR_DIR_HELP
from ksi_cli.output import EXIT_ERROR, EXIT_OK, fail, wants_json
from ksi_common import doctor as checks
from ksi_common.errors import KsiError
from ksi_common.liveness import read_pid, socket_answers, socket_path_state
from ksi_common.locate import Location, locate
from ksi_common.records import parse_index_line
from ksi_common.storage_backends import needs_url

_BLOCK = 64 * 1024


def truncate_torn_tail(path: Path) -> int:
    """Cut `path` after its last newline (the writer does the same on its next append); bytes cut."""
    # never through a link: its target is not a file of this var dir
    with os.fdopen(os.open(path, os.O_RDWR | os.O_NOFOLLOW), "r+b") as handle:
        size = handle.seek(0, os.SEEK_END)
        position = size
        keep = 0
        while position > 0:
            start = max(0, position - _BLOCK)
            handle.seek(start)
            chunk = handle.read(position - start)
            newline = chunk.rfind(b"\n")
            if newline >= 0:
                keep = start + newline + 1
                break
            position = start
        handle.truncate(keep)
        handle.flush()
        os.fsync(handle.fileno())
    return size - keep


def renumber_index(path: Path, renumber: bool) -> str:
    """Drop lines that repeat an earlier exchange whole, then (when `renumber`) number the rest
    in file order from the first one's number; the file is replaced atomically."""
    raw_lines = [line for line in path.read_bytes().split(b"\n") if line.strip()]
    kept: list[dict[str, Any]] = []
    seen: set[str] = set()
    dropped = 0
    for number, raw in enumerate(raw_lines, start=1):
        entry = parse_index_line(raw, number)
        if entry is None:
            continue
        if entry.response_id in seen:
            dropped += 1
            continue
        seen.add(entry.response_id)
        record = json.loads(raw) if raw.lstrip().startswith(b"{") else {"v": 1, "response_id": entry.response_id}
        record["n"] = entry.n
        kept.append(record)
    renumbered = 0
    if renumber and kept:
        start = kept[0]["n"]
        for offset, record in enumerate(kept):
            if record["n"] != start + offset:
                record["n"] = start + offset
                renumbered += 1
    tmp = path.with_name(f".{path.name}.repair")
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600), "wb") as handle:
        handle.write(b"".join(json.dumps(r, ensure_ascii=False).encode() + b"\n" for r in kept))
    os.chmod(tmp, stat.S_IMODE(path.stat().st_mode))
    with open(tmp, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    return f"dropped {dropped} repeated lines, renumbered {renumbered} exchanges"


def chmod_unlinked(path: Path, mode: int) -> bool:
    """chmod `path` itself, never the target of a link put there since it was checked: opened
    without following one, then changed through the descriptor. False when it is a link or gone."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return False
    except PermissionError:  # a file its owner may not read: a descriptor that only names it
        try:
            named = os.open(path, os.O_PATH | os.O_NOFOLLOW)
        except OSError:
            return False
        try:
            if stat.S_ISLNK(os.fstat(named).st_mode):
                return False
            os.chmod(f"/proc/self/fd/{named}", mode)  # the file named, not a link put there since
            return True
        finally:
            os.close(named)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return False
        raise
    try:
        os.fchmod(fd, mode)
    finally:
        os.close(fd)
    return True


def hold_var_dir(location: Location) -> tuple[str | None, Any]:
    """Take the daemon's lock so none starts during a repair: (None, lock), or (why not, None)
    when a daemon runs on this var dir (its socket answers or it holds the lock)."""
    layout = location.layout
    if socket_answers(location.socket):
        return f"a daemon answers on {location.socket}", None
    if not layout.run_dir.is_dir() or layout.run_dir.is_symlink() or layout.lock_file.is_symlink():
        return None, None  # the daemon refuses to start on a linked var/run or lock file, and the lock would truncate its target
    import filelock

    lock = filelock.FileLock(str(layout.lock_file), mode=0o600)
    try:
        lock.acquire(timeout=0)
    except filelock.Timeout:
        pid = read_pid(layout)
        return f"a daemon (pid {pid if pid is not None else '?'}) holds {layout.lock_file}", None
    return None, lock


def repair(report: checks.Report) -> list[dict[str, Any]]:
    """Fix the repairable problems of `report`; never deletes a response file or an index line."""
    done: list[dict[str, Any]] = []
    for problem in report.problems:
        if not problem.repairable:
            continue
        path = Path(problem.path)
        if problem.kind in ("run_dir_permissions", "loose_permissions"):
            wanted = int(problem.extra.get("wanted", "0700"), 8)
            if not chmod_unlinked(path, wanted):  # replaced by a link (or removed) since the check
                continue
            done.append({"kind": problem.kind, "path": str(path), "action": f"chmod {wanted:04o}"})
        elif problem.kind == "index_numbering":
            action = renumber_index(path, renumber=not problem.extra.get("forked"))
            done.append({"kind": problem.kind, "path": str(path), "action": action})
        elif problem.kind == "torn_tail":
            cut = truncate_torn_tail(path)
            done.append({"kind": problem.kind, "path": str(path), "action": f"truncated {cut} torn bytes"})
        elif problem.kind in ("stale_pid", "stale_socket"):
            if problem.kind == "stale_socket" and socket_path_state(path) != "stale":
                continue  # it came alive or was replaced meanwhile: not ours to remove
            try:
                path.unlink()
            except FileNotFoundError:
                pass
            done.append({"kind": problem.kind, "path": str(path), "action": "removed"})
    return done


def _print_report(report: checks.Report, repaired: list[dict[str, Any]], location: Location) -> None:
    click.secho(f"var dir: {report.var_dir}", bold=True)
    if needs_url(location.storage):
        # the database keeps its own rows whole (keys, transactions); what is checked here is what
        # the daemon still keeps in its var dir: socket, pid, logs, request journal, modes
        click.echo(f"  conversations and agents are in {location.describe_storage()}: not checked here")
    counts = report.counts
    click.echo(f"  {counts.get('indexes', 0)} indexes, {counts.get('index_entries', 0)} exchanges, "
               f"{counts.get('responses', 0)} response files")
    if counts.get("exchange_log_records"):
        click.echo(f"  {counts['exchange_log_records']} exchanges wait in the exchange log "
                   "(the daemon's next start writes to their files whatever they lack)")
    for item in repaired:
        click.secho(f"  repaired  {item['kind']:<20} {item['path']}: {item['action']}", fg="green")
    for problem in report.problems:
        hint = "  (--repair fixes it)" if problem.repairable else ""
        click.secho(f"  problem   {problem.kind:<20} {problem.path}: {problem.detail}{hint}", fg="red")
    for orphan in report.orphans:
        click.secho(f"  orphan    {orphan.kind:<20} {orphan.path}: {orphan.detail}", fg="yellow")
    if report.ok:
        click.secho("  ok: no problems" + (f" ({len(report.orphans)} orphans, reported only)"
                                          if report.orphans else ""), fg="green")


@click.command()
@click.option("--var-dir", help=VAR_DIR_HELP)
@click.option("--socket", "socket_path", help="Unix socket of the daemon (default var/run/daemon.sock).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON even on a terminal.")
@click.option("--repair", "repair_flag", is_flag=True,
              help="Fix what is safe: cut torn last lines, remove a stale pid file or socket, chmod var/run 0700.")
def doctor(var_dir: str | None, socket_path: str | None, as_json: bool, repair_flag: bool) -> None:
    """Check the var directory: permissions, torn lines, dangling or orphan entries, stale pid/socket.

    Exit 0 when no problem is left, 1 otherwise. Orphan response files are reported, never removed;
    --repair refuses to run while a daemon uses the var directory.
    """
    location = locate(var_dir, socket_path)
    if not location.var_dir.is_dir():
        fail(KsiError("var_dir_missing", f"no var directory at {location.var_dir}",
                      var_dir=str(location.var_dir)), as_json)
    report = checks.check(location.var_dir, location.socket)
    repaired: list[dict[str, Any]] = []
    if repair_flag and any(p.repairable for p in report.problems):
        running, lock = hold_var_dir(location)
        if running is not None:
            fail(KsiError("daemon_running", f"refusing to repair while {running}; stop it first",
                          var_dir=str(location.var_dir)), as_json)
        try:
            repaired = repair(report)
        finally:
            if lock is not None:
                lock.release()
        report = checks.check(location.var_dir, location.socket)
    if wants_json(as_json):
        click.echo(json.dumps({**report.to_dict(), "storage": location.storage, "repaired": repaired},
                              ensure_ascii=False))
    else:
        _print_report(report, repaired, location)
    sys.exit(EXIT_OK if report.ok else EXIT_ERROR)
