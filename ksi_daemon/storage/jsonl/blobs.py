"""Content-addressed bytes under `blobs/sha256/`, one file per content named by its hash; the
`BlobStore` port.

A blob is written aside and hard-linked into place (readers see it whole or not at all), never
through a symbolic link: a link at a blob or at one of its directories is `storage_symlink`.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import os
import stat
from pathlib import Path

import structlog

from ksi_common.blob_files import SHA256, stored_hashes
from ksi_common.errors import ErrorCode, KsiError
from ksi_common.layout import VarLayout
from ksi_common.privacy import DIR_MODE
from ksi_daemon.storage.jsonl.files import publish_new, refused_link, replace_file, storage_failures, sync_path
from ksi_daemon.storage.ports import BlobRef, damaged_blob

log = structlog.get_logger("ksi.storage.blobs")


class JsonlBlobs:
    def __init__(self, layout: VarLayout, fsync: bool) -> None:
        self.layout = layout
        self.fsync = fsync

    async def put(self, data: bytes, media_type: str) -> BlobRef:
        return await asyncio.to_thread(self.put_now, data, media_type)

    async def get(self, sha256: str) -> bytes | None:
        return await asyncio.to_thread(self.get_now, sha256)

    async def has(self, sha256: str) -> bool:
        return await asyncio.to_thread(self._has, sha256)

    async def ids(self) -> list[str]:
        return await asyncio.to_thread(self._ids)

    # -- in a worker thread ---------------------------------------------------
    def put_now(self, data: bytes, media_type: str) -> BlobRef:
        digest = hashlib.sha256(data).hexdigest()
        ref = BlobRef(digest, media_type, len(data))
        path = self.layout.blob_file(digest)
        self._directories(path.parent)
        found = _lstat(path)
        if found is not None:
            if stat.S_ISLNK(found.st_mode):
                raise refused_link(path)
            if stat.S_ISREG(found.st_mode) and found.st_size == len(data) and _holds(path, digest):
                return ref  # stored already, whole
            log.warning("blob_repaired", sha256=digest, path=str(path))
            replace_file(path, data, self.fsync)  # damaged (cut or changed by hand, say): stored again whole
            return ref
        try:
            publish_new(path, data, self.fsync)
        except FileExistsError:  # another writer stored the same content meanwhile
            if path.is_symlink():
                raise refused_link(path) from None
        return ref

    def _directories(self, fan_out: Path) -> None:
        """`blobs/`, `blobs/sha256/` and the fan-out directory, each made 0700 when missing (its
        entry synced with fsync on) and never a link."""
        for directory in (fan_out.parent.parent, fan_out.parent, fan_out):
            found = _lstat(directory)
            if found is not None:
                if not stat.S_ISDIR(found.st_mode):
                    raise refused_link(directory) if stat.S_ISLNK(found.st_mode) else KsiError(
                        ErrorCode.STORAGE_ERROR, f"{directory} is not a directory", path=str(directory))
                continue
            with storage_failures():
                try:
                    directory.mkdir(mode=DIR_MODE)
                except FileExistsError:
                    continue
                os.chmod(directory, DIR_MODE)
            if self.fsync:
                sync_path(directory.parent)

    def get_now(self, sha256: str) -> bytes | None:
        if not SHA256.match(sha256):
            return None
        path = self.layout.blob_file(sha256)
        for directory in (path.parent.parent.parent, path.parent.parent, path.parent):
            if directory.is_symlink():
                raise refused_link(directory)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise refused_link(path) from None
            raise KsiError(ErrorCode.STORAGE_ERROR, f"a stored image could not be read: {exc.strerror or exc}",
                           path=str(path)) from None
        with os.fdopen(fd, "rb") as handle:
            data = handle.read()
        if hashlib.sha256(data).hexdigest() != sha256:
            log.warning("blob_damaged", sha256=sha256, path=str(path))
            raise damaged_blob(sha256, str(path))
        return data

    def _has(self, sha256: str) -> bool:
        if not SHA256.match(sha256):
            return False
        found = _lstat(self.layout.blob_file(sha256))
        return found is not None and stat.S_ISREG(found.st_mode)

    def _ids(self) -> list[str]:
        return stored_hashes(self.layout)


def _holds(path: Path, digest: str) -> bool:
    """Whether the blob file's bytes still have their hash (a file that cannot be read does not)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    with os.fdopen(fd, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest() == digest


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None
