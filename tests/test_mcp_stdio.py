"""`ksi mcp` spawned over stdio by the official `mcp` client, against an in-process daemon and
the local stub: tools, resources, notifications, continuity with `ksi ask`, and bad input."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TextIO

import mcp_types as types
import pytest
from mcp import Client, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.shared.exceptions import MCPError

from ksi_common.jsonl import read_records
from ksi_daemon.daemon import Daemon
from tests.conftest import complete, connected, running_daemon, stub_settings
from tests.stub_openai import Reply, StubOpenAI, default_answer
from tests.test_cli_ask import clean_env, ksi, where

TOKEN_GOAL = 2000


def judge_or_answer(messages: list[dict[str, Any]]) -> str:
    """The stub answers like a member, or like an arbiter when asked to judge."""
    if "arbiter of a consortium" in str(messages[0].get("content")):
        return json.dumps({"synthesis": "the members agree", "confidence": 0.9, "dissent": "B doubts the date",
                           "refinement_areas": [], "needs_iteration": False, "ranking": [1]})
    return default_answer(messages)


@asynccontextmanager
async def mcp_session(root: Path, *args: str, mode: str = "auto", errlog: TextIO | None = None,
                      **client_options: Any) -> AsyncIterator[Client]:
    """The official client talking to `ksi mcp ARGS` spawned in `root`."""
    params = StdioServerParameters(command=sys.executable, args=["-m", "ksi_cli", "mcp", *args],
                                   env=clean_env(), cwd=str(root))
    transport = stdio_client(params, errlog=errlog or sys.stderr)
    async with Client(transport, mode=mode, **client_options) as client:
        yield client


@asynccontextmanager
async def served(root: Path, stub: StubOpenAI, **overrides: Any) -> AsyncIterator[tuple[Daemon, Client]]:
    async with running_daemon(root, **stub_settings(stub, **overrides)) as daemon:
        async with mcp_session(root, *where(root)) as client:
            yield daemon, client


async def conforms(client: Client, tool: str, result: types.CallToolResult) -> None:
    """The structured result validates against the output schema the tool list gives."""
    import jsonschema

    listed = {t.name: t for t in (await client.list_tools()).tools}
    jsonschema.validate(result.structured_content, listed[tool].output_schema)


async def call(client: Client, tool: str, **arguments: Any) -> dict[str, Any]:
    """A successful tool call's structured result, valid against the tool's output schema."""
    result = await client.call_tool(tool, arguments)
    assert not result.is_error, result.content
    assert isinstance(result.content[0], types.TextContent)
    await conforms(client, tool, result)
    return result.structured_content


async def refused(client: Client, code: str, tool: str, **arguments: Any) -> dict[str, Any]:
    """A tool call that fails with KSI's `code`, in the text and in the structured error."""
    result = await client.call_tool(tool, arguments)
    assert result.is_error, result.content
    text = result.content[0].text
    assert text.startswith(f"{code}: "), text
    assert result.structured_content["error"]["code"] == code
    await conforms(client, tool, result)
    return result.structured_content["error"]


async def ignore_progress(_progress: float, _total: float | None, _message: str | None) -> None:
    """A progress callback, which makes the client send a progress token."""


def tokens(text: str) -> int:
    """Tokens as litellm counts them for OpenAI models (cl100k), from litellm's bundled files."""
    import importlib.util

    import tiktoken

    spec = importlib.util.find_spec("litellm")
    assert spec is not None and spec.submodule_search_locations
    os.environ.setdefault("TIKTOKEN_CACHE_DIR",
                          str(Path(spec.submodule_search_locations[0]) / "litellm_core_utils" / "tokenizers"))
    return len(tiktoken.get_encoding("cl100k_base").encode(text))


async def test_tool_list_is_valid_and_under_the_token_goal(short_tmp: Path, stub: StubOpenAI) -> None:
    import jsonschema

    async with served(short_tmp, stub) as (_daemon, client):
        listed = await client.list_tools()
    names = [tool.name for tool in listed.tools]
    assert names == ["chat", "consensus", "conversations", "conversation", "fork", "agent_message"]
    for tool in listed.tools:
        jsonschema.Draft202012Validator.check_schema(tool.input_schema)
        assert tool.description and tool.input_schema["type"] == "object"
    wire = json.dumps([tool.model_dump(by_alias=True, exclude_none=True, mode="json") for tool in listed.tools])
    assert tokens(wire) < TOKEN_GOAL


async def test_tools_carry_titles_annotations_and_output_schemas(short_tmp: Path, stub: StubOpenAI) -> None:
    import jsonschema

    async with served(short_tmp, stub) as (_daemon, client):
        listed = (await client.list_tools()).tools
    for tool in listed:
        assert tool.title and tool.annotations is not None and tool.annotations.destructive_hint is False
        assert tool.output_schema is not None and tool.output_schema["type"] == "object"
        jsonschema.Draft202012Validator.check_schema(tool.output_schema)
    # `conversation` pins and unpins too, so only the listing is read-only
    assert {t.name for t in listed if t.annotations.read_only_hint} == {"conversations"}
    assert {t.name for t in listed if t.annotations.open_world_hint} == {"chat", "consensus", "agent_message"}
    # what each tool returns is checked against these schemas by `call` and `refused` in every test here


async def test_chat_consensus_search_transcript_fork_and_resources(short_tmp: Path) -> None:
    async with StubOpenAI(answer=judge_or_answer) as stub, served(short_tmp, stub) as (daemon, client):
        first = await call(client, "chat", prompt="Where is the lighthouse?", model="openai/stub-model")
        cid = first["continuation_id"]
        assert first["answer"] == "stub answer to: Where is the lighthouse?"
        assert first["turns_left"] is None and first["left_out"] == {"exchanges": 0, "files": 0}

        second = await client.call_tool("chat", {"prompt": "And how tall?", "continuation_id": cid})
        assert second.structured_content["continuation_id"] == cid
        assert f"continuation_id: {cid}" in second.content[0].text
        assert [m["content"] for m in stub.messages()] == [
            "Where is the lighthouse?", "stub answer to: Where is the lighthouse?", "And how tall?"]

        streamed = await client.call_tool(  # a progress token streams the consortium's answer
            "consensus", {"prompt": "When was it built?", "continuation_id": cid,
                          "models": ["openai/stub-a", "openai/stub-b"]}, progress_callback=ignore_progress)
        await conforms(client, "consensus", streamed)
        agreed = streamed.structured_content
        assert agreed["continuation_id"] == cid and agreed["answer"] == "the members agree"
        assert agreed["confidence"] == 0.9 and agreed["dissent"] == "B doubts the date"
        member_calls = [r["messages"] for r in stub.requests if r["model"] == "stub-b"]
        assert member_calls and "And how tall?" in [m["content"] for m in member_calls[0]]

        async with connected(daemon) as socket:
            await socket.request("conversation:update", {"conversation_id": cid, "title": "Harbour notes"})
            other = await socket.request("completion:async", {"prompt": "unrelated", "conversation_id": "other",
                                                              "create": True})
            await socket.request("completion:wait", {"request_id": other["request_id"]})
        by_title = await call(client, "conversations", query="harbour")
        assert [c["continuation_id"] for c in by_title["conversations"]] == [cid]
        assert by_title["conversations"][0]["turns"] == 3 and by_title["conversations"][0]["title"] == "Harbour notes"
        by_content = await call(client, "conversations", query="LIGHTHOUSE")
        assert [c["continuation_id"] for c in by_content["conversations"]] == [cid]
        newest = await call(client, "conversations", limit=5)
        assert [c["continuation_id"] for c in newest["conversations"]] == ["other", cid]

        transcript = await client.call_tool("conversation", {"continuation_id": cid})
        assert "Where is the lighthouse?" in transcript.content[0].text
        assert "the members agree" in transcript.content[0].text
        as_json = await client.call_tool("conversation", {"continuation_id": cid, "format": "json"})
        assert len(json.loads(as_json.content[0].text)["exchanges"]) == 3

        fork = await call(client, "fork", continuation_id=cid, at=1)
        assert fork["parent_id"] == cid and fork["fork_at"] == 1
        await call(client, "chat", prompt="On the fork", continuation_id=fork["continuation_id"])
        assert [m["content"] for m in stub.messages()] == [
            "Where is the lighthouse?", "stub answer to: Where is the lighthouse?", "On the fork"]

        page = await client.read_resource(f"ksi://conversations/{cid}")
        assert page.contents[0].mime_type == "text/markdown" and "And how tall?" in page.contents[0].text
        listing = json.loads((await client.read_resource("ksi://conversations")).contents[0].text)
        assert {c["conversation_id"] for c in listing["conversations"]} == {cid, "other", fork["continuation_id"]}
        listed = await client.list_resources()
        assert "ksi://conversations" in [r.uri for r in listed.resources]
        assert f"ksi://conversations/{cid}" in [r.uri for r in listed.resources]
        templates = await client.list_resource_templates()
        assert [t.uri_template for t in templates.resource_templates] == ["ksi://conversations/{id}"]
        assert len(read_records(daemon.layout.index_file(cid))) == 3


async def test_the_conversations_tool_names_origin_first_input_and_fork(short_tmp: Path, stub: StubOpenAI) -> None:
    async with served(short_tmp, stub) as (daemon, client):
        cid = (await call(client, "chat", prompt="Where   is\nthe lighthouse?"))["continuation_id"]
        await call(client, "chat", prompt="And how tall?", continuation_id=cid)
        fork = (await call(client, "fork", continuation_id=cid, at=1))["continuation_id"]
        async with connected(daemon) as socket:
            await complete(socket, prompt="from the command line", conversation_id="by-cli", create=True, origin="cli")
        shown = await client.call_tool("conversations", {"limit": 10})
    listed = {c["continuation_id"]: c for c in shown.structured_content["conversations"]}
    assert {key: listed[cid][key] for key in ("origin", "preview", "turns", "inherited", "fork_of")} == {
        "origin": "mcp", "preview": "Where is the lighthouse?", "turns": 2, "inherited": 0, "fork_of": None}
    assert {key: listed[fork][key] for key in ("origin", "preview", "turns", "inherited", "fork_of")} == {
        "origin": "mcp", "preview": "Where is the lighthouse?", "turns": 1, "inherited": 1, "fork_of": cid}
    assert listed["by-cli"]["origin"] == "cli"
    text = shown.content[0].text
    assert f"{cid} | \u201cWhere is the lighthouse?\u201d |" in text and "from mcp" in text
    assert f"{fork} | \u201cWhere is the lighthouse?\u201d | openai/stub-model | 1 turns, 1 inherited from {cid}" in text
    assert "by-cli | \u201cfrom the command line\u201d |" in text and "from cli" in text


async def test_continuity_mcp_then_cli_then_mcp(short_tmp: Path, stub: StubOpenAI) -> None:
    async with served(short_tmp, stub) as (_daemon, client):
        cid = (await call(client, "chat", prompt="one"))["continuation_id"]
        run = await ksi(short_tmp, "ask", *where(short_tmp), "--conversation", cid, "--json", "two")
        assert run.code == 0, run.err
        assert run.json()["conversation_id"] == cid
        third = await call(client, "chat", prompt="three", continuation_id=cid)
    assert third["continuation_id"] == cid
    assert [m["content"] for m in stub.messages()] == [
        "one", "stub answer to: one", "two", "stub answer to: two", "three"]


async def test_continues_across_a_daemon_restart(short_tmp: Path, stub: StubOpenAI) -> None:
    async with mcp_session(short_tmp, *where(short_tmp), "--no-start") as client:
        async with running_daemon(short_tmp, **stub_settings(stub)):
            cid = (await call(client, "chat", prompt="before the restart"))["continuation_id"]
        await refused(client, "daemon_unreachable", "conversations")  # down, and not to be started
        async with running_daemon(short_tmp, **stub_settings(stub)):
            after = await call(client, "chat", prompt="after it", continuation_id=cid)
    assert after["continuation_id"] == cid
    assert [m["content"] for m in stub.messages()] == [
        "before the restart", "stub answer to: before the restart", "after it"]


async def test_agent_message_and_turns_left(short_tmp: Path, stub: StubOpenAI) -> None:
    async with served(short_tmp, stub) as (daemon, client):
        async with connected(daemon) as socket:
            await socket.request("agent:spawn", {"agent_id": "helper"})
            capped = await socket.request("completion:async", {"prompt": "x", "conversation_id": "capped",
                                                               "create": True})
            await socket.request("completion:wait", {"request_id": capped["request_id"]})
            await socket.request("conversation:update", {"conversation_id": "capped", "turn_cap": 3})
        answered = await client.call_tool("agent_message", {"agent_id": "helper", "message": "status?"},
                                          progress_callback=ignore_progress)
        await conforms(client, "agent_message", answered)
        reply = answered.structured_content
        assert reply["agent_id"] == "helper" and reply["answer"] == "stub answer to: status?"
        # the agent's conversation continues from MCP like any other
        await call(client, "chat", prompt="and now?", continuation_id=reply["continuation_id"])
        assert [m["content"] for m in stub.messages() if m["role"] != "system"] == [
            "status?", "stub answer to: status?", "and now?"]
        assert (await call(client, "chat", prompt="y", continuation_id="capped"))["turns_left"] == 1
        last = await client.call_tool("chat", {"prompt": "z", "continuation_id": "capped"})
        assert last.structured_content["turns_left"] == 0 and "turns left: 0" in last.content[0].text
        await refused(client, "conversation_full", "chat", prompt="more", continuation_id="capped")


async def test_bad_input_is_a_tool_error_with_ksis_code(short_tmp: Path, stub: StubOpenAI) -> None:
    allowed = short_tmp / "allowed"
    allowed.mkdir()
    (allowed / "notes.txt").write_text("inside")
    outside = short_tmp / "secret.txt"
    outside.write_text("outside")
    async with served(short_tmp, stub, allowed_file_roots=[allowed]) as (daemon, client):
        await refused(client, "conversation_not_found", "chat", prompt="hi", continuation_id="nope")
        await refused(client, "conversation_not_found", "conversation", continuation_id="nope")
        await refused(client, "conversation_not_found", "fork", continuation_id="nope", at=0)
        wrong = await refused(client, "validation_error", "chat", prompt=42, files="notes.txt")
        assert wrong["details"]["fields"] == {"prompt": "must be a string", "files": "must be an array"}
        assert (await refused(client, "validation_error", "fork", continuation_id="x"))["details"]["fields"] == {
            "at": "required"}
        await refused(client, "validation_error", "conversations", status="lost", limit=0)
        await refused(client, "validation_error", "chat", prompt="hi", temperature=2)
        await refused(client, "validation_error", "consensus", prompt="hi")
        await refused(client, "validation_error", "chat", prompt="hi", continuation_id="../escape")
        await refused(client, "path_not_allowed", "chat", prompt="read it", files=[str(outside)])
        await refused(client, "agent_not_found", "agent_message", agent_id="ghost", message="hi")
        await refused(client, "consortium_not_found", "consensus", prompt="hi", consortium="consortium/nope")
        with pytest.raises(MCPError) as unknown:  # a protocol error, as the spec says, not a tool's
            await client.call_tool("no_such_tool", {})
        assert unknown.value.error.code == types.INVALID_PARAMS and "no_such_tool" in unknown.value.error.message

        kept = await call(client, "chat", prompt="read it", files=["allowed/notes.txt"])  # relative to cwd
        cid = kept["continuation_id"]
        async with connected(daemon) as socket:
            await socket.request("conversation:update", {"conversation_id": cid, "ttl": 0.001})
        await asyncio.sleep(0.01)
        await refused(client, "conversation_expired", "chat", prompt="late", continuation_id=cid)
        # nothing was written for the refused calls, and the one good exchange is intact
        assert len(read_records(daemon.layout.index_file(cid))) == 1
        assert sorted(p.stem for p in daemon.layout.conversations_dir.glob("*.jsonl")) == [cid]
        assert not (daemon.layout.root / ".." / "escape").exists()
        assert len(stub.requests) == 1
        assert len((await client.list_tools()).tools) == 6  # the server lived through all of it


async def test_daemon_down_and_unstartable_is_a_tool_error(short_tmp: Path) -> None:
    blocked = short_tmp / "blocked"
    blocked.write_text("a file where a directory on the var dir's path should be")
    errors = tempfile.TemporaryFile("w+")
    async with mcp_session(short_tmp, "--var-dir", str(blocked / "var"), "--socket", str(short_tmp / "d.sock"),
                           errlog=errors) as client:
        error = await refused(client, "daemon_unreachable", "chat", prompt="hi")
        assert "could not be started" in error["message"] or "none could be started" in error["message"]
        await refused(client, "daemon_unreachable", "conversations")
        assert len((await client.list_tools()).tools) == 6
    async with mcp_session(short_tmp, "--no-start", "--socket", str(short_tmp / "none.sock")) as client:
        await refused(client, "daemon_unreachable", "conversations")


async def test_starts_the_daemon_when_none_runs(short_tmp: Path) -> None:
    errors = tempfile.TemporaryFile("w+")
    try:
        async with mcp_session(short_tmp, *where(short_tmp), errlog=errors) as client:
            found = await call(client, "conversations")
            assert found == {"conversations": [], "total": 0}
        errors.seek(0)
        assert "ksi mcp: daemon started (pid" in errors.read()
        assert (short_tmp / "d.sock").exists()
    finally:
        run = await ksi(short_tmp, "daemon", "stop", *where(short_tmp))
        assert run.code == 0 and "stopped" in run.out


@pytest.mark.filterwarnings("ignore:resources/subscribe is removed")  # the legacy era, on purpose
async def test_resource_subscriptions_notify_both_protocol_eras(short_tmp: Path, stub: StubOpenAI) -> None:
    updated: asyncio.Queue[str] = asyncio.Queue()

    async def on_message(message: Any) -> None:
        if isinstance(message, types.ResourceUpdatedNotification):
            updated.put_nowait(message.params.uri)

    async with running_daemon(short_tmp, **stub_settings(stub)):
        async with mcp_session(short_tmp, *where(short_tmp), mode="legacy", message_handler=on_message) as old:
            cid = (await call(old, "chat", prompt="first"))["continuation_id"]
            uri = f"ksi://conversations/{cid}"
            await old.session.subscribe_resource(uri)
            await call(old, "chat", prompt="second", continuation_id=cid)
            assert await asyncio.wait_for(updated.get(), 10) == uri

        async with mcp_session(short_tmp, *where(short_tmp)) as new:
            assert new.protocol_version >= "2026"
            async with new.listen(resource_subscriptions=[uri, "ksi://conversations"]) as subscription:
                await call(new, "chat", prompt="third", continuation_id=cid)
                seen = set()
                async with asyncio.timeout(10):
                    async for event in subscription:
                        seen.add(event.uri)
                        if seen == {uri, "ksi://conversations"}:
                            break


async def test_long_output_is_cut_with_a_pointer_to_the_resource(short_tmp: Path, stub: StubOpenAI) -> None:
    from ksi_mcp.socket_caller import SocketCaller
    from ksi_mcp.tools import Tools

    stub.answer = lambda messages: "x" * 3000
    async with running_daemon(short_tmp, **stub_settings(stub)) as daemon:
        caller = SocketCaller(daemon.settings.socket)
        try:
            tools = Tools(caller, output_limit=1000)
            reply = await tools.call("chat", {"prompt": "long"})
            cid = reply.data["continuation_id"]
            assert len(reply.text) <= 1000 and reply.data["answer"] == "x" * 3000
            assert f"ksi://conversations/{cid}]" in reply.text and f"continuation_id: {cid}" in reply.text
            transcript = await tools.call("conversation", {"continuation_id": cid})
            assert len(transcript.text) <= 1000 and transcript.data["cut"] is True
            assert transcript.text.endswith(f"for the rest read the resource ksi://conversations/{cid}]")
        finally:
            await caller.close()


async def test_mcp_command_stays_off_the_daemon(short_tmp: Path) -> None:
    code = ("import sys, ksi_cli.main, ksi_cli.mcp_command\n"
            "assert 'mcp' not in sys.modules, 'ksi itself must not import the SDK'\n"
            "import ksi_mcp.server, ksi_mcp.socket_caller\n"
            "bad = [m for m in sys.modules if m.startswith('ksi_daemon') or m == 'litellm']\n"
            "assert not bad, bad\n")
    process = await asyncio.create_subprocess_exec(sys.executable, "-c", code, cwd=short_tmp, env=clean_env(),
                                                   stderr=asyncio.subprocess.PIPE)
    _out, err = await process.communicate()
    assert process.returncode == 0, err.decode()


async def test_a_cancelled_tool_call_cancels_the_request(short_tmp: Path, stub: StubOpenAI) -> None:
    stub.hold = 8.0  # the answer takes this long (the stub waits it out when it stops)
    async with served(short_tmp, stub) as (daemon, client), connected(daemon) as socket:
        await socket.request("monitor:subscribe", {"patterns": ["completion:cancelled"]})
        call_task = asyncio.create_task(client.call_tool("chat", {"prompt": "slow"}))
        async with asyncio.timeout(60):  # the first call loads litellm
            while stub.in_flight == 0:
                await asyncio.sleep(0.01)
        call_task.cancel()
        pushed = await socket.next_push(timeout=10)
        assert pushed is not None and pushed["event"] == "completion:cancelled"
        assert len((await client.list_tools()).tools) == 6


async def test_a_malformed_line_is_answered_and_the_server_goes_on(short_tmp: Path) -> None:
    from ksi_mcp.stdio import LINE_LIMIT

    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "ksi_cli", "mcp", "--no-start", *where(short_tmp), cwd=short_tmp, env=clean_env(),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    assert process.stdin is not None and process.stdout is not None
    hello = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}}
    huge = b'{"jsonrpc": "2.0", "id": 8, "method": "tools/list", "params": {"pad": "' + b"x" * LINE_LIMIT + b'"}}'
    lines = [hello, "this is not json", huge, {"jsonrpc": "2.0", "id": 7, "no": "method"},
             {"jsonrpc": "2.0", "method": "notifications/initialized"},
             {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": "chat", "arguments": []}},
             {"jsonrpc": "2.0", "id": 3, "method": "tools/list"}]
    for line in lines:
        process.stdin.write(line if isinstance(line, bytes) else
                            (line if isinstance(line, str) else json.dumps(line)).encode())
        process.stdin.write(b"\n")
        await process.stdin.drain()
    replies: list[dict[str, Any]] = []
    async with asyncio.timeout(60):
        while not any(reply.get("id") == 3 for reply in replies):
            replies.append(json.loads(await process.stdout.readline()))
    process.stdin.close()
    assert await asyncio.wait_for(process.wait(), 30) == 0
    by_id = {reply["id"]: reply for reply in replies if reply["id"] is not None}
    unmatched = [reply["error"] for reply in replies if reply["id"] is None]
    assert by_id[1]["result"]["serverInfo"]["name"] == "ksi"
    # JSON-RPC's parse error for the line that is not JSON, the limit for the one too long
    assert [error["code"] for error in unmatched] == [types.PARSE_ERROR, types.INVALID_REQUEST]
    assert unmatched[1]["data"] == {"code": "payload_too_large", "limit": LINE_LIMIT}
    assert by_id[7]["error"]["code"] == types.INVALID_REQUEST and 8 not in by_id
    assert "error" in by_id[2] or by_id[2]["result"]["isError"]  # arguments must be an object
    assert len(by_id[3]["result"]["tools"]) == 6


# Silent for 5 s (a reasoning model), then a word every half second: about 9 s in all, more than
# twice the 4 s a client waits without hearing anything.
SLOW_ANSWER = "the keeper climbed all ninety steps of the lighthouse"
SLOW = Reply(text=SLOW_ANSWER, delay=5.0, drip=0.5)
PATIENCE = 4.0


async def call_waiting_on_progress(client: Client, tool: str, **arguments: Any
                                   ) -> tuple[types.CallToolResult, list[tuple[float, str | None]]]:
    """A call that gives up after PATIENCE seconds without progress, as clients that reset their
    timeout on progress do (the SDK's `read_timeout_seconds` runs from the request, progress or not)."""
    reports: list[tuple[float, str | None]] = []
    async with asyncio.timeout(PATIENCE) as deadline:
        async def on_progress(progress: float, _total: float | None, message: str | None) -> None:
            reports.append((progress, message))
            deadline.reschedule(asyncio.get_running_loop().time() + PATIENCE)

        result = await client.call_tool(tool, arguments, progress_callback=on_progress)
    return result, reports


def assert_reported_the_slow_answer(result: types.CallToolResult, reports: list[tuple[float, str | None]]) -> None:
    assert not result.is_error, result.content
    assert result.structured_content["answer"] == SLOW_ANSWER
    progress = [value for value, _message in reports]
    assert progress == sorted(set(progress))  # it only grows
    assert reports[0][1] is None  # the silence before the first word is reported too
    texts = [message for _value, message in reports if message]
    assert texts and all(SLOW_ANSWER.startswith(text) for text in texts)  # the answer so far


async def test_a_long_call_reports_progress_and_outlives_the_clients_timeout(short_tmp: Path,
                                                                            stub: StubOpenAI) -> None:
    async with served(short_tmp, stub) as (daemon, client):
        await call(client, "chat", prompt="warm up")  # the daemon's first call loads litellm
        stub.enqueue(SLOW)
        result, reports = await call_waiting_on_progress(client, "chat", prompt="climb")
        assert_reported_the_slow_answer(result, reports)
        cid = result.structured_content["continuation_id"]
        assert len(read_records(daemon.layout.index_file(cid))) == 1
        # without a progress token nothing is streamed or reported, and the answer is the same
        plain = await call(client, "chat", prompt="again", continuation_id=cid)
        assert plain["answer"] == "stub answer to: again"


async def test_an_oversized_call_fails_alone(short_tmp: Path, stub: StubOpenAI) -> None:
    limit = 64 * 1024
    async with served(short_tmp, stub, line_limit=limit) as (daemon, client):
        await call(client, "chat", prompt="warm up")
        stub.enqueue(Reply(text="slow but fine", delay=2.0))
        slow = asyncio.create_task(client.call_tool("chat", {"prompt": "take your time"}))
        async with asyncio.timeout(30):
            while stub.in_flight == 0:
                await asyncio.sleep(0.01)
        error = await refused(client, "payload_too_large", "chat", prompt="x" * (limit + 1))
        assert error["details"]["limit"] == limit
        neighbour = await slow
        assert not neighbour.is_error, neighbour.content  # the shared connection lived on
        assert neighbour.structured_content["answer"] == "slow but fine"
        cid = neighbour.structured_content["continuation_id"]
        assert len(read_records(daemon.layout.index_file(cid))) == 1
        # nothing of the refused call reached the model or the disk
        assert [r["messages"][-1]["content"] for r in stub.requests] == ["warm up", "take your time"]
        assert len(list(daemon.layout.conversations_dir.glob("*.jsonl"))) == 2
        assert (await call(client, "conversations"))["total"] == 2
