"""Tool-using conversations in every transcript: shown, exported and imported with their items
(calls, outputs, reasoning summaries, images by reference), checked whole on import with a code
per fault, and records written before items still shown as they were."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import orjson
import pytest

from ksi_common.client import KsiClient
from ksi_common.errors import KsiError
from ksi_common.export import render_markdown
from ksi_common.layout import VarLayout
from ksi_common.reading import open_reader
from ksi_common.transcripts import Transcripts
from ksi_daemon.daemon import Daemon
from ksi_daemon.services.conversations.image_tokens import image_tokens
from ksi_daemon.storage.jsonl.storage import JsonlStorage
from ksi_daemon.storage.migrate import migrate
from tests.conftest import connected, make_settings, running_daemon
from tests.stored import stored_index, stored_response, stored_snapshot
from tests.tool_conversation import IMAGE_SHA, TS, store_image, tool_document, tool_exchanges

pytestmark = pytest.mark.backends

CALL = {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city": "Oslo"}'}
OUTPUT = {"type": "function_call_output", "call_id": "c1", "output": "12C"}
IMAGE = {"sha256": IMAGE_SHA, "media_type": "image/png", "bytes": 3072}


def same_transcript(exchanges: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An exported transcript without what an import renews (ids, the owner)."""
    return [{k: v for k, v in x.items() if k not in ("response_id", "conversation_id")} for x in exchanges]


async def imported(client: KsiClient, document: dict[str, Any], new_id: str = "tools") -> dict[str, Any]:
    return await client.request("conversation:import", {"data": document, "new_id": new_id})


async def test_an_imported_tool_conversation_shows_its_items_and_is_stored_as_record_lines(
        daemon: Daemon, client: KsiClient) -> None:
    await store_image(daemon)
    result = await imported(client, tool_document())
    assert (result["exchanges"], result["skipped"]) == (3, 0)
    shown = await client.request("conversation:show", {"conversation_id": "tools"})
    first, second, third = shown["exchanges"]
    assert first["input"] == [{"type": "message", "role": "user", "content": "What is the weather in Oslo?"}]
    assert first["output"] == [{"type": "message", "role": "assistant", "content": "Let me check."}, CALL]
    assert second["input"] == [OUTPUT] and second["inputs"][0]["type"] == "function_call_output"
    assert second["output"] == [{"type": "message", "role": "assistant", "content": "It is 12C in Oslo."}]
    assert third["input"][0]["content"][1] == {"type": "input_image", "image": IMAGE}
    assert third["output"][0] == {"type": "reasoning", "summary": "looked at the whiskers"}
    assert third["reply"]["content"] == "A cat."

    # stored as ksi_common.items lays items out in a record: readers made before items see text
    lines = [await stored_response(daemon, x["response_id"]) for x in shown["exchanges"]]
    assert lines[0] is not None and lines[1] is not None and lines[2] is not None
    assert lines[0][-1]["content"] == "Let me check." and lines[0][-1]["output"][1] == CALL
    assert {k: lines[1][0][k] for k in ("type", "call_id", "output")} == OUTPUT
    assert "output" not in lines[1][-1]  # a plain reply keeps the old outcome line
    assert lines[2][0]["type"] == "user" and lines[2][0]["content"] == "And what is in this picture?"
    assert lines[2][0]["parts"][1]["image"] == IMAGE
    # without counts in the document, tokens are counted from each item's text
    index = await stored_index(daemon, "tools")
    call_text = '[call weather({"city": "Oslo"}) id=c1]'
    assert index[0]["tokens_out"] == len("Let me check." + call_text) // 4 + 4
    assert index[1]["tokens_in"] == len("[output of c1: 12C]") // 4 + 4
    # search reads the items: a tool's output and a call's arguments are found
    for text in ("12C", "Oslo", "whiskers"):
        found = await client.request("conversation:list", {"text": text})
        assert [c["conversation_id"] for c in found["conversations"]] == ["tools"], text


@pytest.mark.parametrize("fmt", ["json", "jsonl"])
async def test_export_then_import_then_export_gives_the_same_transcript(
        daemon: Daemon, client: KsiClient, fmt: str) -> None:
    await store_image(daemon)
    await imported(client, tool_document(), "first")
    exported = await client.request("conversation:export", {"conversation_id": "first", "format": fmt})
    again = await client.request("conversation:import", {"data": exported["content"], "new_id": "second"})
    assert again["exchanges"] == 3
    re_exported = await client.request("conversation:export", {"conversation_id": "second", "format": fmt})
    before = orjson.loads(exported["content"]) if fmt == "json" else [orjson.loads(x) for x in
                                                                         exported["content"].splitlines()]
    after = orjson.loads(re_exported["content"]) if fmt == "json" else [orjson.loads(x) for x in
                                                                           re_exported["content"].splitlines()]
    exchanges_before = before["exchanges"] if fmt == "json" else before[1:]
    exchanges_after = after["exchanges"] if fmt == "json" else after[1:]
    assert same_transcript(exchanges_after) == same_transcript(exchanges_before)
    assert [x["output"] for x in exchanges_after][0][1] == CALL
    assert exchanges_after[2]["input"][0]["content"][1]["image"] == IMAGE
    markdown = [(await client.request("conversation:export", {"conversation_id": c, "format": "markdown"}))["content"]
                for c in ("first", "second")]
    exchanges_shown = [text[text.index("## 1."):] for text in markdown]  # after the facts (creation times)
    assert exchanges_shown[0] == exchanges_shown[1]


def _damaged(change: Any) -> dict[str, Any]:
    exchanges = tool_exchanges()
    change(exchanges)
    return tool_document(*exchanges)


@pytest.mark.parametrize(("change", "code", "field"), [
    (lambda x: x[1]["input"][0].update(call_id="c9"), "unknown_call_id", "data.exchanges.1.input.0.call_id"),
    (lambda x: x[0]["input"].insert(0, dict(OUTPUT)), "unknown_call_id", "data.exchanges.0.input.0.call_id"),
    (lambda x: x[1]["output"].append(dict(CALL)), "duplicate_call_id", "data.exchanges.1.output.1.call_id"),
    (lambda x: x[2]["input"].append(dict(OUTPUT)), "duplicate_call_id", "data.exchanges.2.input.1.call_id"),
    (lambda x: x[0]["output"][1].update(arguments={"city": "Oslo"}), "arguments_not_json",
     "data.exchanges.0.output.1.arguments"),
    (lambda x: x[2]["output"].append({"type": "web_search_call", "id": "w"}), "unknown_item_type",
     "data.exchanges.2.output.2.type"),
    (lambda x: x[2]["input"][0]["content"].append({"type": "input_audio", "audio": {}}), "unknown_item_type",
     "data.exchanges.2.input.0.content.2.type"),
    # an image carried as its bytes (a data URL) is never imported
    (lambda x: x[2]["input"][0]["content"][1]["image"].update(url="data:image/png;base64,AAAA"), "validation_error",
     "data.exchanges.2.input.0.content.1.image.url"),
    # a plain http URL is refused here as a request's image URL is
    (lambda x: x[2]["input"][0]["content"][1]["image"].update(url="http://images.invalid/cat.png"),
     "validation_error", "data.exchanges.2.input.0.content.1.image.url"),
    (lambda x: x[2]["input"][0]["content"][1]["image"].update(width=0), "validation_error",
     "data.exchanges.2.input.0.content.1.image.width"),
    # the picture's bytes were never stored here (this test stores none): an export from another machine
    (lambda x: None, "image_not_stored", "data.exchanges.2.input.0.content.1.image.sha256"),
])
async def test_each_fault_of_imported_items_has_its_code_and_writes_nothing(
        daemon: Daemon, client: KsiClient, change: Any, code: str, field: str) -> None:
    document = _damaged(change)
    before = await stored_snapshot(daemon.settings)
    with pytest.raises(KsiError) as caught:
        await imported(client, document)
    assert caught.value.code == code, caught.value
    assert field in caught.value.details["fields"], caught.value.details
    assert await stored_snapshot(daemon.settings) == before
    with pytest.raises(KsiError) as missing:
        await client.request("conversation:show", {"conversation_id": "tools"})
    assert missing.value.code == "conversation_not_found"


async def test_items_on_the_wrong_side_or_malformed_are_validation_errors(daemon: Daemon, client: KsiClient) -> None:
    before = await stored_snapshot(daemon.settings)
    for change, field in (
            (lambda x: x[0]["input"].append(dict(CALL, call_id="c0")), "data.exchanges.0.input.1.type"),
            (lambda x: x[1]["output"].insert(0, dict(OUTPUT)), "data.exchanges.1.output.0.type"),
            (lambda x: x[0]["output"][1].update(name=""), "data.exchanges.0.output.1.name"),
            (lambda x: x[0]["output"].append("a call"), "data.exchanges.0.output.2"),
            # a call left without its output when the user speaks again
            (lambda x: x[1].update(input=[{"type": "message", "role": "user", "content": "never mind"}]),
             "data.exchanges.1.input.0"),
            (lambda x: x[2]["input"][0]["content"][1]["image"].pop("sha256"), "data.exchanges.2.input.0.content.1.image"),
            (lambda x: x[2]["input"][0]["content"][1]["image"].update(bytes=-1),
             "data.exchanges.2.input.0.content.1.image.bytes"),
            (lambda x: x[0].update(inputs=[{"type": "user", "content": "a"}, {"type": "user", "content": "b"}]),
             "data.exchanges.0.inputs")):
        with pytest.raises(KsiError) as caught:
            await imported(client, _damaged(change))
        assert caught.value.code == "validation_error", caught.value
        assert field in caught.value.details["fields"], caught.value.details
    assert await stored_snapshot(daemon.settings) == before


async def test_an_export_made_before_items_still_imports_and_shows_as_messages(daemon: Daemon,
                                                                               client: KsiClient) -> None:
    old = {"v": 1, "format": "ksi.conversation", "conversation": {"conversation_id": "old", "title": "Old"},
           "exchanges": [{"inputs": [{"type": "system", "content": "be brief", "ts": TS},
                                     {"type": "user", "content": "hi", "ts": TS}],
                          "reply": {"content": "hello", "model": "echo/x", "ts": TS}, "model": "echo/x", "ts": TS}]}
    result = await imported(client, copy.deepcopy(old), "from-old")
    assert result["exchanges"] == 1
    shown = await client.request("conversation:show", {"conversation_id": "from-old"})
    (exchange,) = shown["exchanges"]
    assert exchange["input"] == [{"type": "message", "role": "system", "content": "be brief"},
                                 {"type": "message", "role": "user", "content": "hi"}]
    assert exchange["output"] == [{"type": "message", "role": "assistant", "content": "hello"}]
    assert [(i["type"], i["content"]) for i in exchange["inputs"]] == [("system", "be brief"), ("user", "hi")]
    lines = await stored_response(daemon, exchange["response_id"])
    assert lines is not None and [line["type"] for line in lines] == ["system", "user", "assistant"]
    assert "parts" not in lines[1] and "output" not in lines[2]  # the old line shapes, unchanged


async def test_markdown_export_shows_calls_outputs_reasoning_and_image_references(
        daemon: Daemon, client: KsiClient) -> None:
    await store_image(daemon)
    await imported(client, tool_document())
    markdown = (await client.request("conversation:export", {"conversation_id": "tools", "format": "markdown"}))["content"]
    assert "**User**\n\nWhat is the weather in Oslo?\n\n**Assistant**\n\nLet me check.\n\n" \
           "**Tool call** `weather` (call `c1`)\n\n```json\n{\"city\": \"Oslo\"}\n```\n" in markdown
    assert "**Tool output** (call `c1`)\n\n```\n12C\n```\n\n**Assistant**\n\nIt is 12C in Oslo." in markdown
    assert f"- [image sha256:{IMAGE_SHA[:12]}\u2026 image/png 3 KB]" in markdown
    assert "**Reasoning summary**\n\n> looked at the whiskers\n\n**Assistant**\n\nA cat." in markdown


async def test_what_was_sent_shows_the_tool_turns(daemon: Daemon, client: KsiClient) -> None:
    await store_image(daemon)
    await imported(client, tool_document())
    sent = await client.request("conversation:sent", {"conversation_id": "tools", "n": 3})
    history = [m for m in sent["messages"] if m["part"] == "history"]
    assert history == [
        {"role": "user", "content": "What is the weather in Oslo?", "part": "history", "n": 1},
        {"role": "assistant", "content": "Let me check.", "part": "history", "n": 1,
         "tool_calls": [{"call_id": "c1", "name": "weather", "arguments": '{"city": "Oslo"}'}]},
        {"role": "tool", "call_id": "c1", "content": "12C", "part": "history", "n": 2},
        {"role": "assistant", "content": "It is 12C in Oslo.", "part": "history", "n": 2}]
    (new_input,) = [m for m in sent["messages"] if m["part"] == "input"]
    assert new_input["content"] == f"And what is in this picture? [image sha256:{IMAGE_SHA[:12]}\u2026 image/png 3 KB]"
    assert sent["output"][0] == {"type": "reasoning", "summary": "looked at the whiskers"}
    second = await client.request("conversation:sent", {"conversation_id": "tools", "n": 2})
    assert [m for m in second["messages"] if m["part"] == "input"] == [
        {"role": "tool", "call_id": "c1", "content": "12C", "part": "input", "n": 2}]


def _write_lines(path: Path, lines: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in lines))


def old_var_dir(root: Path) -> VarLayout:
    """A var dir as a daemon wrote it before items: one user line in, one assistant line out."""
    layout = VarLayout(root)
    _write_lines(layout.response_file("echo-x-000000000001"), [
        {"v": 1, "type": "user", "content": "hello from before", "ts": TS, "conversation_id": "before"},
        {"v": 1, "type": "assistant", "content": "an answer from before", "model": "echo/x", "usage": {},
         "ts": TS, "conversation_id": "before"}])
    _write_lines(layout.index_file("before"), [
        {"v": 1, "n": 1, "response_id": "echo-x-000000000001", "ts": TS, "model": "echo/x", "provider": "echo",
         "agent_id": None, "tokens_in": 5, "tokens_out": 6}])
    return layout


async def test_a_record_written_before_items_shows_as_it_did(short_tmp: Path) -> None:
    reader = open_reader("jsonl", old_var_dir(short_tmp / "var"))
    try:
        transcript = await Transcripts(reader).transcript("before")
    finally:
        await reader.aclose()
    (exchange,) = transcript["exchanges"]
    assert exchange["inputs"] == [{"type": "user", "content": "hello from before", "ts": TS}]
    assert exchange["reply"]["content"] == "an answer from before"
    assert exchange["input"] == [{"type": "message", "role": "user", "content": "hello from before"}]
    assert exchange["output"] == [{"type": "message", "role": "assistant", "content": "an answer from before"}]
    markdown = render_markdown(transcript)
    assert markdown.endswith("## 1. echo/x · 2026-01-02T03:04:05Z\n\n**User**\n\nhello from before\n\n"
                             "**Assistant**\n\nan answer from before\n")


async def test_a_tool_output_given_as_an_input_line_imports_like_its_item(daemon: Daemon, client: KsiClient) -> None:
    exchanges = tool_exchanges()[:2]
    del exchanges[1]["input"]
    exchanges[1]["inputs"] = [{"type": "function_call_output", "call_id": "c1", "output": "12C", "ts": TS}]
    await imported(client, tool_document(*exchanges))
    shown = await client.request("conversation:show", {"conversation_id": "tools"})
    assert shown["exchanges"][1]["input"] == [OUTPUT]
    exchanges[1]["inputs"][0]["call_id"] = "c2"
    with pytest.raises(KsiError) as caught:
        await imported(client, tool_document(*exchanges), "other")
    assert caught.value.code == "unknown_call_id"
    assert "data.exchanges.1.inputs.0.call_id" in caught.value.details["fields"]


async def test_a_migration_carries_the_items_of_a_tool_conversation(short_tmp: Path) -> None:
    """Records are moved as the readers see them: a tool output line is an input like any other."""
    async with running_daemon(short_tmp / "a") as source_daemon, connected(source_daemon) as client:
        await store_image(source_daemon)
        await imported(client, tool_document())
        exported = (await client.request("conversation:export", {"conversation_id": "tools", "format": "jsonl"}))
    source, destination = (JsonlStorage(make_settings(short_tmp / side, fsync="never")) for side in ("a", "b"))
    await source.open()
    await destination.open()
    try:
        assert (await migrate(source, destination)).verified
    finally:
        await source.close()
        await destination.close()
    async with running_daemon(short_tmp / "b") as copy_daemon, connected(copy_daemon) as client:
        copied = await client.request("conversation:export", {"conversation_id": "tools", "format": "jsonl"})
    assert copied["content"] == exported["content"]
    assert '"function_call_output"' in copied["content"]


async def test_a_call_whose_output_is_in_a_skipped_exchange_is_refused_before_the_user_speaks_again(
        daemon: Daemon, client: KsiClient) -> None:
    """Exchanges without a reply are skipped first; calls are matched with outputs over the kept ones."""
    first, second, _third = tool_exchanges()
    lost = {**second, "output": [], "reply": None}  # the tool's output came back, the reply was lost
    later = {"ts": TS, "model": "openai/stub-a", "input": [{"type": "message", "role": "user", "content": "and now?"}],
             "output": [{"type": "message", "role": "assistant", "content": "Sunny."}],
             "reply": {"content": "Sunny.", "model": "openai/stub-a", "ts": TS}}
    before = await stored_snapshot(daemon.settings)
    with pytest.raises(KsiError) as caught:
        await imported(client, tool_document(first, lost, later))
    assert caught.value.code == "validation_error"
    assert "data.exchanges.2.input.0" in caught.value.details["fields"], caught.value.details
    assert await stored_snapshot(daemon.settings) == before
    # skipped last, the call is simply the newest one still waiting for its output: imported
    result = await imported(client, tool_document(first, lost))
    assert (result["exchanges"], result["skipped"]) == (1, 1)
    shown = await client.request("conversation:show", {"conversation_id": "tools"})
    assert [x["output"][-1]["type"] for x in shown["exchanges"]] == ["function_call"]


async def test_an_imported_image_keeps_its_size_and_counts_as_an_image(daemon: Daemon, client: KsiClient) -> None:
    await store_image(daemon)
    exchanges = tool_exchanges()
    image = exchanges[2]["input"][0]["content"][1]["image"]
    image.update(width=1024, height=1024, name="/home/someone/pictures/cat.png")
    await imported(client, tool_document(*exchanges))
    index = await stored_index(daemon, "tools")
    text = "And what is in this picture? [image cat.png]"
    assert index[2]["tokens_in"] == len(text) // 4 + 4 + image_tokens("openai/stub-a", 1024, 1024)
    assert image_tokens("openai/stub-a", 1024, 1024) > 700  # four tiles: far more than its label
    exported = await client.request("conversation:export", {"conversation_id": "tools", "format": "json"})
    ref = orjson.loads(exported["content"])["exchanges"][2]["input"][0]["content"][1]["image"]
    assert ref == {**IMAGE, "width": 1024, "height": 1024, "name": "cat.png"}  # no directory of the other machine
    again = await client.request("conversation:import", {"data": exported["content"], "new_id": "again"})
    assert again["exchanges"] == 3
    assert (await stored_index(daemon, "again"))[2]["tokens_in"] == index[2]["tokens_in"]
