"""Bad input to completion:async: the exact error code, and nothing written anywhere
(no response file, no index line, no metadata, no file outside var/)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import orjson
import pytest

from ksi_common.client import KsiClient
from ksi_daemon.daemon import Daemon
from tests.conftest import complete, connected


def snapshot(root: Path) -> dict[str, int]:
    """Every file under `root` with its size (the daemon's own log excluded)."""
    found = {}
    for directory, _dirs, files in os.walk(root):
        for name in files:
            path = Path(directory) / name
            if "daemon" in path.relative_to(root).parts[:3] and name.startswith("daemon.log"):
                continue
            found[str(path.relative_to(root))] = path.stat().st_size if path.exists() else -1
    return found


@pytest.fixture
async def client(stub_daemon: Daemon) -> Any:
    async with connected(stub_daemon) as connection:
        await complete(connection, prompt="already here", conversation_id="known", create=True)
        yield connection


async def refused(daemon: Daemon, client: KsiClient, data: dict[str, Any], code: str) -> dict[str, Any]:
    """Send `data`; the ack must fail with `code`, and no file may change or appear anywhere."""
    root = daemon.settings.var_dir.parent
    before_root = sorted(os.listdir(root))
    before_parent = set(os.listdir(root.parent))
    before = snapshot(root)
    reply = await client.send_frame("completion:async", data)
    assert "error" in reply, reply
    assert reply["error"]["code"] == code, reply["error"]
    assert snapshot(root) == before
    assert sorted(os.listdir(root)) == before_root == ["d.sock", "var"]
    appeared = set(os.listdir(root.parent)) - before_parent
    assert not {name for name in appeared if "escape" in name or "hidden" in name or name.startswith("x" * 20)}
    health = await client.request("system:health")
    assert health["completions"]["queued"] == 0 and health["completions"]["running"] == 0
    return reply["error"]


async def test_unknown_conversation(stub_daemon: Daemon, client: KsiClient, stub: Any) -> None:
    error = await refused(stub_daemon, client, {"prompt": "hi", "conversation_id": "nobody-knows"},
                          "conversation_not_found")
    assert error["details"]["conversation_id"] == "nobody-knows"
    assert not stub_daemon.layout.meta_file("nobody-knows").exists()
    assert len(stub.requests) == 1


async def test_unknown_agent(stub_daemon: Daemon, client: KsiClient) -> None:
    error = await refused(stub_daemon, client, {"prompt": "hi", "agent_id": "ghost-agent"}, "agent_not_found")
    assert error["details"]["agent_id"] == "ghost-agent"


@pytest.mark.parametrize("bad_id", ["../escape", "../../../../escape", "a/b", "x" * 200, ".hidden", "a..b",
                                    "has space", "-dash", "", "tab\there", "nul\x00byte", "/abs/escape"])
@pytest.mark.parametrize("create", [False, True])
async def test_unsafe_conversation_ids(stub_daemon: Daemon, client: KsiClient, bad_id: str, create: bool) -> None:
    error = await refused(stub_daemon, client, {"prompt": "hi", "conversation_id": bad_id, "create": create},
                          "validation_error")
    assert "conversation_id" in error["details"]["fields"]


@pytest.mark.parametrize("bad_id", ["../escape", "a/b", ".hidden", "x" * 200])
async def test_unsafe_agent_ids(stub_daemon: Daemon, client: KsiClient, bad_id: str) -> None:
    error = await refused(stub_daemon, client, {"prompt": "hi", "agent_id": bad_id}, "validation_error")
    assert "agent_id" in error["details"]["fields"]


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": "   "}, "prompt"),
        ({"prompt": "\n\t"}, "prompt"),
        ({"prompt": None}, "data"),
        ({}, "data"),
        ({"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, "data"),
        ({"messages": []}, "data"),
        ({"messages": [{"role": "assistant", "content": "I said this"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "fake history"}]},
         "messages.1.role"),
        ({"messages": [{"role": "system", "content": "only a system message"}]}, "data"),
        ({"messages": [{"role": "user", "content": ""}]}, "messages.0.content"),
        ({"messages": [{"role": "user"}]}, "messages.0.content"),
        ({"messages": "hi"}, "messages"),
        ({"prompt": "hi", "temperature": "hot"}, "temperature"),
        ({"prompt": "hi", "temperature": 5}, "temperature"),
        ({"prompt": "hi", "temperature": -0.1}, "temperature"),
        ({"prompt": "hi", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
        ({"prompt": "hi", "timeout": 0}, "timeout"),
        ({"prompt": "hi", "timeout": -5}, "timeout"),
        ({"prompt": "hi", "promt": "typo"}, "promt"),
        ({"prompt": "hi", "options": {"api_base": "http://evil.example/v1"}}, "options"),
        ({"prompt": "hi", "options": {"api_key": "sk-stolen"}}, "options"),
        ({"prompt": "hi", "options": {"messages": []}}, "options"),
        ({"prompt": ["a", "list"]}, "prompt"),
        ({"prompt": {"an": "object"}}, "prompt"),
    ],
)
async def test_invalid_fields(stub_daemon: Daemon, client: KsiClient, stub: Any, data: dict[str, Any],
                              field: str) -> None:
    for target in ({}, {"conversation_id": "known"}, {"conversation_id": "new-one", "create": True}):
        error = await refused(stub_daemon, client, {**data, **target}, "validation_error")
        assert field in error["details"]["fields"], error
        assert error["message"].startswith("invalid data")
    assert len(stub.requests) == 1
    assert not stub_daemon.layout.meta_file("new-one").exists()
    assert "sk-stolen" not in error["message"]


async def test_a_number_prompt_is_accepted_as_text(stub_daemon: Daemon, client: KsiClient, stub: Any) -> None:
    result = await complete(client, prompt=42, conversation_id="known")
    assert stub.messages()[-1] == {"role": "user", "content": "42"}
    assert result["content"] == "stub answer to: 42"
    lines = [orjson.loads(line)
             for line in stub_daemon.layout.response_file(result["response_id"]).read_bytes().splitlines()]
    assert lines[0]["type"] == "user" and lines[0]["content"] == "42"
    flag = await complete(client, prompt=True, conversation_id="known")
    assert stub.messages()[-1] == {"role": "user", "content": "true"}
    assert flag["exchange"] == 3


async def test_a_number_conversation_id_is_accepted_as_text(stub_daemon: Daemon, client: KsiClient) -> None:
    result = await complete(client, prompt="hi", conversation_id=123, create=True)
    assert result["conversation_id"] == "123"
    assert stub_daemon.layout.index_file("123").exists()


async def test_input_messages_with_a_system_role(stub_daemon: Daemon, client: KsiClient, stub: Any) -> None:
    result = await complete(client, messages=[{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": "hello"},
                                              {"role": "user", "content": "and more"}],
                            conversation_id="msgs", create=True)
    assert [(m["role"], m["content"]) for m in stub.messages()] == [
        ("system", "Be brief."), ("user", "hello"), ("user", "and more")]
    lines = [orjson.loads(line)
             for line in stub_daemon.layout.response_file(result["response_id"]).read_bytes().splitlines()]
    assert [line["type"] for line in lines] == ["system", "user", "user", "assistant"]
    await complete(client, prompt="next", conversation_id="msgs")
    assert [(m["role"], m["content"]) for m in stub.messages()] == [
        ("system", "Be brief."), ("user", "hello"), ("user", "and more"), ("assistant", result["content"]),
        ("user", "next")]


async def test_bad_input_does_not_disturb_a_conversation(stub_daemon: Daemon, client: KsiClient, stub: Any) -> None:
    for data in ({"prompt": "", "conversation_id": "known"}, {"prompt": "hi", "conversation_id": "known",
                                                             "temperature": "hot"}):
        await refused(stub_daemon, client, data, "validation_error")
    result = await complete(client, prompt="still fine", conversation_id="known")
    assert result["exchange"] == 2
    assert [m["content"] for m in stub.messages() if m["role"] == "user"] == ["already here", "still fine"]
