"""The built-in echo model answers while litellm is still loading (its import takes seconds after
a start), with the same reply, in the same shape, as through litellm once it is loaded."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from tests.conftest import complete, connected, running_daemon

SHAPE = ("request_id", "response_id", "conversation_id", "model", "content", "finish_reason", "usage", "history")


async def turn(client: Any, **data: Any) -> tuple[dict[str, Any], list[str]]:
    """One streamed echo turn: its result and the chunks pushed for it (the client is subscribed)."""
    result = await complete(client, stream=True, **data)
    chunks: list[str] = []
    while "".join(chunks) != result["content"]:
        push = await client.next_push(timeout=10)
        if push["event"] == "completion:chunk" and push["data"]["request_id"] == result["request_id"]:
            chunks.append(push["data"]["text"])
    return result, chunks


async def subscribed(client: Any) -> Any:
    await client.request("monitor:subscribe", {"patterns": ["completion:chunk"]})
    return client


async def test_echo_answers_before_litellm_is_loaded_as_it_does_after(short_tmp: Path) -> None:
    async with running_daemon(short_tmp, litellm_preload=False) as daemon:
        async with connected(daemon) as client:
            await subscribed(client)
            early, early_chunks = await turn(client, model="echo/demo", prompt="My name is Alice",
                                             conversation_id="early", create=True)
            again, _ = await turn(client, prompt="What is my name?", conversation_id="early")
        assert not daemon.litellm.loaded  # answered without waiting for litellm
        await daemon.litellm.ensure_loaded()
        assert "litellm" in sys.modules
        async with connected(daemon) as client:
            await subscribed(client)
            late, late_chunks = await turn(client, model="echo/demo", prompt="My name is Alice",
                                           conversation_id="late", create=True)
            shown = await client.request("conversation:show", {"conversation_id": "early"})
    for key in ("content", "finish_reason", "usage", "model"):
        assert early[key] == late[key], key
    assert set(early) == set(late) and all(key in early for key in SHAPE)
    assert early_chunks == late_chunks and "".join(early_chunks) == early["content"]
    assert early["response_id"].startswith("echo-demo-")
    assert "Earlier user inputs: My name is Alice" in again["content"]  # history as always
    assert [e["reply"]["content"] for e in shown["exchanges"]] == [early["content"], again["content"]]
