"""The completion service's chunk logs of background requests: read from any index, waited on,
and bounded (an ended log goes some minutes later, or earlier when too many or too large)."""

from __future__ import annotations

import asyncio
import gc
import weakref
from pathlib import Path
from typing import Any

import pytest

from ksi_common.errors import ErrorCode, KsiError
from ksi_daemon.context import EventContext
from ksi_daemon.services.completion.models import CompletionAsync
from ksi_daemon.services.completion.requests import RequestState
from ksi_daemon.services.completion.streams import ChunkLogs, CompletionChunks
from tests.conftest import complete, connected, running_daemon, stub_settings
from tests.stub_openai import Reply


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def request(n: int) -> RequestState:
    return RequestState(request_id=f"req-{n}", conversation_id=f"conv-{n}", model="echo/demo",
                        request=CompletionAsync(prompt="go", background=True), context=EventContext.root(),
                        response_id=f"echo-demo-{n:012x}")


def ended(logs: ChunkLogs, state: RequestState, *texts: str) -> None:
    for text in texts:
        logs.add(state.request_id, text)
    state.finish("done", {"content": "".join(texts)})
    logs.ended(state)


async def read(logs: ChunkLogs, state: RequestState, after: int = -1) -> dict[str, object]:
    assert state.response_id is not None
    return await logs.read(CompletionChunks(response_id=state.response_id, after=after))


async def test_chunks_are_read_from_any_index_and_empty_ones_are_not_kept() -> None:
    logs = ChunkLogs()
    state = request(1)
    logs.open(state)
    for text in ("a", "", "b", "c"):
        logs.add(state.request_id, text)
    view = await read(logs, state, after=0)
    assert (view["chunks"], view["first"], view["total_chunks"], view["status"]) == (["b", "c"], 1, 3, "queued")
    waiting = asyncio.ensure_future(logs.read(CompletionChunks(response_id=state.response_id or "", after=2,
                                                               wait=60)))
    await asyncio.sleep(0)
    assert not waiting.done()  # nothing after index 2 yet: the reader waits for it
    logs.add(state.request_id, "d")
    assert (await waiting)["chunks"] == ["d"]


async def test_an_ended_log_goes_minutes_after_its_end() -> None:
    monotonic = Clock()
    logs = ChunkLogs(monotonic=monotonic, kept_after_end=600)
    state = request(1)
    logs.open(state)
    monotonic.now += 3600  # a running request's log is kept however long it runs
    ended(logs, state, "x")
    monotonic.now += 599
    assert (await read(logs, state))["result"] == {"content": "x"}
    monotonic.now += 2
    with pytest.raises(KsiError) as gone:
        await read(logs, state)
    assert gone.value.code == ErrorCode.RESPONSE_NOT_FOUND and len(logs) == 0


async def test_too_many_or_too_large_ended_logs_go_oldest_first_running_ones_stay() -> None:
    logs = ChunkLogs(max_logs=3, max_ended_chars=10)
    running = request(0)
    logs.open(running)
    states = [request(n) for n in range(1, 6)]
    for state in states:
        logs.open(state)
        ended(logs, state, "ab")
    assert len(logs) <= 3
    assert (await read(logs, running))["status"] == "queued"  # never dropped while it runs
    assert (await read(logs, states[-1]))["chunks"] == ["ab"]
    with pytest.raises(KsiError):
        await read(logs, states[0])
    large = request(9)
    logs.open(large)
    ended(logs, large, "x" * 11)  # alone over the text bound: it goes at once, the others with it
    assert len(logs) == 1
    assert (await read(logs, running))["status"] == "queued"


async def test_a_reader_is_shown_the_sampling_options_but_no_others() -> None:
    logs = ChunkLogs()
    state = request(1)
    state.request = CompletionAsync(prompt="go", background=True, temperature=0.3,
                                    options={"top_p": 0.5, "extra_headers": {"X-Secret": "s3cret"}})
    logs.open(state)
    shown = (await read(logs, state))["request"]
    assert shown["temperature"] == 0.3 and shown["options"] == {"top_p": 0.5}


async def test_a_retry_drops_the_failed_attempts_chunks_and_numbers_its_own_after_them() -> None:
    logs = ChunkLogs()
    state = request(1)
    logs.open(state)
    logs.attempt(state.request_id)  # the first attempt: nothing to drop
    for text in ("wro", "ng"):  # the first attempt streams, then fails
        logs.add(state.request_id, text)
    assert (await read(logs, state, after=0))["chunks"] == ["ng"]  # a client read "wro" meanwhile
    logs.attempt(state.request_id)  # the retry begins
    logs.add(state.request_id, "right")
    fresh = await read(logs, state)  # a resumed stream from the start shows the retry only
    assert (fresh["chunks"], fresh["first"], fresh["total_chunks"]) == (["right"], 2, 3)
    resumed = await read(logs, state, after=0)  # the client that read "wro" goes on from number 2
    assert (resumed["chunks"], resumed["first"]) == (["right"], 2)
    ended(logs, state)
    done = await read(logs, state, after=2)
    assert (done["chunks"], done["total_chunks"], done["status"]) == ([], 3, "done")


async def test_an_ended_log_keeps_its_chunks_and_outcome_not_the_request_state() -> None:
    logs = ChunkLogs()
    state = request(1)
    state.request = CompletionAsync(prompt="go", background=True, metadata={"k": "v"})
    logs.open(state)
    ended(logs, state, "a", "b")
    kept = weakref.ref(state)
    del state
    gc.collect()
    assert kept() is None  # nothing holds the request's state (its request, context, images)
    view = await logs.read(CompletionChunks(response_id=f"echo-demo-{1:012x}"))
    assert (view["chunks"], view["status"], view["result"], view["error"]) == (["a", "b"], "done", {"content": "ab"},
                                                                             None)
    assert (view["request_id"], view["conversation_id"], view["request"]["metadata"]) == ("req-1", "conv-1",
                                                                                          {"k": "v"})


async def test_a_background_response_retried_after_a_cut_stream_shows_only_the_retry(short_tmp: Path,
                                                                                     stub: Any) -> None:
    async with running_daemon(short_tmp, **stub_settings(stub, retry_attempts=2)) as daemon, \
            connected(daemon) as client:
        stub.enqueue(Reply(text="the wrong half", cut=True), "the whole answer")  # the first attempt fails
        result = await complete(client, prompt="hi", background=True)
        assert result["content"] == "the whole answer"
        view = await client.request("completion:chunks", {"response_id": result["response_id"]})
        assert "".join(view["chunks"]) == "the whole answer"  # a stream resumed from its start
        assert (view["first"], view["total_chunks"]) == (3, 6)  # numbered after the 3 chunks dropped
