"""conversation:show, conversation:export and conversation:import: one rendering shared with
the CLI, and a round trip that gives the same exchanges under a new id."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson
import pytest

from ksi_common.errors import KsiError
from ksi_common.export import parse_export, render
from ksi_common.transcripts import Transcripts
from ksi_daemon.daemon import Daemon
from tests.conftest import complete, connected
from tests.stored import names, stored_reader, stored_snapshot

pytestmark = pytest.mark.backends


def comparable(exchanges: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What must survive a round trip: numbering, inputs, replies, who answered, tokens."""
    keep = ("n", "model", "provider", "agent_id", "is_feedback", "tokens_in", "tokens_out", "ts")
    out = []
    for exchange in exchanges:
        reply = exchange["reply"]
        out.append({
            **{k: exchange[k] for k in keep},
            "inputs": [{k: v for k, v in item.items()} for item in exchange["inputs"]],
            "reply": {k: reply[k] for k in ("content", "model", "usage", "finish_reason", "ts")},
        })
    return out


async def make_conversation(client: Any) -> None:
    await complete(client, model="openai/stub-a", prompt="hello there", system="Be brief.",
                   conversation_id="src", create=True)
    await complete(client, model="echo/x", prompt="second *markdown*", conversation_id="src")
    await complete(client, model="openai/stub-a", prompt="this one is feedback", is_feedback=True,
                   conversation_id="src")
    await client.request("conversation:update", {"conversation_id": "src", "title": "Round trip", "tags": ["t"]})


async def test_show_lists_exchanges_with_roles_models_tokens_and_times(stub_daemon: Daemon, stub: Any) -> None:
    async with connected(stub_daemon) as client:
        await make_conversation(client)
        shown = await client.request("conversation:show", {"conversation_id": "src"})
        page = await client.request("conversation:show", {"conversation_id": "src", "offset": 1, "limit": 1})
    conversation = shown["conversation"]
    assert (conversation["title"], conversation["tags"], conversation["system"]) == ("Round trip", ["t"], "Be brief.")
    assert shown["total_exchanges"] == 3
    first, second, third = shown["exchanges"]
    assert [i["type"] for i in first["inputs"]] == ["system", "user"]
    assert first["inputs"][1]["content"] == "hello there"
    assert first["reply"]["content"] == "stub answer to: hello there"
    assert (first["n"], first["model"], first["inherited"]) == (1, "openai/stub-a", False)
    assert first["tokens_in"] > 0 and first["reply"]["usage"]["prompt_tokens"] > 0 and first["ts"]
    assert second["model"] == "echo/x" and second["reply"]["content"].startswith("You said: second")
    assert third["is_feedback"] and third["inputs"][0]["type"] == "feedback"
    assert [e["n"] for e in page["exchanges"]] == [2] and page["total_exchanges"] == 3


@pytest.mark.parametrize("fmt", ["json", "jsonl"])
async def test_export_import_round_trip_gives_the_same_exchanges_under_a_new_id(
        stub_daemon: Daemon, stub: Any, fmt: str) -> None:
    async with connected(stub_daemon) as client:
        await make_conversation(client)
        exported = await client.request("conversation:export", {"conversation_id": "src", "format": fmt})
        assert exported["exchanges"] == 3
        source_files = names(await stored_snapshot(stub_daemon.settings), "logs/responses/")
        imported = await client.request("conversation:import", {"data": exported["content"]})
        new_id = imported["conversation_id"]
        assert new_id != "src" and imported["exchanges"] == 3 and imported["imported_from"] == "src"
        again = await client.request("conversation:export", {"conversation_id": new_id, "format": "json"})
        original = await client.request("conversation:export", {"conversation_id": "src", "format": "json"})
        # the imported conversation continues like the original: history without the feedback exchange
        await complete(client, model="openai/stub-a", prompt="go on", conversation_id=new_id)
    before, after = orjson.loads(original["content"]), orjson.loads(again["content"])
    assert comparable(after["exchanges"]) == comparable(before["exchanges"])
    assert after["conversation"]["system"] == "Be brief." and after["conversation"]["title"] == "Round trip"
    # fresh response ids, written as new files; the originals are untouched
    new_ids = {e["response_id"] for e in after["exchanges"]}
    assert new_ids.isdisjoint(e["response_id"] for e in before["exchanges"])
    stored = names(await stored_snapshot(stub_daemon.settings), "logs/responses/")
    assert all(f"{rid}.jsonl" not in source_files and f"{rid}.jsonl" in stored for rid in new_ids)
    assert [(m["role"], m["content"]) for m in stub.messages()][:3] == [
        ("system", "Be brief.\n\n[Note: earlier replies came from: openai/stub-a (exchange 1); echo/x (exchange 2).]"),
        ("user", "hello there"), ("assistant", "stub answer to: hello there")]
    assert stub.messages()[-1]["content"] == "go on" and len(stub.messages()) == 6


async def test_import_refuses_bad_payloads_and_taken_ids(stub_daemon: Daemon, stub: Any) -> None:
    async with connected(stub_daemon) as client:
        await complete(client, prompt="hi", conversation_id="taken", create=True)
        exported = await client.request("conversation:export", {"conversation_id": "taken", "format": "json"})
        markdown = await client.request("conversation:export", {"conversation_id": "taken", "format": "markdown"})
        before = await stored_snapshot(stub_daemon.settings)
        for data in ({"data": "not json at all {"}, {"data": {"format": "other"}}, {"data": markdown["content"]},
                     {"data": exported["content"], "new_id": "taken"}, {"data": exported["content"], "new_id": "a/b"},
                     {"data": exported["content"], "format": "markdown"}):
            with pytest.raises(KsiError) as caught:
                await client.request("conversation:import", data)
            taken = data.get("new_id") == "taken"  # a taken id is its own code (section 8)
            assert caught.value.code == ("conversation_exists" if taken else "validation_error"), data
        with pytest.raises(KsiError) as caught:
            await client.request("conversation:export", {"conversation_id": "missing"})
        assert caught.value.code == "conversation_not_found"
        after = await stored_snapshot(stub_daemon.settings)
    assert after == before


def document(answers: int) -> dict[str, Any]:
    exchanges = [{"inputs": [{"type": "user", "content": f"q{k}"}],
                  "reply": {"content": f"a{k}", "model": "echo/x"}, "model": "echo/x"} for k in range(answers)]
    return {"v": 1, "format": "ksi.conversation", "conversation": {"title": f"{answers} answers"},
            "exchanges": exchanges}


async def test_two_imports_of_one_new_id_at_once_store_the_winners_exchanges_and_nothing_else(
        stub_daemon: Daemon) -> None:
    """One import wins the id; the other gets conversation_exists and leaves nothing behind: never
    the winner's metadata over the loser's exchanges, no stray file or row of either."""
    async with connected(stub_daemon) as client:
        for round_number in range(10):
            target = f"twin-{round_number}"
            before = await stored_snapshot(stub_daemon.settings)
            outcomes = await asyncio.gather(
                *(client.request("conversation:import", {"data": document(size), "new_id": target})
                  for size in (2, 3)), return_exceptions=True)
            won = [o for o in outcomes if not isinstance(o, BaseException)]
            lost = [o for o in outcomes if isinstance(o, BaseException)]
            assert len(won) == 1 and [e.code for e in lost] == ["conversation_exists"], outcomes  # type: ignore[attr-defined]
            size = won[0]["exchanges"]
            shown = await client.request("conversation:show", {"conversation_id": target})
            assert [x["reply"]["content"] for x in shown["exchanges"]] == [f"a{k}" for k in range(size)]
            assert shown["conversation"]["title"] == f"{size} answers"
            after = await stored_snapshot(stub_daemon.settings)
            added = set(after) - set(before)
            assert len(names(after, "logs/responses/") - names(before, "logs/responses/")) == size, added
            assert len(added) == size + 2, added  # its responses, its index and its metadata


async def test_export_matches_the_shared_renderer(stub_daemon: Daemon, stub: Any) -> None:
    async with connected(stub_daemon) as client:
        await make_conversation(client)
        fork = await client.request("conversation:fork", {"conversation_id": "src", "at": 1, "new_id": "fk"})
        await complete(client, prompt="in the fork", conversation_id=fork["conversation_id"])
        replies = {fmt: (await client.request("conversation:export", {"conversation_id": "fk", "format": fmt}))["content"]
                   for fmt in ("markdown", "json", "jsonl")}
    reader = stored_reader(stub_daemon.settings)
    try:
        transcript = await Transcripts(reader).transcript("fk")
    finally:
        await reader.aclose()
    for fmt, content in replies.items():
        rendered = render(transcript, fmt)
        if fmt == "markdown":  # the state line depends on the clock only through expiry; none here
            assert content == rendered
        else:
            assert parse_export(content)["exchanges"] == parse_export(rendered)["exchanges"]
    markdown = replies["markdown"]
    assert markdown.startswith("# Round trip\n")
    assert "Forked from `src` at exchange 1" in markdown
    assert "*(inherited from `src`)*" in markdown and "in the fork" in markdown
    assert "**System prompt**\n\nBe brief." in markdown
    lines = replies["jsonl"].splitlines()
    assert orjson.loads(lines[0])["type"] == "conversation"
    assert [orjson.loads(line)["inherited"] for line in lines[1:]] == [True, False]


def test_parse_export_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(KsiError) as caught:
        parse_export('{"v":1,"type":"exchange","inputs":[]}\n', "jsonl")
    assert caught.value.code == "validation_error" and "no conversation line" in caught.value.message
    with pytest.raises(KsiError) as caught:
        parse_export({"format": "ksi.conversation", "conversation": {}, "exchanges": [{"inputs": [], "reply": 3}]})
    assert "exchanges.1" in caught.value.details["fields"]
