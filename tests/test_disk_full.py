"""Disk full and I/O errors on a real small file system (a tmpfs mounted for the test): the
request fails with storage_full or storage_error, nothing half-written is indexed, the exchange
counter does not move, and the daemon goes on serving reads and, once space returns, writes."""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ksi_common import doctor
from ksi_common.client import KsiClient
from ksi_common.errors import KsiError
from ksi_common.records import read_index
from ksi_daemon.daemon import Daemon
from tests.conftest import complete, connected, running_daemon

SIZE = 4 * 1024 * 1024


@pytest.fixture
def small_fs(short_tmp: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs at short_tmp/var (the var dir), unmounted afterwards."""
    mount = short_tmp / "var"
    mount.mkdir(mode=0o700)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SIZE},mode=0700", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(directory: Path, leave: int) -> Path:
    """Take every free byte of the file system but `leave` (rounded to pages)."""
    filler = directory / "filler"
    with open(filler, "wb", buffering=0) as handle:  # unbuffered: a partial last write is not retried at close
        block = b"\0" * 65536
        try:
            while True:
                handle.write(block)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    stats = os.statvfs(directory)
    assert stats.f_bavail == 0
    if leave:
        os.truncate(filler, max(0, filler.stat().st_size - leave))
    return filler


def numbers(daemon: Daemon, conversation_id: str) -> list[int]:
    return [e.n for e in read_index(daemon.layout.index_file(conversation_id))]


async def failing(client: KsiClient, **data: Any) -> KsiError:
    ack = await client.request("completion:async", data)
    with pytest.raises(KsiError) as caught:
        await client.request("completion:wait", {"request_id": ack["request_id"], "timeout": 30})
    return caught.value


@pytest.mark.parametrize("leave", [0, 4096, 3 * 4096], ids=["none", "one-page", "three-pages"])
async def test_a_full_disk_fails_the_request_and_loses_no_number(small_fs: Path, short_tmp: Path,
                                                                 leave: int) -> None:
    async with running_daemon(short_tmp, socket_path=short_tmp / "d.sock") as daemon, \
            connected(daemon) as client:
        first = await complete(client, prompt="first", model="echo/x", conversation_id="c", create=True)
        filler = fill(small_fs, leave)
        ack = await client.request("completion:async", {"prompt": "second " + "x" * 6000, "model": "echo/x",
                                                        "conversation_id": "c"})
        frame = await client.send_frame("completion:wait", {"request_id": ack["request_id"], "timeout": 30})
        # failed with a storage code and not indexed, or done and indexed: never both, never internal
        if "error" in frame:
            assert frame["error"]["code"] == "storage_full", frame
            assert numbers(daemon, "c") == [1]
        else:
            assert numbers(daemon, "c") == [1, 2]
        second_done = "error" not in frame
        if leave == 0:
            assert not second_done  # not even its response file fits
        # reads go on
        shown = await client.request("conversation:show", {"conversation_id": "c"})
        assert shown["exchanges"][0]["response_id"] == first["response_id"]
        assert (await client.request("system:health"))["status"] == "healthy"
        # space returns: the next exchange gets the next number and sees what was indexed only
        filler.unlink()
        third = await complete(client, prompt="third", model="echo/x", conversation_id="c")
        assert numbers(daemon, "c") == ([1, 2, 3] if second_done else [1, 2])
        assert "first" in third["content"] and ("second" in third["content"]) == second_done
    report = doctor.check(small_fs)
    assert [p.kind for p in report.problems if p.kind != "loose_permissions"] == []


async def test_a_read_only_file_system_is_a_storage_error(small_fs: Path, short_tmp: Path) -> None:
    async with running_daemon(short_tmp, socket_path=short_tmp / "d.sock") as daemon, \
            connected(daemon) as client:
        await complete(client, prompt="first", model="echo/x", conversation_id="c", create=True)
        # the directories new files go to, read-only (bind mounts: the daemon keeps files open elsewhere)
        frozen = [daemon.layout.responses_dir, daemon.layout.conversation_meta_dir]
        for directory in frozen:
            subprocess.run(["mount", "--bind", str(directory), str(directory)], check=True)
            subprocess.run(["mount", "-o", "remount,bind,ro", str(directory)], check=True)
        try:
            error = await failing(client, prompt="second", model="echo/x", conversation_id="c")
            assert error.code == "storage_error", error
            assert numbers(daemon, "c") == [1]
            # its exchange log record was taken back: a replay after a crash cannot bring it back
            assert [r["entry"]["n"] for r in daemon.storage.conversations.log.records()] in ([], [1])
            refused = await client.send_frame("conversation:fork", {"conversation_id": "c", "new_id": "f"})
            assert refused["error"]["code"] == "storage_error", refused
        finally:
            for directory in frozen:
                subprocess.run(["umount", str(directory)], check=True)
        third = await complete(client, prompt="third", model="echo/x", conversation_id="c")
        assert numbers(daemon, "c") == [1, 2]
        assert "first" in third["content"]
