"""A truncated or shapeless answer is a provider_error, never an indexed partial success; a
flood is refused while it is read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.conftest import complete, connected, running_daemon, stub_settings
from tests.stub_openai import Reply
from tests.test_completion_faults import failing, index_ids, response_of


async def test_a_cut_stream_is_retried_and_never_indexed(short_tmp: Path, stub: Any) -> None:
    settings = stub_settings(stub, retry_attempts=2)
    async with running_daemon(short_tmp, **settings) as daemon, connected(daemon) as client:
        stub.enqueue(Reply(text="the first half", cut=True), "the whole answer")
        result = await complete(client, prompt="hi", conversation_id="c", create=True, stream=True)
        assert result["content"] == "the whole answer"
        assert [a["ok"] for a in response_of(daemon, result["response_id"])[-1]["attempts"]] == [False, True]
        stub.enqueue(*[Reply(text="cut again", cut=True)] * 2)
        error, status = await failing(client, prompt="again", conversation_id="c", stream=True)
        assert (error.code, error.details["reason"]) == ("provider_error", "truncated")
        assert index_ids(daemon, "c") == [result["response_id"]]
        assert response_of(daemon, status["response_id"])[-1]["type"] == "error"


async def test_no_choices_is_a_provider_error(short_tmp: Path, stub: Any) -> None:
    async with running_daemon(short_tmp, **stub_settings(stub, retry_attempts=1)) as daemon, \
            connected(daemon) as client:
        stub.enqueue(Reply(body='{"id": "x", "object": "chat.completion", "choices": []}'))
        error, _status = await failing(client, prompt="hi", conversation_id="c", create=True)
        assert (error.code, error.details["reason"]) == ("provider_error", "no_choices")
        assert index_ids(daemon, "c") == []


async def test_an_endless_body_is_refused_at_the_limit(short_tmp: Path, stub: Any) -> None:
    # the timeout is long: only reading stopped at the limit ends this request before it
    settings = stub_settings(stub, retry_attempts=1, max_response_bytes=256 * 1024, request_timeout=600)
    async with running_daemon(short_tmp, **settings) as daemon, connected(daemon) as client:
        stub.enqueue(Reply(endless=True))
        error, _status = await failing(client, prompt="hi", conversation_id="c", create=True)
        assert (error.code, error.details["reason"]) == ("provider_error", "response_too_large")
        assert index_ids(daemon, "c") == []
        # the daemon goes on answering
        assert (await complete(client, prompt="next", conversation_id="c"))["content"] == "stub answer to: next"
