"""Symbolic links inside the var dir are never followed by a write, a chmod or a truncate: the
daemon refuses them (`storage_symlink`, or no start on a linked var/run), `ksi doctor` reports
them (`var_link`) and `--repair` leaves them and their targets alone."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from ksi_cli.main import cli
from ksi_common.errors import KsiError
from ksi_common.layout import VarLayout
from ksi_common.records import IndexEntry
from ksi_daemon.daemon import UnsafeVarDir
from ksi_daemon.storage.jsonl.conversations import JsonlConversations
from ksi_daemon.storage.models import ConversationMeta
from tests.conftest import complete, connected, running_daemon

pytestmark = pytest.mark.backends


@pytest.fixture(autouse=True)
def owner_only_umask() -> Iterator[None]:
    old = os.umask(0o077)
    yield
    os.umask(old)


def doctor(var: Path, *args: str) -> tuple[int, dict[str, Any]]:
    result = CliRunner().invoke(cli, ["doctor", "--json", "--var-dir", str(var), *args])
    return result.exit_code, json.loads(result.output)


def shared_dir(root: Path) -> Path:
    """A directory others share (as /tmp is): sticky, writable by all."""
    shared = root / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    (shared / "someone-elses.txt").write_text("theirs\n")
    return shared


def test_doctor_reports_a_linked_var_run_and_repair_leaves_its_target_alone(short_tmp: Path) -> None:
    shared = shared_dir(short_tmp)
    layout = VarLayout(short_tmp / "var")
    layout.conversations_dir.mkdir(parents=True)
    layout.responses_dir.mkdir(parents=True)
    layout.response_file("r1").write_bytes(b'{"v": 1, "type": "user", "content": "q"}\n'
                                           b'{"v": 1, "type": "assistant", "content": "a"}\n')
    (layout.conversations_dir / "c.jsonl").write_bytes(b'{"v": 1, "n": 1, "response_id": "r1"}\n{"v": 1, "n"')
    layout.run_dir.symlink_to(shared)
    code, report = doctor(layout.root)
    kinds = {(p["kind"], Path(p["path"]).name) for p in report["problems"]}
    assert ("var_link", "run") in kinds and ("torn_tail", "c.jsonl") in kinds
    assert not any(kind == "run_dir_permissions" for kind, _name in kinds)  # the shared dir's mode is not ours
    link = next(p for p in report["problems"] if p["kind"] == "var_link")
    assert link["repairable"] is False and link["extra"]["target"] == str(shared) and code == 1

    code, report = doctor(layout.root, "--repair")
    assert [r["kind"] for r in report["repaired"]] == ["torn_tail"]
    assert [p["kind"] for p in report["problems"]] == ["var_link"] and code == 1
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777
    assert sorted(p.name for p in shared.iterdir()) == ["someone-elses.txt"]  # no lock file made there
    assert layout.run_dir.is_symlink()


def test_doctor_never_truncates_the_target_of_a_linked_index(short_tmp: Path) -> None:
    layout = VarLayout(short_tmp / "var")
    layout.conversations_dir.mkdir(parents=True)
    layout.run_dir.mkdir(mode=0o700)
    outside = short_tmp / "notes.txt"
    outside.write_bytes(b"line one\nno newline at the end")
    outside.chmod(0o644)
    (layout.conversations_dir / "c.jsonl").symlink_to(outside)
    code, report = doctor(layout.root, "--repair")
    assert [(p["kind"], Path(p["path"]).name) for p in report["problems"]] == [("var_link", "c.jsonl")]
    assert report["repaired"] == [] and code == 1
    assert outside.read_bytes() == b"line one\nno newline at the end"
    assert stat.S_IMODE(outside.stat().st_mode) == 0o644


async def test_the_daemon_does_not_start_on_a_linked_var_run(short_tmp: Path, backend: dict[str, Any]) -> None:
    private_elsewhere = short_tmp / "elsewhere"
    private_elsewhere.mkdir()
    private_elsewhere.chmod(0o755)
    layout = VarLayout(short_tmp / "var")
    layout.root.mkdir()
    layout.run_dir.symlink_to(private_elsewhere)
    with pytest.raises(UnsafeVarDir, match="symbolic link"):
        async with running_daemon(short_tmp, socket_path=short_tmp / "d.sock", **backend):
            pass
    assert list(private_elsewhere.iterdir()) == [] and stat.S_IMODE(private_elsewhere.stat().st_mode) == 0o755


async def test_a_linked_index_or_metadata_file_is_refused_and_its_target_untouched(short_tmp: Path) -> None:
    outside = short_tmp / "precious.jsonl"
    outside.write_bytes(b'{"keep": "me"}\n')
    async with running_daemon(short_tmp) as daemon, connected(daemon) as client:
        layout = daemon.settings.layout
        await complete(client, model="echo/x", prompt="one", conversation_id="c", create=True)
        await complete(client, model="echo/x", prompt="one", conversation_id="d", create=True)
        await daemon.storage.conversations.checkpoint()
        index = layout.index_file("c")
        kept = index.read_bytes()
        index.unlink()
        index.symlink_to(outside)
        with pytest.raises(KsiError) as caught:
            await complete(client, model="echo/x", prompt="two", conversation_id="c")
        assert caught.value.code == "storage_symlink"
        assert outside.read_bytes() == b'{"keep": "me"}\n' and index.is_symlink()

        meta = layout.meta_file("d")
        meta.unlink()
        meta.symlink_to(outside)
        with pytest.raises(KsiError) as caught:
            await client.request("conversation:update", {"conversation_id": "d", "title": "renamed"})
        assert caught.value.code == "storage_symlink"
        assert outside.read_bytes() == b'{"keep": "me"}\n' and meta.is_symlink()
    assert kept.count(b"\n") == 1


async def test_the_daemon_does_not_start_on_a_linked_storage_directory(short_tmp: Path) -> None:
    elsewhere = short_tmp / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "c.jsonl").write_bytes(b'{"keep": "me"}\n')
    layout = VarLayout(short_tmp / "var")
    layout.conversations_dir.parent.mkdir(parents=True)
    layout.conversations_dir.symlink_to(elsewhere)
    with pytest.raises(KsiError) as caught:
        async with running_daemon(short_tmp):
            pass
    assert caught.value.code == "storage_symlink" and caught.value.details["path"] == str(layout.conversations_dir)
    assert sorted(p.name for p in elsewhere.iterdir()) == ["c.jsonl"]
    assert (elsewhere / "c.jsonl").read_bytes() == b'{"keep": "me"}\n'


@pytest.mark.parametrize("fsync", [True, False])
async def test_a_linked_response_file_is_refused_not_taken_for_an_earlier_attempt(short_tmp: Path, fsync: bool) -> None:
    """An exclusive create never follows a link, but the file it finds was taken for one an
    earlier attempt of the same append wrote: the exchange was indexed over the link's target."""
    layout = VarLayout(short_tmp / "var")
    for directory in (layout.responses_dir, layout.conversations_dir, layout.conversation_meta_dir,
                      layout.exchange_log_dir):
        directory.mkdir(parents=True)
    store = JsonlConversations(layout, fsync)
    await store.create(ConversationMeta(conversation_id="c"))
    outside = short_tmp / "precious.jsonl"
    outside.write_bytes(b'{"keep": "me"}\n')
    layout.response_file("resp-1").symlink_to(outside)
    try:
        with pytest.raises(KsiError) as caught:
            await store.append_exchange("c", IndexEntry(n=1, response_id="resp-1"),
                                        response=[{"v": 1, "type": "user", "content": "q"},
                                                  {"v": 1, "type": "assistant", "content": "a"}])
        assert caught.value.code == "storage_symlink"
        assert outside.read_bytes() == b'{"keep": "me"}\n'
        assert not layout.index_file("c").exists() and await store.head("c") == 0
    finally:
        await store.close()
    assert store.log.records() == []  # revoked: a replay never writes it either


def test_the_daemon_writes_no_log_through_a_linked_log_dir(short_tmp: Path) -> None:
    elsewhere = short_tmp / "elsewhere"
    elsewhere.mkdir()
    layout = VarLayout(short_tmp / "var")
    layout.logs_dir.mkdir(parents=True)
    layout.daemon_log.parent.symlink_to(elsewhere)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KSI_")}
    finished = subprocess.run([sys.executable, "-m", "ksi_daemon", "--quiet", "--var-dir", str(layout.root),
                               "--socket", str(short_tmp / "d.sock")], env=env, capture_output=True, text=True,
                              timeout=60)
    assert finished.returncode == 2 and "symbolic link" in finished.stderr, finished.stderr
    assert list(elsewhere.iterdir()) == []
