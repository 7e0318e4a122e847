"""The exchange log with KSI_FSYNC=always: what a crash of the machine (not of the daemon) may take
from the files before the checkpoint syncs them, the next start writes again from the log; a
record applied twice changes nothing; a torn last record (never acknowledged) is left out."""

from __future__ import annotations

import errno
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from ksi_common import doctor
from ksi_common.errors import KsiError
from ksi_common.records import read_index
from ksi_common.tallies import TALLIES
from ksi_daemon.storage.jsonl.exchange_log import ExchangeLog
from tests.conftest import complete, connected, running_daemon, stub_settings


def not_tallies(meta: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in meta.items() if k not in TALLIES}


def snapshot(var: Path) -> dict[str, bytes]:
    """Every conversation and response file under the var dir, by relative path."""
    found = {}
    for directory in ("logs/conversations", "logs/responses", "state/conversations"):
        for path in sorted((var / directory).glob("*.json*")):
            found[str(path.relative_to(var))] = path.read_bytes()
    return found


async def two_exchanges_and_their_log(short_tmp: Path, stub: Any, kept: Path) -> tuple[dict[str, bytes], list[str]]:
    """Conversation `c` with two exchanges; the log generation that made them durable is copied to
    `kept` before the daemon's last checkpoint drops it. Returns the files and the replies."""
    async with running_daemon(short_tmp, **stub_settings(stub, fsync="always")) as daemon, \
            connected(daemon) as client:
        first = await complete(client, prompt="hello", conversation_id="c", create=True)
        second = await complete(client, prompt="again", conversation_id="c")
        [generation] = daemon.storage.conversations.log.generations()
        shutil.copy(generation, kept)
        var = daemon.settings.layout.root
    assert not list((var / "state" / "exchange-log").iterdir())  # dropped by the checkpoint at stop
    return snapshot(var), [first["content"], second["content"]]


@pytest.mark.parametrize("fsync", ["always", "never"])
async def test_exchanges_lost_with_the_machine_are_written_again_from_the_log(
        short_tmp: Path, stub: Any, fsync: str) -> None:
    kept = short_tmp / "kept.jsonl"
    files, replies = await two_exchanges_and_their_log(short_tmp, stub, kept)
    var = short_tmp / "var"
    # the machine went down before the writes reached the disk: none of the files is left
    # but a torn copy of the second response, and a record half-appended when it went down
    second_response = next(p for p in files if p.startswith("logs/responses/") and b"again" in files[p])
    for path in files:
        (var / path).unlink()
    (var / second_response).write_bytes(files[second_response][:40])
    log = var / "state" / "exchange-log" / "0.jsonl"
    log.write_bytes(kept.read_bytes() + b'{"v": 1, "conversation_id": "c", "entry": {"n": 3, "resp')
    assert doctor.check(var).counts["exchange_log_records"] == 2  # what the next start will write

    async with running_daemon(short_tmp, **stub_settings(stub, fsync=fsync)) as daemon, \
            connected(daemon) as client:
        restored = snapshot(var)
        meta = "state/conversations/c.json"
        # the records and the index byte for byte as they were written; the metadata as created
        # (its totals were saved later: every reader counts them from the index)
        assert {p: b for p, b in restored.items() if p != meta} == {p: b for p, b in files.items() if p != meta}
        assert not_tallies(orjson.loads(restored[meta])) == not_tallies(orjson.loads(files[meta]))
        assert not log.exists()
        third = await complete(client, prompt="third", conversation_id="c")
        assert third["exchange"] == 3
        assert [m["content"] for m in stub.messages()] == ["hello", replies[0], "again", replies[1], "third"]
        shown = await client.request("conversation:show", {"conversation_id": "c"})
        assert [e["n"] for e in shown["exchanges"]] == [1, 2, 3]


async def test_a_record_applied_twice_changes_nothing(short_tmp: Path, stub: Any) -> None:
    kept = short_tmp / "kept.jsonl"
    files, _replies = await two_exchanges_and_their_log(short_tmp, stub, kept)
    var = short_tmp / "var"
    shutil.copy(kept, var / "state" / "exchange-log" / "0.jsonl")  # every file it names is whole
    async with running_daemon(short_tmp, **stub_settings(stub, fsync="always")) as daemon:
        assert snapshot(var) == files
        assert [e.n for e in read_index(daemon.layout.index_file("c"))] == [1, 2]


# -- the log itself -----------------------------------------------------------------------------


def test_a_failed_body_takes_its_record_back_and_a_failed_sync_keeps_the_records(tmp_path: Path) -> None:
    log = ExchangeLog(tmp_path)
    with log.committing("a", {"n": 1}):
        pass
    with pytest.raises(RuntimeError), log.committing("b", {"n": 2}):
        raise RuntimeError("the exchange's files could not be written")
    assert log.records() == [{"id": "a", "n": 1}]  # the failed exchange is never replayed

    def failing_sync(_fd: int) -> None:
        raise OSError(errno.EIO, "I/O error")

    working_sync, log._syncfs = log._syncfs, failing_sync
    with pytest.raises(KsiError) as failed:
        log.checkpoint()
    assert failed.value.code == "storage_error"
    with log.committing("c", {"n": 3}):  # appends go on, to the next generation
        pass
    assert [p.name for p in log.generations()] == ["0.jsonl", "1.jsonl"]
    assert log.records() == [{"id": "a", "n": 1}, {"id": "c", "n": 3}]
    log._syncfs = working_sync
    log.checkpoint()  # both generations covered, both dropped
    assert log.generations() == [] and not log.pending


def test_a_checkpoint_waits_for_exchanges_still_writing_their_files(tmp_path: Path) -> None:
    log = ExchangeLog(tmp_path)
    inside, release = threading.Event(), threading.Event()

    def exchange() -> None:
        with log.committing("a", {"n": 1}):
            inside.set()
            release.wait(10)  # its files are being written

    writer = threading.Thread(target=exchange)
    writer.start()
    assert inside.wait(10)
    checkpoint = threading.Thread(target=log.checkpoint)
    checkpoint.start()
    checkpoint.join(0.3)
    assert checkpoint.is_alive() and log.generations()  # a sync now would miss the exchange's files
    with log.committing("b", {"n": 2}):  # others append meanwhile, to the next generation
        pass
    release.set()
    writer.join(10)
    checkpoint.join(10)
    assert not checkpoint.is_alive()
    assert log.records() == [{"id": "b", "n": 2}]  # only what came after the checkpoint began


def test_checkpoints_at_once_close_each_generation_once(tmp_path: Path) -> None:
    """A delete's checkpoint and the timed one can run together: a descriptor closed twice could
    be another file's by then (the request journal's lines once landed in a metadata file)."""
    log = ExchangeLog(tmp_path / "log")
    (tmp_path / "log").mkdir()
    inside, release = threading.Event(), threading.Event()
    failures: list[BaseException] = []

    def exchange() -> None:
        with log.committing("a", {"n": 1}):
            inside.set()
            release.wait(10)

    def checkpoint() -> None:
        try:
            log.checkpoint()
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            failures.append(exc)

    writer = threading.Thread(target=exchange)
    writer.start()
    assert inside.wait(10)
    both = [threading.Thread(target=checkpoint) for _ in range(2)]
    for thread in both:
        thread.start()
    time.sleep(0.2)  # both wait for the exchange still writing its files
    sentinel = tmp_path / "sentinel"
    release.set()
    writer.join(10)
    for thread in both:
        thread.join(10)
    with open(sentinel, "wb") as handle:  # a descriptor number freed by the checkpoint is reused
        handle.write(b"mine")
    assert failures == [] and log.generations() == [] and sentinel.read_bytes() == b"mine"
