"""JSONL metadata that an exchange changed only in its running totals (exchanges, tokens, cost,
last activity, models) is not rewritten for it, until the totals lag by TALLY_LAG_SAVED exchanges
or the daemon stops; the daemon, the inspection readers and a daemon restarted after kill -9 all
see exact totals."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest

from ksi_common.client import KsiClient
from ksi_common.errors import KsiError
from ksi_common.layout import VarLayout
from ksi_common.reading import JsonlReader
from ksi_common.records import IndexEntry
from ksi_daemon.storage.jsonl.conversations import RETRY_DELAY, TALLY_LAG_SAVED
from ksi_daemon.storage.jsonl.storage import JsonlStorage
from ksi_daemon.storage.models import ConversationMeta
from tests.conftest import complete, connected, make_settings, running_daemon, stub_settings
from tests.stub_openai import Reply
from tests.test_crash import DaemonProcess, daemon_env

TALLIES = ("exchanges", "tokens_in", "tokens_out", "cost", "last_activity", "models")
PRICED = "openai/gpt-4o-mini"  # priced in litellm's bundled cost map: the totals include a cost


def tallies(meta: dict[str, Any]) -> dict[str, Any]:
    return {name: meta.get(name) for name in TALLIES}


async def read_with_files(var: Path, conversation_id: str) -> dict[str, Any]:
    (meta,) = await JsonlReader(VarLayout(var)).metas([conversation_id])
    assert meta is not None
    return meta


def on_disk(var: Path, conversation_id: str) -> dict[str, Any]:
    return json.loads(VarLayout(var).meta_file(conversation_id).read_bytes())


async def listed(client: KsiClient, conversation_id: str) -> dict[str, Any]:
    items = (await client.request("conversation:list", {"limit": 1000}))["conversations"]
    return next(item for item in items if item["conversation_id"] == conversation_id)


async def test_totals_wait_but_every_reader_sees_them_exactly(short_tmp: Path, stub: Any) -> None:
    async with running_daemon(short_tmp, **stub_settings(stub)) as daemon, connected(daemon) as client:
        var = daemon.settings.layout.root
        await complete(client, prompt="one", conversation_id="c", create=True)
        created = os.stat(VarLayout(var).meta_file("c"))
        for k in range(2, 5):
            await complete(client, prompt=f"turn {k}", conversation_id="c")
        # the file written when the conversation was created was not replaced by its exchanges...
        assert os.stat(VarLayout(var).meta_file("c")).st_ino == created.st_ino
        assert on_disk(var, "c")["exchanges"] == 0
        # ...yet the daemon and a reader of the files count all four, alike
        daemon_view = (await client.request("conversation:stats", {"conversation_id": "c"}))["conversation"]
        files_view = await read_with_files(var, "c")
        assert daemon_view["exchanges"] == files_view["exchanges"] == (await listed(client, "c"))["exchanges"] == 4
        assert tallies(files_view) == tallies(daemon_view)
        assert files_view["tokens_in"] > 0 and files_view["tokens_out"] > 0

        # when the totals lag by TALLY_LAG_SAVED exchanges the file is rewritten, and only then
        for k in range(5, TALLY_LAG_SAVED):
            await complete(client, prompt=f"turn {k}", conversation_id="c")
        assert os.stat(VarLayout(var).meta_file("c")).st_ino == created.st_ino
        await complete(client, prompt="the one that makes the lag", conversation_id="c")
        assert on_disk(var, "c")["exchanges"] == TALLY_LAG_SAVED
        assert tallies(on_disk(var, "c")) == tallies(await read_with_files(var, "c"))

        # a change beyond the totals is written at once, totals included
        await complete(client, prompt="one more", conversation_id="c")
        await client.request("conversation:update", {"conversation_id": "c", "title": "named"})
        saved = on_disk(var, "c")
        assert saved["title"] == "named" and saved["exchanges"] == TALLY_LAG_SAVED + 1

        await complete(client, prompt="and the last", conversation_id="c")
        expected = tallies(await read_with_files(var, "c"))
    # a clean stop writes what waits
    assert tallies(on_disk(var, "c")) == expected and expected["exchanges"] == TALLY_LAG_SAVED + 2


async def test_totals_survive_kill_9_before_they_were_saved(short_tmp: Path, stub: Any) -> None:
    env = daemon_env(stub.api_base, KSI_MODELS=json.dumps({"openai/stub*": {"api_base": stub.api_base},
                                                           PRICED: {"api_base": stub.api_base}}))
    daemon = DaemonProcess(short_tmp, env)
    await daemon.start()
    async with KsiClient(daemon.socket) as client:
        await complete(client, prompt="start", conversation_id="k", create=True)
        for k, model in enumerate(["openai/stub-model", PRICED, PRICED, "openai/stub-model", PRICED]):
            await complete(client, prompt=f"turn {k}", conversation_id="k", model=model)
        before = await listed(client, "k")
    daemon.kill()  # the file still holds the totals it was created with
    assert on_disk(daemon.var, "k")["exchanges"] == 0
    assert before["exchanges"] == 6 and before["cost"] > 0 and before["models"][-1] == PRICED

    # the inspection readers, daemon stopped, count the lagging exchanges from the records
    files_view = await read_with_files(daemon.var, "k")
    assert tallies(files_view) == tallies(before)

    await daemon.start()
    try:
        async with KsiClient(daemon.socket) as client:
            assert tallies(await listed(client, "k")) == tallies(before)
            shown = await client.request("conversation:stats", {"conversation_id": "k"})
            assert tallies(shown["conversation"]) == tallies(before)
            # the conversation continues with the model it used last, as before the kill
            result = await complete(client, prompt="and now?", conversation_id="k")
            assert result["model"] == PRICED and result["exchange"] == 7
    finally:
        await daemon.stop()
    saved = on_disk(daemon.var, "k")
    assert saved["exchanges"] == 7 and saved["cost"] > before["cost"]


async def test_a_save_that_fails_keeps_the_totals_waiting_and_loses_nothing(tmp_path: Path) -> None:
    storage = JsonlStorage(make_settings(tmp_path, fsync="never"))
    await storage.open()
    layout, store = storage.layout, storage.conversations
    meta = ConversationMeta(conversation_id="c")
    await store.create(meta)
    for n in (1, 2):
        meta = meta.model_copy(update={"exchanges": n, "tokens_in": 10 * n, "models": ["m"]})
        outcome = {"type": "assistant", "content": "ok", "usage": {"prompt_tokens": 10}, "cost": 0.0}
        await store.append_exchange("c", IndexEntry(n=n, response_id=f"r{n}", model="m"),
                                    response=[{"type": "user", "content": "hi"}, outcome], meta=meta)
    spare = layout.meta_file("c").with_name(".c.json.tmp")
    spare.mkdir()  # where the save writes its new version: the write fails (an I/O error)
    await store.close()
    assert on_disk(layout.root, "c")["exchanges"] == 0  # the file kept its last good version
    assert (await store.load_meta("c")) == meta  # the totals still wait in memory
    assert (await read_with_files(layout.root, "c"))["exchanges"] == 2  # and readers count them
    # a later exchange's totals take the place of those waiting: the newest is answered and written
    meta = meta.model_copy(update={"exchanges": 3, "tokens_in": 30})
    entry, lines = exchange(3)
    await store.append_exchange("c", entry, response=lines, meta=meta)
    assert (await store.load_meta("c")) == meta
    spare.rmdir()
    await store.close()  # the next save writes them
    assert on_disk(layout.root, "c")["exchanges"] == 3 and on_disk(layout.root, "c")["tokens_in"] == 30


# -- metadata that could not be written, and a conversation whose first request failed ----------

def exchange(n: int) -> tuple[IndexEntry, list[dict[str, Any]]]:
    outcome = {"type": "assistant", "content": "ok", "usage": {"prompt_tokens": 10}, "cost": 0.0}
    return IndexEntry(n=n, response_id=f"r{n}", model="m"), [{"type": "user", "content": "hi"}, outcome]


async def test_a_metadata_write_that_fails_after_the_exchange_waits_and_is_written_later(
        tmp_path: Path) -> None:
    storage = JsonlStorage(make_settings(tmp_path, fsync="never"))
    await storage.open()
    layout, store = storage.layout, storage.conversations
    await store.create(ConversationMeta(conversation_id="c"))
    spare = layout.meta_file("c").with_name(".c.json.tmp")
    spare.mkdir()  # the metadata's write fails (an I/O error); the exchange is still stored
    after = ConversationMeta(conversation_id="c", system="changed by this exchange", exchanges=1, models=["m"])
    entry, lines = exchange(1)
    await store.append_exchange("c", entry, response=lines, meta=after)
    assert layout.index_file("c").exists() and on_disk(layout.root, "c")["system"] is None
    assert await store.load_meta("c") == after
    spare.rmdir()
    await asyncio.sleep(RETRY_DELAY + 0.3)  # retried: no exchange needed
    assert on_disk(layout.root, "c")["system"] == "changed by this exchange"
    assert on_disk(layout.root, "c")["models"] == ["m"]
    await store.close()


async def test_a_conversation_named_with_create_whose_first_request_failed_exists_after_a_restart(
        short_tmp: Path, stub: Any) -> None:
    # the client chose the id and asked for it to be created: it stays, empty (one the daemon named
    # for the request goes with a failed first turn: test_model_faults)
    stub.enqueue(Reply(status=400, body='{"error": {"message": "refused"}}'))
    settings = stub_settings(stub, retry_attempts=1)
    async with running_daemon(short_tmp, **settings) as daemon, connected(daemon) as client:
        with pytest.raises(KsiError):
            await complete(client, prompt="refused", conversation_id="f", create=True)
        assert (await listed(client, "f"))["exchanges"] == 0
    async with running_daemon(short_tmp, **settings) as daemon, connected(daemon) as client:
        shown = await client.request("conversation:show", {"conversation_id": "f"})
        assert shown["conversation"]["conversation_id"] == "f" and shown["exchanges"] == []
        result = await complete(client, prompt="now", conversation_id="f")
        assert result["exchange"] == 1


async def _store(tmp_path: Path) -> tuple[Any, Path]:
    storage = JsonlStorage(make_settings(tmp_path, fsync="never"))
    await storage.open()
    return storage.conversations, storage.layout.root


async def _append(store: Any, meta: ConversationMeta, n: int) -> ConversationMeta:
    meta = meta.model_copy(update={"exchanges": meta.exchanges + 1, "tokens_in": meta.tokens_in + 10,
                                   "models": ["m"]})
    entry, lines = exchange(n)
    await store.append_exchange(meta.conversation_id, entry, response=lines, meta=meta)
    return meta


async def test_a_file_found_lagging_is_rewritten_when_its_own_lag_reaches_the_limit(tmp_path: Path) -> None:
    killed, var = await _store(tmp_path)
    meta = ConversationMeta(conversation_id="c")
    await killed.create(meta)
    for n in range(1, 6):
        meta = await _append(killed, meta, n)
    # the first store is never closed, as after kill -9: its file holds none of the five
    assert on_disk(var, "c")["exchanges"] == 0
    store, _ = await _store(tmp_path)
    meta = await store.load_meta("c")
    assert meta is not None and meta.exchanges == 5 and meta.tokens_in == 50  # counted from the records
    for n in range(6, TALLY_LAG_SAVED):
        meta = await _append(store, meta, n)
    assert on_disk(var, "c")["exchanges"] == 0  # lags by TALLY_LAG_SAVED - 1
    meta = await _append(store, meta, TALLY_LAG_SAVED)
    assert on_disk(var, "c")["exchanges"] == TALLY_LAG_SAVED
    assert on_disk(var, "c")["tokens_in"] == 10 * TALLY_LAG_SAVED
    await store.close()


async def test_lagging_totals_kept_in_memory_are_bounded_and_a_forgotten_one_is_still_exact(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ksi_daemon.storage.jsonl import conversations

    monkeypatch.setattr(conversations, "REMEMBERED", 4)
    store, var = await _store(tmp_path)
    for i in range(10):
        meta = ConversationMeta(conversation_id=f"c{i}")
        await store.create(meta)
        for n in (1, 2):
            meta = await _append(store, meta, n)
    assert len(store._lagging) <= 4 and len(store._saved) <= 4
    # c0 was forgotten long ago: its file lags, and the store counts the rest from the records
    assert on_disk(var, "c0")["exchanges"] == 0
    forgotten = await store.load_meta("c0")
    assert forgotten is not None and (forgotten.exchanges, forgotten.tokens_in) == (2, 20)
    await store.close()
    assert [on_disk(var, f"c{i}")["exchanges"] for i in range(10)].count(2) >= 4  # written at close
    assert [(await read_with_files(var, f"c{i}"))["exchanges"] for i in range(10)] == [2] * 10
