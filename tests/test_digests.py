"""The chained content digest of each stored exchange: its canonical form, how it is stored and
looked up on both backends, forks continuing their parent's chain, and the JSONL lookup log
rebuilt from the indexes when it is missing or damaged."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import orjson
import pytest

from ksi_common.items import Item, exchange_digest
from ksi_common.records import IndexEntry
from ksi_daemon.daemon import Daemon
from ksi_daemon.storage.jsonl.digest_index import DigestIndex
from ksi_daemon.storage.ports import DigestMatch
from tests.conftest import complete, connected, running_daemon, stub_settings
from tests.stored import stored_index


def user(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": text}


def assistant(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "assistant", "content": text}


def digest_chain(system: str | None, exchanges: list[tuple[list[Item], list[Item]]]) -> list[str]:
    """The digests of consecutive exchanges under one system prompt, each chained to the one before."""
    chain: list[str] = []
    for inputs, outputs in exchanges:
        chain.append(exchange_digest(chain[-1] if chain else None, system, inputs, outputs))
    return chain


def test_whitespace_and_key_order_do_not_change_a_digest() -> None:
    call = {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city": "Oslo", "days": 2}'}
    reordered = {"arguments": '{ "days":2,\n "city":"Oslo" }', "name": "weather", "call_id": "c1",
                 "type": "function_call"}
    first = exchange_digest(None, "Be  brief.", [user("what is\n the weather?")], [call])
    assert exchange_digest(None, " Be brief.\n", [user("what is the weather? ")], [reordered]) == first
    # a reasoning summary and a system message among the inputs are not part of it
    assert exchange_digest(None, "Be brief.", [{"type": "message", "role": "system", "content": "x"},
                                               user("what is the weather?")],
                           [{"type": "reasoning", "summary": "thinking"}, call]) == first


def test_a_digest_covers_its_text_its_system_prompt_and_everything_before() -> None:
    base = digest_chain("S", [([user("a")], [assistant("b")]), ([user("c")], [assistant("d")])])
    assert base != digest_chain("S", [([user("a")], [assistant("b")]), ([user("c")], [assistant("D")])])
    assert base[1] != digest_chain("T", [([user("a")], [assistant("b")]), ([user("c")], [assistant("d")])])[1]
    assert base[1] != digest_chain("S", [([user("A")], [assistant("b")]), ([user("c")], [assistant("d")])])[1]
    assert base[0] == exchange_digest(None, "S", [user("a")], [assistant("b")])
    assert base[1] == exchange_digest(base[0], "S", [user("c")], [assistant("d")])


@pytest.mark.backends
async def test_each_exchange_is_stored_with_its_digest_and_found_by_it(stub_daemon: Daemon) -> None:
    store = stub_daemon.storage.conversations
    async with connected(stub_daemon) as client:
        await complete(client, prompt="one", conversation_id="c1", create=True, system="Be brief.")
        await complete(client, prompt="two", conversation_id="c1")
        expected = digest_chain("Be brief.", [([user("one")], [assistant("stub answer to: one")]),
                                              ([user("two")], [assistant("stub answer to: two")])])
        assert [line["digest"] for line in await stored_index(stub_daemon, "c1")] == expected
        assert await store.find_digest(expected[1]) == [DigestMatch("c1", 2)]

        # a fork continues its parent's chain at its fork point
        await client.request("conversation:fork", {"conversation_id": "c1", "at": 1, "new_id": "f1"})
        await complete(client, prompt="other", conversation_id="f1")
        own = exchange_digest(expected[0], "Be brief.", [user("other")], [assistant("stub answer to: other")])
        assert [line["digest"] for line in await stored_index(stub_daemon, "f1")] == [own]
        assert await store.find_digest(own) == [DigestMatch("f1", 2)]
        assert await store.find_digest(expected[0]) == [DigestMatch("c1", 1)]  # shared, so the parent's

        # an import is chained as the exchanges it writes
        document = {"format": "ksi.conversation", "v": 1, "conversation": {"system": "Be brief."},
                    "exchanges": [{"inputs": [{"type": "user", "content": "one"}],
                                   "reply": {"content": "stub answer to: one"}}]}
        await client.request("conversation:import", {"data": document, "new_id": "i1"})
        assert sorted(await store.find_digest(expected[0]), key=lambda m: m.conversation_id) == [
            DigestMatch("c1", 1), DigestMatch("i1", 1)]

        await client.request("conversation:delete", {"conversation_id": "f1"})
        assert await store.find_digest(own) == []


@pytest.mark.backends
async def test_a_reset_agents_digests_follow_its_moved_conversation(stub_daemon: Daemon) -> None:
    store = stub_daemon.storage.conversations
    async with connected(stub_daemon) as client:
        await client.request("agent:spawn", {"agent_id": "ag1"})
        await complete(client, prompt="remember me", agent_id="ag1")
        digest = (await stored_index(stub_daemon, "ag1"))[0]["digest"]
        reset = await client.request("agent:reset", {"agent_id": "ag1"})
        moved_to = reset["previous_conversation_id"]
        assert await store.find_digest(digest) == [DigestMatch(moved_to, 1)]


async def test_the_jsonl_lookup_log_is_rebuilt_when_missing_or_damaged(short_tmp: Path, stub: Any) -> None:
    async with running_daemon(short_tmp, **stub_settings(stub)) as daemon, connected(daemon) as client:
        for i in range(3):
            await complete(client, prompt=f"hello {i}", conversation_id=f"c{i}", create=True)
        digests = [(await stored_index(daemon, f"c{i}"))[0]["digest"] for i in range(3)]
        log_file = daemon.layout.state_dir / "digests.jsonl"
        assert log_file.read_bytes().count(b"\n") == 4  # its header and one line per exchange
    for damage in ("remove", "header", "torn"):
        if damage == "remove":
            log_file.unlink()
        elif damage == "header":
            log_file.write_bytes(b"not a header\n" + log_file.read_bytes())
        else:
            log_file.write_bytes(log_file.read_bytes() + b'{"d": "abc", "c"')
        async with running_daemon(short_tmp, **stub_settings(stub)) as daemon, connected(daemon) as client:
            store = daemon.storage.conversations
            for i, digest in enumerate(digests):
                assert await store.find_digest(digest) == [DigestMatch(f"c{i}", 1)], damage
            await complete(client, prompt="more", conversation_id="c0")  # appended after a torn line
            second = (await stored_index(daemon, "c0"))[-1]["digest"]
            assert await store.find_digest(second) == [DigestMatch("c0", len(await stored_index(daemon, "c0")))]


def test_a_lookup_line_that_cannot_be_written_never_fails_the_exchange(tmp_path: Path) -> None:
    conversations = tmp_path / "conversations"
    conversations.mkdir()
    entry = IndexEntry(n=1, response_id="r1", digest="ab" * 32)
    (conversations / "c1.jsonl").write_bytes(orjson.dumps(entry.to_record()) + b"\n")
    log_file = tmp_path / "digests.jsonl"
    log_file.symlink_to("/dev/full")  # the write fails (a link is never followed; a full device if it were)
    index = DigestIndex(log_file, conversations)
    index.record("c1", [entry])  # the exchange's index line is written: this must not raise
    assert not log_file.exists() and not log_file.is_symlink()  # dropped: rebuilt from the indexes
    assert index.find("ab" * 32) == [("c1", 1)]
    assert log_file.read_bytes().count(b"\n") == 2


def indexed(conversations: Path, conversation_id: str, digests: list[str]) -> list[IndexEntry]:
    entries = [IndexEntry(n=n, response_id=f"{conversation_id}-r{n}", digest=d) for n, d in enumerate(digests, 1)]
    (conversations / f"{conversation_id}.jsonl").write_bytes(b"".join(orjson.dumps(e.to_record()) + b"\n"
                                                                      for e in entries))
    return entries


def test_the_first_lookup_compacts_the_log_moves_applied_and_deletes_left_out(tmp_path: Path) -> None:
    conversations = tmp_path / "conversations"
    conversations.mkdir()
    log_file = tmp_path / "digests.jsonl"
    index = DigestIndex(log_file, conversations)
    index.prepare()
    index.record("kept", indexed(conversations, "kept", ["aa" * 32, "ab" * 32]))
    index.record("moved", indexed(conversations, "moved", ["aa" * 32, "ac" * 32]))
    index.record("gone", indexed(conversations, "gone", ["aa" * 32, "ad" * 32]))
    index.record("kept", indexed(conversations, "kept", ["aa" * 32, "ab" * 32]))  # noted twice (a replay)
    index.moved("moved", "moved-to")
    index.dropped("gone")
    index.record("gone", indexed(conversations, "gone", ["ae" * 32]))  # the id made anew after its delete
    index.close()
    assert log_file.read_bytes().count(b"\n") == 1 + 8 + 2 + 1
    again = DigestIndex(log_file, conversations)
    assert again.find("aa" * 32) == [("kept", 1), ("moved-to", 1)]
    assert again.find("ac" * 32) == [("moved-to", 2)] and again.find("ad" * 32) == []
    assert again.find("ae" * 32) == [("gone", 1)]
    again.close()
    assert log_file.read_bytes().count(b"\n") == 1 + 5  # its header and one line per live exchange
    third = DigestIndex(log_file, conversations)  # the compacted log reads the same
    assert [third.find(d * 32) for d in ("aa", "ab", "ac", "ad", "ae")] == [
        [("kept", 1), ("moved-to", 1)], [("kept", 2)], [("moved-to", 2)], [], [("gone", 1)]]
    third.close()


def test_appends_go_on_while_the_whole_log_is_rewritten(tmp_path: Path) -> None:
    conversations = tmp_path / "conversations"
    conversations.mkdir()
    indexed(conversations, "old", ["aa" * 32])
    log_file = tmp_path / "digests.jsonl"  # none yet: the first lookup rebuilds it from the indexes
    late = IndexEntry(n=1, response_id="late-r1", digest="bb" * 32)
    appended: list[threading.Thread] = []

    class Rewriting(DigestIndex):
        """An exchange is indexed by another thread while the whole log is being written."""

        def _write(self) -> None:
            thread = threading.Thread(target=self.record, args=("late", [late]))
            thread.start()
            thread.join(timeout=60)  # a safety net: an append that waited for the rewrite never ends
            appended.append(thread)

        def _write_aside(self, *args: Any) -> None:
            self._write()
            super()._write_aside(*args)  # type: ignore[misc]

        def _write_whole(self, *args: Any) -> None:  # the same moment, as the log was once rewritten
            self._write()
            super()._write_whole(*args)  # type: ignore[misc]

    index = Rewriting(log_file, conversations)
    assert index.find("aa" * 32) == [("old", 1)]
    assert len(appended) == 1 and not appended[0].is_alive()  # the append did not wait for the rewrite
    assert index.find("bb" * 32) == [("late", 1)]  # and it is in the table ...
    index.close()
    assert DigestIndex(log_file, conversations).find("bb" * 32) == [("late", 1)]  # ... and in the new log
