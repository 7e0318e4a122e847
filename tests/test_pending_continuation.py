"""A request naming no conversation whose history and new input are a conversation's exchanges and
its pending input continues that conversation, its new input taking the pending messages; an
assistant reply added afterwards, being the newest exchange's, is taken as already held. This is
what openai-agents' OpenAIConversationsSession does each run: it adds the user's item to its
conversation, asks for a response with the whole history and no conversation, then adds the answer.
On the socket, on both backends."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from ksi_common.errors import ErrorCode, KsiError
from ksi_daemon.context import EventContext
from ksi_daemon.daemon import Daemon
from ksi_daemon.services.completion.models import CompletionAsync
from ksi_daemon.services.completion.requests import RequestState
from ksi_daemon.services.pool.handover import adopted_state, request_record
from tests.conftest import complete, connected, running_daemon, stub_settings
from tests.stored import stored_index, stored_response
from tests.stub_openai import StubOpenAI

pytestmark = pytest.mark.backends

INSTRUCTIONS = "Reply very concisely."
Q1, A1 = "What city is the Golden Gate Bridge in?", "San Francisco."
Q2, A2 = "What state is it in?", "California."


def user(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": text}


def assistant(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "assistant", "content": text}


async def waiting_conversation(client: Any, *pending: str) -> str:
    """A conversation with no exchanges holding `pending` (as the Conversations API creates one)."""
    document = {"format": "ksi.conversation", "v": 1, "conversation": {"system": None}, "exchanges": []}
    made = await client.request("conversation:import", {"data": document, "format": "json", "pending": list(pending)})
    return str(made["conversation_id"])


async def listed(client: Any) -> list[str]:
    return [c["conversation_id"] for c in (await client.request("conversation:list", {}))["conversations"]]


async def stored_inputs(daemon: Daemon, conversation_id: str) -> list[list[str]]:
    """Each stored exchange's input texts, as its response record holds them."""
    found = []
    for entry in await stored_index(daemon, conversation_id):
        record = await stored_response(daemon, entry["response_id"])
        assert record is not None
        found.append([line["content"] for line in record[:-1] if line["type"] == "user"])
    return found


async def test_a_request_with_no_history_whose_input_is_a_conversations_pending_input_continues_it(
        stub_daemon: Daemon, stub: StubOpenAI) -> None:
    stub.enqueue(A1)
    async with connected(stub_daemon) as client:
        waiting = await waiting_conversation(client, Q1)
        # whitespace differs: the canonical form digests use decides
        result = await complete(client, input=[user(f"  {Q1}\n")], instructions=INSTRUCTIONS)
        assert result["conversation_id"] == waiting
        assert await listed(client) == [waiting]  # no second conversation
        shown = await client.request("conversation:show", {"conversation_id": waiting})
        assert shown["conversation"]["pending_input"] == []
        assert await stored_inputs(stub_daemon, waiting) == [[f"  {Q1}\n"]]  # taken, not added before it again
    assert [(m["role"], m["content"]) for m in stub.messages()] == [("system", INSTRUCTIONS), ("user", f"  {Q1}\n")]


async def test_a_history_and_input_that_are_a_conversations_exchanges_and_pending_input_continue_it(
        stub_daemon: Daemon, stub: StubOpenAI) -> None:
    stub.enqueue(A1, A2)
    async with connected(stub_daemon) as client:
        session = await waiting_conversation(client, Q1)
        first = await complete(client, input=[user(Q1)], instructions=INSTRUCTIONS)
        assert first["conversation_id"] == session
        await client.request("conversation:pend", {"conversation_id": session, "inputs": [Q2]})
        second = await complete(client, history=[user(Q1), assistant(A1)], input=[user(Q2)],
                                instructions=INSTRUCTIONS)
        assert second["conversation_id"] == session
        assert await listed(client) == [session]
        assert await stored_inputs(stub_daemon, session) == [[Q1], [Q2]]
        assert (await client.request("conversation:show", {"conversation_id": session}))["conversation"][
            "pending_input"] == []
    assert [(m["role"], m["content"]) for m in stub.messages()] == [
        ("system", INSTRUCTIONS), ("user", Q1), ("assistant", A1), ("user", Q2)]


async def test_a_history_resent_after_a_restart_takes_the_pending_input_it_ends_with(
        short_tmp: Path, stub: StubOpenAI, backend: dict[str, Any]) -> None:
    """Pending input written before the daemon started is found through the history's match."""
    settings = {**stub_settings(stub), **backend}
    stub.enqueue(A1, A2)
    async with running_daemon(short_tmp, **settings) as daemon, connected(daemon) as client:
        session = await waiting_conversation(client, Q1)
        await complete(client, input=[user(Q1)], instructions=INSTRUCTIONS)
        await client.request("conversation:pend", {"conversation_id": session, "inputs": [Q2]})
    async with running_daemon(short_tmp, **settings) as daemon, connected(daemon) as client:
        second = await complete(client, history=[user(Q1), assistant(A1)], input=[user(Q2)],
                                instructions=INSTRUCTIONS)
        assert second["conversation_id"] == session
        assert await listed(client) == [session]
        assert await stored_inputs(daemon, session) == [[Q1], [Q2]]
    assert [m["content"] for m in stub.messages()].count(Q2) == 1


async def test_input_added_after_a_restart_to_a_conversation_made_before_is_found_with_no_history(
        short_tmp: Path, stub: StubOpenAI, backend: dict[str, Any]) -> None:
    settings = {**stub_settings(stub), **backend}
    stub.enqueue(A1)
    async with running_daemon(short_tmp, **settings) as daemon, connected(daemon) as client:
        session = await waiting_conversation(client)
    async with running_daemon(short_tmp, **settings) as daemon, connected(daemon) as client:
        await client.request("conversation:pend", {"conversation_id": session, "inputs": [Q1]})
        result = await complete(client, input=[user(Q1)], instructions=INSTRUCTIONS)
        assert result["conversation_id"] == session
        assert await listed(client) == [session]
        assert await stored_inputs(daemon, session) == [[Q1]]


async def test_two_requests_sent_at_once_with_the_waiting_input_continue_it_once(
        stub_daemon: Daemon, stub: StubOpenAI) -> None:
    stub.enqueue(A1, A1)
    async with connected(stub_daemon) as client:
        waiting = await waiting_conversation(client, Q1)
        acks = await asyncio.gather(*(client.request("completion:async", {"input": [user(Q1)]}) for _ in range(2)))
        results = [await client.request("completion:wait", {"request_id": ack["request_id"], "timeout": 30})
                   for ack in acks]
        assert sorted(r["conversation_id"] == waiting for r in results) == [False, True]
        assert await stored_inputs(stub_daemon, waiting) == [[Q1]]
        assert len(await listed(client)) == 2


async def test_of_several_conversations_waiting_with_that_input_the_most_recently_active_is_continued(
        stub_daemon: Daemon, stub: StubOpenAI) -> None:
    stub.enqueue(A1)
    async with connected(stub_daemon) as client:
        older = await waiting_conversation(client)
        newer = await waiting_conversation(client, Q1)
        await client.request("conversation:pend", {"conversation_id": older, "inputs": [Q1]})  # active last
        result = await complete(client, input=[user(Q1)])
        assert result["conversation_id"] == older
        assert sorted(await listed(client)) == sorted([older, newer])
        untouched = await client.request("conversation:show", {"conversation_id": newer})
        assert [p["content"] for p in untouched["conversation"]["pending_input"]] == [Q1]
        assert untouched["exchanges"] == []


async def test_a_conversation_waiting_with_that_input_is_not_continued_for_another_scope_or_other_input(
        stub_daemon: Daemon, stub: StubOpenAI) -> None:
    stub.enqueue(A1, A1)
    async with connected(stub_daemon) as client:
        waiting = await waiting_conversation(client, Q1)
        for_alice = await complete(client, input=[user(Q1)], options={"user": "alice"})
        other = await complete(client, input=[user(Q1), user(Q2)])
        assert waiting not in (for_alice["conversation_id"], other["conversation_id"])
        kept = await client.request("conversation:show", {"conversation_id": waiting})
        assert [p["content"] for p in kept["conversation"]["pending_input"]] == [Q1]
        assert kept["exchanges"] == []
        assert len(await listed(client)) == 3


async def test_adding_the_reply_a_matched_response_already_stored_writes_nothing_twice(
        stub_daemon: Daemon, stub: StubOpenAI) -> None:
    stub.enqueue(A1)
    async with connected(stub_daemon) as client:
        session = await waiting_conversation(client, Q1)
        answered = await complete(client, input=[user(Q1)], instructions=INSTRUCTIONS)
        before = await client.request("conversation:show", {"conversation_id": session})
        index_before = await stored_index(stub_daemon, session)
        held = await client.request("conversation:append", {"conversation_id": session,
                                                            "reply_to_pending": f"{A1}\n"})
        assert held["exchanges"] == [1] and held["response_ids"] == [answered["response_id"]]
        after = await client.request("conversation:show", {"conversation_id": session})
        assert after == before  # the metadata too: nothing was written
        assert await stored_index(stub_daemon, session) == index_before


async def test_a_reply_added_with_nothing_waiting_that_is_not_the_newest_reply_is_refused(
        stub_daemon: Daemon, stub: StubOpenAI) -> None:
    stub.enqueue(A1)
    async with connected(stub_daemon) as client:
        empty = await waiting_conversation(client)
        session = await waiting_conversation(client, Q1)
        await complete(client, input=[user(Q1)])
        for conversation_id in (session, empty):
            before = await client.request("conversation:show", {"conversation_id": conversation_id})
            index_before = await stored_index(stub_daemon, conversation_id)
            with pytest.raises(KsiError) as refused:
                await client.request("conversation:append", {"conversation_id": conversation_id,
                                                             "reply_to_pending": "Oakland."})
            assert refused.value.code == ErrorCode.VALIDATION_ERROR
            assert refused.value.details["fields"] == {"reply_to_pending": "no pending input to reply to"}
            assert await client.request("conversation:show", {"conversation_id": conversation_id}) == before
            assert await stored_index(stub_daemon, conversation_id) == index_before


def test_a_request_taking_pending_input_is_run_so_by_the_daemon_that_takes_it_over() -> None:
    """The pool's record of a request carries that its input is its conversation's pending input."""
    request = CompletionAsync.model_validate({"input": [user(Q1)]})
    for takes in (("pend-1",), ()):
        state = RequestState(request_id="req-1", conversation_id="conv-1", model="openai/stub-model",
                             request=request, context=EventContext.root(), takes_pending=takes)
        assert adopted_state(request_record(state)).takes_pending == takes


@pytest.mark.parametrize("meanwhile", ["pended", "answered and pended"])
async def test_a_request_taking_pending_input_sends_that_input_once_whatever_is_added_before_it_runs(
        short_tmp: Path, stub: StubOpenAI, backend: dict[str, Any], meanwhile: str) -> None:
    """The request takes the pending messages it was matched by at its admission: input pended
    after that waits for the next request, and input another writer answered first is not sent
    or stored twice."""
    stub.enqueue(A1)
    gate = stub.model_gate["stub-blocker"] = asyncio.Event()  # holds the daemon's one slot
    async with running_daemon(short_tmp, **stub_settings(stub, max_concurrency=1), **backend) as daemon, \
            connected(daemon) as client:
        session = await waiting_conversation(client, Q1)
        blocker = await client.request("completion:async", {"prompt": "hold", "model": "openai/stub-blocker"})
        taking = await client.request("completion:async", {"input": [user(Q1)], "instructions": INSTRUCTIONS})
        assert taking["conversation_id"] == session
        expected = [[Q1]]
        if meanwhile == "answered and pended":  # another writer answers Q1 first
            await client.request("conversation:append", {"conversation_id": session, "reply_to_pending": A1})
            expected = [[Q1], [Q1]]
        await client.request("conversation:pend", {"conversation_id": session, "inputs": [Q2]})
        gate.set()
        await client.request("completion:wait", {"request_id": blocker["request_id"], "timeout": 30})
        await client.request("completion:wait", {"request_id": taking["request_id"], "timeout": 30})
        assert await stored_inputs(daemon, session) == expected
        shown = await client.request("conversation:show", {"conversation_id": session})
        assert [item["content"] for item in shown["conversation"]["pending_input"]] == [Q2]  # for the next one
    sent = [(m["role"], m["content"]) for m in stub.messages()]
    assert sent[-1] == ("user", Q1) and [content for _role, content in sent].count(Q1) == len(expected)
    assert Q2 not in [content for _role, content in sent]
