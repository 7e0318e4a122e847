"""Hostile or damaged imports: checked whole before anything is written, numbers finite and in
range, file references never read from disk again, the imported model never a route."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from ksi_common.client import KsiClient
from ksi_common.errors import KsiError
from ksi_daemon.daemon import Daemon
from tests.conftest import complete, connected, running_daemon, stub_settings


def document(*exchanges: dict[str, Any], **conversation: Any) -> dict[str, Any]:
    return {"v": 1, "format": "ksi.conversation",
            "conversation": {"conversation_id": "elsewhere", "title": "imported", **conversation},
            "exchanges": list(exchanges)}


def exchange(text: str, answer: str, **fields: Any) -> dict[str, Any]:
    reply = {"content": answer, "model": "echo/x", "usage": {"prompt_tokens": 3, "completion_tokens": 2},
             "cost": 0.0, "ts": "2026-01-02T03:04:05Z", **fields.pop("reply", {})}
    return {"inputs": [{"type": "user", "content": text, "ts": "2026-01-02T03:04:05Z", **fields.pop("input", {})}],
            "reply": reply, "model": "echo/x", "ts": "2026-01-02T03:04:05Z", "tokens_in": 5, "tokens_out": 5,
            **fields}


def files_under(daemon: Daemon) -> set[str]:
    logs = daemon.layout.logs_dir
    state = daemon.layout.state_dir
    return {str(p) for root in (logs, state) if root.exists() for p in root.rglob("*") if p.is_file()
            and "daemon" not in p.parts and p.name != "requests.jsonl"}


async def refused(client: KsiClient, data: dict[str, Any]) -> KsiError:
    with pytest.raises(KsiError) as caught:
        await client.request("conversation:import", data)
    return caught.value


@pytest.mark.parametrize(("damage", "field"), [
    (lambda d: d["exchanges"][2].update(tokens_in=-150_000), "data.exchanges.2.tokens_in"),
    (lambda d: d["exchanges"][2].update(tokens_out=10**12), "data.exchanges.2.tokens_out"),
    (lambda d: d["exchanges"][2]["reply"].update(usage={"prompt_tokens": -1}), "data.exchanges.2.reply.usage"),
    (lambda d: d["exchanges"][2]["reply"].update(cost=1e300), "data.exchanges.2.reply.cost"),
    (lambda d: d["exchanges"][2]["reply"].update(cost=-0.5), "data.exchanges.2.reply.cost"),
    (lambda d: d["exchanges"][2]["reply"].update(duration_ms=1e300), "data.exchanges.2.reply.duration_ms"),
    (lambda d: d["exchanges"][2].update(ts="yesterday"), "data.exchanges.2.ts"),
    (lambda d: d["exchanges"][2]["reply"].update(ts="99999-01-01T00:00:00Z"), "data.exchanges.2.reply.ts"),
    (lambda d: d["exchanges"][2]["inputs"][0].update(content={"not": "text"}), "data.exchanges.2.inputs.0.content"),
    (lambda d: d["exchanges"][2]["inputs"][0].update(type="assistant"), "data.exchanges.2.inputs.0.type"),
    (lambda d: d["exchanges"][2]["inputs"][0].update(files=[{"path": "/a\x00b"}]),
     "data.exchanges.2.inputs.0.files.0.path"),
    (lambda d: d["conversation"].update(ttl=1e12), "data.conversation.ttl"),
    (lambda d: d["conversation"].update(tags="not-a-list"), "data.conversation.tags"),
])
async def test_a_damaged_import_is_refused_whole(daemon: Daemon, client: KsiClient, damage: Any, field: str) -> None:
    good = document(exchange("one", "ONE"), exchange("two", "TWO"), exchange("three", "THREE"))
    before = files_under(daemon)
    bad = copy.deepcopy(good)
    damage(bad)
    error = await refused(client, {"data": bad, "new_id": "imp"})
    assert error.code == "validation_error"
    assert field in error.details["fields"], error.details
    assert files_under(daemon) == before  # nothing written, not even the first two exchanges
    result = await client.request("conversation:import", {"data": good, "new_id": "imp"})
    assert result["exchanges"] == 3


async def test_negative_tokens_cannot_smuggle_history_past_the_budget(short_tmp: Path, stub: Any) -> None:
    settings = stub_settings(stub, models={"openai/stub-small": {"api_base": stub.api_base, "context_window": 8000,
                                                                 "output_reserve": 500}})
    huge = "word " * 30_000  # about 30k tokens, far past an 8k window
    bad = document(exchange(huge, "ok", tokens_in=-150_000, tokens_out=1, model="openai/stub-small"))
    async with running_daemon(short_tmp, **settings) as daemon, connected(daemon) as client:
        error = await refused(client, {"data": bad, "new_id": "smuggled"})
        assert error.code == "validation_error"
        assert not daemon.layout.index_file("smuggled").exists()
    assert stub.requests == []


async def test_imported_file_references_are_never_read(short_tmp: Path, stub: Any) -> None:
    root = short_tmp / "files"
    root.mkdir()
    secret = root / "id_ed25519"
    secret.write_text("-----BEGIN OPENSSH PRIVATE KEY----- very secret")
    ref = {"path": str(secret), "size": 10, "sha256": "0" * 64}
    doc = document(exchange("look at this", "looked", input={"files": [ref]}, model="openai/stub-model",
                            reply={"model": "openai/stub-model"}))
    async with running_daemon(short_tmp, allowed_file_roots=[root], **stub_settings(stub)) as daemon, \
            connected(daemon) as client:
        await client.request("conversation:import", {"data": doc, "new_id": "imp"})
        shown = await client.request("conversation:show", {"conversation_id": "imp"})
        assert shown["exchanges"][0]["inputs"][0]["files"][0]["path"] == str(secret)  # kept as history
        await complete(client, prompt="continue", conversation_id="imp", model="openai/stub-model")
        sent = str(stub.requests[-1]["messages"])
        assert "very secret" not in sent
        assert "look at this" in sent  # the history itself is sent
        # a file the user attaches through this daemon is read, and read again later
        mine = root / "notes.txt"
        mine.write_text("my own notes")
        await complete(client, prompt="with a file", conversation_id="imp", model="openai/stub-model",
                       files=[str(mine)])
        await complete(client, prompt="later", conversation_id="imp", model="openai/stub-model")
        assert "my own notes" in str(stub.requests[-1]["messages"])
        assert "very secret" not in str(stub.requests[-1]["messages"])


async def test_the_imported_model_is_not_a_route(short_tmp: Path, stub: Any) -> None:
    # the import names a model that the settings would route to a provider base with a key
    doc = document(exchange("hi", "hello", model="openai/stub-internal", reply={"model": "openai/stub-internal"}))
    async with running_daemon(short_tmp, **stub_settings(stub, default_model="echo/x")) as daemon, \
            connected(daemon) as client:
        await client.request("conversation:import", {"data": doc, "new_id": "imp"})
        result = await complete(client, prompt="go on", conversation_id="imp")
        assert result["model"] == "echo/x"
        fork = await client.request("conversation:fork", {"conversation_id": "imp", "new_id": "f"})
        forked = await complete(client, prompt="go on", conversation_id=fork["conversation_id"])
        assert forked["model"] == "echo/x"
        shown = await client.request("conversation:show", {"conversation_id": "imp"})
        assert shown["exchanges"][0]["model"] == "openai/stub-internal"  # history keeps the name
    assert stub.requests == []
