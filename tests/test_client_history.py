"""Continuity for stateless clients: completion:async with `history` (the client's own earlier
turns) finds the stored conversation they belong to, on both backends, through real litellm to
the local stub."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from ksi_common.errors import KsiError
from ksi_daemon.daemon import Daemon
from tests.conftest import complete, connected, running_daemon, stub_settings
from tests.stored import stored_index, stored_meta, stored_snapshot

pytestmark = pytest.mark.backends


def turns(*pairs: tuple[str, str], system: str | None = None) -> list[dict[str, Any]]:
    """A client-held history: (user, assistant) pairs as chat-style items."""
    history: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    for user, assistant in pairs:
        history += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    return history


def answer(prompt: str) -> str:
    return f"stub answer to: {prompt}"


async def stored_turns(client: Any, conversation_id: str, prompts: list[str], system: str | None = None) -> None:
    for position, prompt in enumerate(prompts):
        data: dict[str, Any] = {"prompt": prompt, "conversation_id": conversation_id}
        if position == 0:
            data["create"] = True
            if system is not None:
                data["system"] = system
        await complete(client, **data)


async def conversation_ids(client: Any) -> set[str]:
    listing = await client.request("conversation:list", {"limit": 1000})
    return {c["conversation_id"] for c in listing["conversations"]}


async def test_a_history_that_matches_continues_its_conversation(stub_daemon: Daemon, stub: Any) -> None:
    async with connected(stub_daemon) as client:
        await stored_turns(client, "c1", ["p1", "p2", "p3"], system="Be brief.")
        history = turns(("p1", answer("p1")), ("p2", answer("p2")), ("p3", answer("p3")), system="Be brief.")
        result = await complete(client, prompt="p4", history=history)
        assert result["conversation_id"] == "c1" and result["exchange"] == 4
        assert result["history"]["source"] == "client"  # it fitted: the client's own turns were sent
        assert [(m["role"], m["content"]) for m in stub.messages()] == [
            ("system", "Be brief."), ("user", "p1"), ("assistant", answer("p1")), ("user", "p2"),
            ("assistant", answer("p2")), ("user", "p3"), ("assistant", answer("p3")), ("user", "p4")]
        assert await conversation_ids(client) == {"c1"}
        # and the next turn, with the longer history, continues it again
        result = await complete(client, prompt="p5", history=[*history, {"role": "user", "content": "p4"},
                                                              {"role": "assistant", "content": answer("p4")}])
        assert result["conversation_id"] == "c1" and result["exchange"] == 5
        assert len(await stored_index(stub_daemon, "c1")) == 5


async def test_whitespace_changes_still_match(stub_daemon: Daemon) -> None:
    async with connected(stub_daemon) as client:
        await stored_turns(client, "c1", ["tell me\nabout  cats", "more"])
        history = [{"role": "user", "content": "  tell me about\tcats "},
                   {"role": "assistant", "content": answer("tell me\nabout  cats") + "\n"},
                   {"role": "user", "content": [{"type": "input_text", "text": "more"}]},
                   {"role": "assistant", "content": [{"type": "output_text", "text": " " + answer("more")}]}]
        result = await complete(client, prompt="and dogs", history=history)
        assert result["conversation_id"] == "c1" and result["exchange"] == 3


async def test_a_history_diverging_at_exchange_2_of_4_continues_a_fork(stub_daemon: Daemon, stub: Any) -> None:
    async with connected(stub_daemon) as client:
        await stored_turns(client, "c1", ["p1", "p2", "p3", "p4"])
        before = await stored_index(stub_daemon, "c1")
        history = turns(("p1", answer("p1")), ("other", "a reply edited by the client"),
                        ("p3", answer("p3")), ("p4", answer("p4")))
        result = await complete(client, prompt="p5", history=history)
        fork = result["conversation_id"]
        assert fork != "c1" and result["exchange"] == 5
        meta = await stored_meta(stub_daemon, fork) or {}
        assert (meta["parent_id"], meta["fork_at"]) == ("c1", 1)  # copy-free: exchange 1 is shared
        shown = await client.request("conversation:show", {"conversation_id": fork})
        assert [e["n"] for e in shown["exchanges"]] == [1, 2, 3, 4, 5]
        assert [e["inputs"][0]["content"] for e in shown["exchanges"]] == ["p1", "other", "p3", "p4", "p5"]
        assert await stored_index(stub_daemon, "c1") == before  # the original is untouched
        # the fork's own exchanges carry the chain on: the next turn of this history continues it
        grown = [*history, {"role": "user", "content": "p5"}, {"role": "assistant", "content": answer("p5")}]
        again = await complete(client, prompt="p6", history=grown)
        assert again["conversation_id"] == fork and again["exchange"] == 6


async def test_a_history_ending_at_an_older_exchange_forks_there(stub_daemon: Daemon) -> None:
    async with connected(stub_daemon) as client:
        await stored_turns(client, "c1", ["p1", "p2", "p3"])
        result = await complete(client, prompt="instead", history=turns(("p1", answer("p1")), ("p2", answer("p2"))))
        meta = await stored_meta(stub_daemon, result["conversation_id"]) or {}
        assert (meta["parent_id"], meta["fork_at"], result["exchange"]) == ("c1", 2, 3)
        assert len(await stored_index(stub_daemon, "c1")) == 3


async def test_a_changed_system_prompt_starts_a_new_conversation(stub_daemon: Daemon) -> None:
    async with connected(stub_daemon) as client:
        await stored_turns(client, "c1", ["p1", "p2"], system="Be brief.")
        history = turns(("p1", answer("p1")), ("p2", answer("p2")), system="Be verbose.")
        result = await complete(client, prompt="p3", history=history)
        assert result["conversation_id"] != "c1" and result["exchange"] == 3
        meta = await stored_meta(stub_daemon, result["conversation_id"]) or {}
        assert meta.get("parent_id") is None and meta["system"] == "Be verbose."
        assert len(await stored_index(stub_daemon, "c1")) == 2


async def test_no_match_imports_the_history_and_the_next_turn_finds_it(stub_daemon: Daemon, stub: Any) -> None:
    async with connected(stub_daemon) as client:
        history = turns(("hello", "hi there"))
        first = await complete(client, prompt="how are you", history=history)
        assert first["exchange"] == 2
        grown = [*history, {"role": "user", "content": "how are you"},
                 {"role": "assistant", "content": answer("how are you")}]
        second = await complete(client, prompt="bye", history=grown)
        assert second["conversation_id"] == first["conversation_id"] and second["exchange"] == 3
        assert await conversation_ids(client) == {first["conversation_id"]}


async def test_a_match_only_in_an_archived_conversation_starts_a_linked_one(stub_daemon: Daemon) -> None:
    async with connected(stub_daemon) as client:
        await stored_turns(client, "c1", ["p1", "p2"])
        await client.request("conversation:archive", {"conversation_id": "c1"})
        result = await complete(client, prompt="p3", history=turns(("p1", answer("p1")), ("p2", answer("p2"))))
        assert result["conversation_id"] != "c1" and result["exchange"] == 3
        meta = await stored_meta(stub_daemon, result["conversation_id"]) or {}
        assert meta["extra"]["continues"] == {"conversation_id": "c1", "exchange": 2}
        assert meta.get("parent_id") is None
        assert len(await stored_index(stub_daemon, "c1")) == 2


async def test_an_expired_conversation_is_not_continued_either(stub_daemon: Daemon) -> None:
    async with connected(stub_daemon) as client:
        await stored_turns(client, "c1", ["p1"])
        await client.request("conversation:update", {"conversation_id": "c1", "ttl": 0.01})
        await asyncio.sleep(0.05)  # past its time to live
        result = await complete(client, prompt="p2", history=turns(("p1", answer("p1"))))
        meta = await stored_meta(stub_daemon, result["conversation_id"]) or {}
        assert result["conversation_id"] != "c1"
        assert meta["extra"]["continues"] == {"conversation_id": "c1", "exchange": 1}


async def test_a_full_conversation_is_not_continued_either(stub_daemon: Daemon) -> None:
    async with connected(stub_daemon) as client:
        await stored_turns(client, "c1", ["p1", "p2"])
        await client.request("conversation:update", {"conversation_id": "c1", "turn_cap": 2})
        result = await complete(client, prompt="p3", history=turns(("p1", answer("p1")), ("p2", answer("p2"))))
        meta = await stored_meta(stub_daemon, result["conversation_id"]) or {}
        assert result["conversation_id"] != "c1" and meta["extra"]["continues"]["conversation_id"] == "c1"


async def test_a_thousand_conversations_sharing_the_first_turn(stub_daemon: Daemon) -> None:
    async with connected(stub_daemon) as client:
        for i in range(1000):
            document = {"format": "ksi.conversation", "v": 1, "conversation": {"system": None}, "exchanges": [
                {"inputs": [{"type": "user", "content": "hello"}], "reply": {"content": "hi"}},
                {"inputs": [{"type": "user", "content": f"I am number {i}"}], "reply": {"content": f"noted {i}"}}]}
            await client.request("conversation:import", {"data": document, "new_id": f"c{i}"})
        result = await complete(client, prompt="who am I?",
                                history=turns(("hello", "hi"), ("I am number 737", "noted 737")))
        assert result["conversation_id"] == "c737" and result["exchange"] == 3
        # one diverging after their second exchange forks number 738 there, loading only it (the
        # digest of exchange 2 names it) and the fork, not the 1,000 sharing the first exchange
        store = stub_daemon.cache.store
        loaded: list[str] = []

        class CountingLoads(type(store)):  # type: ignore[misc]
            async def load_meta(self, conversation_id: str) -> Any:
                loaded.append(conversation_id)
                return await super().load_meta(conversation_id)

        store.__class__ = CountingLoads
        try:
            forked = await complete(client, prompt="and now?", history=turns(
                ("hello", "hi"), ("I am number 738", "noted 738"), ("a turn 738 never had", "its reply")))
        finally:
            store.__class__ = CountingLoads.__bases__[0]
        meta = await stored_meta(stub_daemon, forked["conversation_id"]) or {}
        assert (meta["parent_id"], meta["fork_at"], forked["exchange"]) == ("c738", 2, 4)
        assert len(set(loaded)) <= 3, loaded  # c738 and the fork (the others are never read)
        # the same whole history in several conversations: the one where it is the newest exchange,
        # then the most recently active
        twin = {"format": "ksi.conversation", "v": 1, "conversation": {"system": None}, "exchanges": [
            {"inputs": [{"type": "user", "content": "hello"}], "reply": {"content": "hi"}},
            {"inputs": [{"type": "user", "content": "twins"}], "reply": {"content": "yes"}}]}
        for name in ("moved-on", "older", "newer"):
            await client.request("conversation:import", {"data": twin, "new_id": name})
        await complete(client, prompt="moved on", conversation_id="moved-on")  # the most recent, not newest there
        result = await complete(client, prompt="which?", history=turns(("hello", "hi"), ("twins", "yes")))
        assert result["conversation_id"] == "newer"  # "older" holds it as its newest too, but less recently


async def test_a_history_contradicting_previous_response_id_is_refused(stub_daemon: Daemon) -> None:
    async with connected(stub_daemon) as client:
        await stored_turns(client, "c1", ["p1", "p2", "p3"])
        second = (await stored_index(stub_daemon, "c1"))[1]["response_id"]
        before = await stored_snapshot(stub_daemon.settings)
        with pytest.raises(KsiError) as refused:
            await client.request("completion:async", {
                "prompt": "p3 again", "previous_response_id": second,
                "history": turns(("p1", answer("p1")), ("p2 edited", answer("p2")))})
        assert refused.value.code == "history_mismatch"
        assert refused.value.details["exchange"] == 2 and refused.value.details["conversation_id"] == "c1"
        assert await stored_snapshot(stub_daemon.settings) == before  # nothing written
        # the same history, unedited, is accepted: it continues after that response (a fork at 2)
        result = await complete(client, prompt="p3 again", previous_response_id=second,
                                history=turns(("p1", answer("p1")), ("p2", answer("p2"))))
        assert result["exchange"] == 3 and result["conversation_id"] != "c1"


async def test_a_history_contradicting_conversation_id_is_refused(stub_daemon: Daemon) -> None:
    async with connected(stub_daemon) as client:
        await stored_turns(client, "c1", ["p1", "p2"])
        before = await stored_snapshot(stub_daemon.settings)
        for history, k in ((turns(("p1", answer("p1"))), 2),  # shorter: the conversation has more
                           (turns(("p1", "not what was said"), ("p2", answer("p2"))), 1)):
            with pytest.raises(KsiError) as refused:
                await client.request("completion:async", {"prompt": "p3", "conversation_id": "c1",
                                                           "history": history})
            assert refused.value.code == "history_mismatch" and refused.value.details["exchange"] == k
        assert await stored_snapshot(stub_daemon.settings) == before
        result = await complete(client, prompt="p3", conversation_id="c1",
                                history=turns(("p1", answer("p1")), ("p2", answer("p2"))))
        assert result["conversation_id"] == "c1" and result["exchange"] == 3


async def test_a_conversation_created_by_id_starts_with_the_history(stub_daemon: Daemon) -> None:
    async with connected(stub_daemon) as client:
        history = turns(("a", "b"), system="Be brief.")
        result = await complete(client, prompt="c", conversation_id="mine", create=True, history=history)
        assert result["conversation_id"] == "mine" and result["exchange"] == 2
        meta = await stored_meta(stub_daemon, "mine") or {}
        assert meta["system"] == "Be brief."
        again = await complete(client, prompt="d", conversation_id="mine",
                               history=[*history, {"role": "user", "content": "c"},
                                        {"role": "assistant", "content": answer("c")}])
        assert again["exchange"] == 3


async def test_a_history_that_does_not_fit_sends_the_stored_rebuild(short_tmp: Any, stub: Any,
                                                                    backend: dict[str, Any]) -> None:
    settings = stub_settings(stub, models={"openai/stub-small": {"api_base": stub.api_base, "context_window": 400,
                                                                  "output_reserve": 50}})
    async with running_daemon(short_tmp, **settings, **backend) as daemon, connected(daemon) as client:
        prompts = [f"turn {i} " + "words " * 30 for i in range(6)]
        await stored_turns(client, "c1", prompts[:1])
        for prompt in prompts[1:]:
            await complete(client, prompt=prompt, conversation_id="c1", model="openai/stub-small")
        history = turns(*((p, answer(p)) for p in prompts))
        result = await complete(client, prompt="last", history=history, model="openai/stub-small")
        assert result["conversation_id"] == "c1"
        assert result["history"]["source"] == "stored" and result["history"]["exchanges_sent"] < 6
        assert "summary_upto" in result["history"]  # KSI's budgeted rebuild, with its summary


async def test_bad_histories_are_refused_before_anything_is_written(stub_daemon: Daemon) -> None:
    async with connected(stub_daemon) as client:
        before = await stored_snapshot(stub_daemon.settings)
        for history, where in (
            ([{"role": "user", "content": "no reply"}], "history.0"),
            ([{"role": "assistant", "content": "a reply to nothing"}], "history.0.role"),
            ([*turns(("a", "b")), {"role": "system", "content": "late"}], "history.2.role"),
            ([{"type": "item_reference", "id": "x"}], "history.0.type"),
            ([{"role": "robot", "content": "x"}], "history.0.role"),
            ([{"role": "user", "content": " "}, {"role": "assistant", "content": "x"}], "history.0.content"),
        ):
            with pytest.raises(KsiError) as refused:
                await client.request("completion:async", {"prompt": "new", "history": history})
            assert refused.value.code == "validation_error" and where in refused.value.details["fields"]
        assert await stored_snapshot(stub_daemon.settings) == before


async def test_exchanges_stored_before_digests_are_never_matched(short_tmp: Path, stub: Any) -> None:
    async with running_daemon(short_tmp, **stub_settings(stub)) as daemon, connected(daemon) as client:
        await complete(client, prompt="old", conversation_id="c1", create=True)
        index = daemon.layout.index_file("c1")
    # the index line as it was written before digests existed
    index.write_text(index.read_text().replace(',"digest":"', ',"x":"'))
    (daemon.layout.state_dir / "digests.jsonl").unlink()
    async with running_daemon(short_tmp, **stub_settings(stub)) as daemon, connected(daemon) as client:
        await complete(client, prompt="new", conversation_id="c1")
        assert "digest" not in (await stored_index(daemon, "c1"))[-1]  # the chain is broken: no digest after
        history = [{"role": "user", "content": "old"}, {"role": "assistant", "content": "stub answer to: old"}]
        result = await complete(client, prompt="again", history=history)
        assert result["conversation_id"] != "c1"
        # named by id, such a conversation takes the history without a comparison
        result = await complete(client, prompt="again", conversation_id="c1", history=[
            *history, {"role": "user", "content": "new"}, {"role": "assistant", "content": "stub answer to: new"}])
        assert result["conversation_id"] == "c1"


async def test_an_agents_client_resending_its_history_keeps_one_conversation(stub_daemon: Daemon) -> None:
    """The agent's profile holds the system prompt; its client never sees it, so never resends it."""
    async with connected(stub_daemon) as client:
        await client.request("agent:spawn", {"agent_id": "helper", "system": "You are Helper."})
        history: list[dict[str, Any]] = []
        seen = []
        for turn in range(3):
            result = await complete(client, prompt=f"t{turn}", agent_id="helper", history=history or None)
            seen.append((result["conversation_id"], result["exchange"]))
            history += [{"role": "user", "content": f"t{turn}"}, {"role": "assistant", "content": result["content"]}]
        assert len({cid for cid, _n in seen}) == 1 and [n for _cid, n in seen] == [1, 2, 3]


async def test_a_system_message_between_turns_holds_from_its_exchange_and_the_chat_goes_on(
        stub_daemon: Daemon) -> None:
    """A chat client that changed its system prompt mid-conversation resends it where it stood."""
    async with connected(stub_daemon) as client:
        first = await complete(client, prompt="u1")
        history = [{"role": "user", "content": "u1"}, {"role": "assistant", "content": first["content"]}]
        second = await complete(client, messages=[{"role": "system", "content": "be terse"},
                                                  {"role": "user", "content": "u2"}], history=history)
        assert second["conversation_id"] == first["conversation_id"]
        history += [{"role": "system", "content": "be terse"}, {"role": "user", "content": "u2"},
                    {"role": "assistant", "content": second["content"]}]
        third = await complete(client, prompt="u3", history=history)
        assert (third["conversation_id"], third["exchange"]) == (first["conversation_id"], 3)


async def test_the_same_history_sent_twice_at_once_continues_one_and_forks_the_other(
        short_tmp: Path, stub: Any) -> None:
    """Neither answer is stored after the other's turn, which its client never saw."""
    notes = short_tmp / "notes.txt"
    notes.write_text("some notes")  # reading a file at admission suspends: the window of the race
    async with running_daemon(short_tmp, **stub_settings(stub, allowed_file_roots=[str(short_tmp)])) as daemon, \
            connected(daemon) as client, connected(daemon) as other:
        first = await complete(client, prompt="p1")
        history = [{"role": "user", "content": "p1"}, {"role": "assistant", "content": first["content"]}]
        acks = await asyncio.gather(*(c.request("completion:async", {"prompt": f"branch {i}", "history": history,
                                                                    "files": [str(notes)]})
                                      for i, c in enumerate((client, other))))
        results = [await client.request("completion:wait", {"request_id": a["request_id"], "timeout": 30})
                   for a in acks]
        placed = sorted((r["conversation_id"] == first["conversation_id"], r["exchange"]) for r in results)
        assert placed == [(False, 2), (True, 2)]  # one continued in place, the other a fork at exchange 1
