"""Owner-only modes under the var dir (directories 0700, files 0600), whatever the umask."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

DIR_MODE = 0o700
FILE_MODE = 0o600
# the daemon's umask: whatever it or a library creates is private from the start
OWNER_ONLY_UMASK = 0o077


def private_dir(path: Path) -> None:
    """Create `path` and its missing parents, each 0700; an existing directory is left as it is."""
    missing = []
    current = path
    while not current.exists():
        missing.append(current)
        if current.parent == current:
            break
        current = current.parent
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=DIR_MODE)
        except FileExistsError:
            continue
        os.chmod(directory, DIR_MODE)  # mkdir's mode passes through the umask


def open_private(path: Path, flags: int) -> int:
    """os.open for a file that, when created, is at most 0600 (the umask only takes bits away);
    never through a symbolic link at `path` (ELOOP)."""
    return os.open(path, flags | os.O_NOFOLLOW, FILE_MODE)


def loose_modes(root: Path) -> Iterator[tuple[Path, int, int]]:
    """(path, mode, wanted mode) of every directory and file under `root` (itself included)
    that others may read, write or enter; symbolic links are neither followed nor reported."""
    for directory, dirnames, filenames in os.walk(root, followlinks=False):
        base = Path(directory)
        mode = stat.S_IMODE(os.lstat(base).st_mode)
        if mode & 0o077:
            yield base, mode, mode & 0o700
        for name in filenames:
            path = base / name
            try:
                info = os.lstat(path)
            except FileNotFoundError:
                continue
            if stat.S_ISLNK(info.st_mode):
                continue
            mode = stat.S_IMODE(info.st_mode)
            if mode & 0o077:
                yield path, mode, mode & 0o700
        dirnames[:] = [d for d in dirnames if not (base / d).is_symlink()]
