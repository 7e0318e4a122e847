"""A tool-using conversation through the `ksi` command line, each command a real process:
`ksi conversation import FILE` (through the daemon), `show` readable on a terminal and as JSON,
`export` and import again, `response show`, the recap of `ksi chat`; a record written before
items shows as it did."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest

from ksi_daemon.daemon import Daemon
from tests.conftest import connected, running_daemon
from tests.stored import stored_snapshot
from tests.test_cli_ask import ksi as ksi_async
from tests.test_cli_ask import where
from tests.test_cli_ask_stream import expect, finish, spawn
from tests.test_inspect import ksi
from tests.test_transcript_items import old_var_dir
from tests.tool_conversation import IMAGE_SHA, store_image, tool_document, tool_exchanges

pytestmark = pytest.mark.backends


def storage_env(backend: dict[str, Any]) -> dict[str, str]:
    """What tells a `ksi` process which backend to read."""
    return {"KSI_STORAGE": "postgres", "KSI_DATABASE_URL": backend["database_url"]} if backend else {}


async def test_import_show_export_and_import_again_through_the_cli(
        short_tmp: Path, daemon: Daemon, backend: dict[str, Any]) -> None:
    env = storage_env(backend)
    await store_image(daemon)
    where = ["--var-dir", str(short_tmp / "var"), "--socket", str(short_tmp / "d.sock")]
    source = short_tmp / "tools.json"
    source.write_bytes(orjson.dumps(tool_document()))
    made = await ksi_async(short_tmp, "conversation", "import", str(source), "--new-id", "tools", *where, env=env)
    assert made.code == 0, made.err
    assert made.json()["exchanges"] == 3

    piped = ksi("conversation", "show", "tools", "--var-dir", str(short_tmp / "var"), cwd=short_tmp, env=env)
    assert piped.returncode == 0, piped.stderr
    shown = json.loads(piped.stdout)
    assert shown["exchanges"][0]["output"][1] == {"type": "function_call", "call_id": "c1", "name": "weather",
                                                  "arguments": '{"city": "Oslo"}'}
    assert shown["exchanges"][1]["input"] == [{"type": "function_call_output", "call_id": "c1", "output": "12C"}]

    readable = ksi("conversation", "show", "tools", "--var-dir", str(short_tmp / "var"), cwd=short_tmp, tty=True,
                   env={**env, "NO_COLOR": "1"})
    assert readable.returncode == 0, readable.stderr
    text = readable.stdout.replace("\r\n", "\n")
    for expected in ("user: What is the weather in Oslo?", "assistant: Let me check.",
                     '\u2192 call weather({"city": "Oslo"}) [c1]', "\u2190 c1: 12C", "assistant: It is 12C in Oslo.",
                     f"user: And what is in this picture? [image sha256:{IMAGE_SHA[:12]}\u2026 image/png 3 KB]",
                     "(reasoning) looked at the whiskers", "assistant: A cat."):
        assert expected in text, (expected, text)
    assert text.index("\u2192 call weather") < text.index("\u2190 c1: 12C") < text.index("A cat.")

    for exchange, expected in ((0, '\u2192 call weather({"city": "Oslo"}) [c1]'), (1, "\u2190 c1: 12C")):
        response = ksi("response", "show", shown["exchanges"][exchange]["response_id"], "--var-dir",
                       str(short_tmp / "var"), cwd=short_tmp, tty=True, env={**env, "NO_COLOR": "1"})
        assert response.returncode == 0, response.stderr
        assert expected in response.stdout, response.stdout

    exported = short_tmp / "tools.jsonl"
    result = ksi("conversation", "export", "tools", "--format", "jsonl", "-o", str(exported),
                 "--var-dir", str(short_tmp / "var"), cwd=short_tmp, env=env)
    assert result.returncode == 0, result.stderr
    again = await ksi_async(short_tmp, "conversation", "import", str(exported), "--new-id", "again", *where, env=env)
    assert again.code == 0, again.err
    second = json.loads(ksi("conversation", "show", "again", "--var-dir", str(short_tmp / "var"), cwd=short_tmp,
                            env=env).stdout)
    keep = ("input", "output", "inputs", "reply", "n", "model", "ts", "tokens_in", "tokens_out")
    assert [{k: x[k] for k in keep} for x in second["exchanges"]] == [{k: x[k] for k in keep}
                                                                      for x in shown["exchanges"]]


async def test_a_bad_import_file_is_refused_with_its_code_and_nothing_written(
        short_tmp: Path, daemon: Daemon, backend: dict[str, Any]) -> None:
    exchanges = tool_exchanges()
    exchanges[1]["input"][0]["call_id"] = "never-made"
    source = short_tmp / "bad.json"
    source.write_bytes(orjson.dumps(tool_document(*exchanges)))
    before = await stored_snapshot(daemon.settings)
    refused = await ksi_async(short_tmp, "conversation", "import", str(source), "--new-id", "bad",
                              "--var-dir", str(short_tmp / "var"), "--socket", str(short_tmp / "d.sock"),
                              env=storage_env(backend))
    assert refused.code == 1
    assert json.loads(refused.err)["error"]["code"] == "unknown_call_id"
    missing = await ksi_async(short_tmp, "conversation", "import", str(short_tmp / "no-such.json"),
                              "--var-dir", str(short_tmp / "var"), "--socket", str(short_tmp / "d.sock"),
                              env=storage_env(backend))
    assert missing.code == 1 and json.loads(missing.err)["error"]["code"] == "validation_error", missing.err
    assert await stored_snapshot(daemon.settings) == before


def test_a_record_written_before_items_shows_on_the_terminal_as_text(short_tmp: Path) -> None:
    old_var_dir(short_tmp / "var")
    readable = ksi("conversation", "show", "before", "--var-dir", str(short_tmp / "var"), cwd=short_tmp, tty=True,
                   env={"NO_COLOR": "1"})
    assert readable.returncode == 0, readable.stderr
    text = readable.stdout.replace("\r\n", "\n")
    assert "user: hello from before\nassistant: an answer from before" in text, text
    piped = json.loads(ksi("conversation", "show", "before", "--var-dir", str(short_tmp / "var"), cwd=short_tmp).stdout)
    assert piped["exchanges"][0]["inputs"][0]["content"] == "hello from before"
    assert piped["exchanges"][0]["reply"]["content"] == "an answer from before"


async def test_ksi_chat_recaps_a_resumed_tool_conversation_with_its_calls_and_outputs(short_tmp: Path) -> None:
    async with running_daemon(short_tmp) as running, connected(running) as client:
        await store_image(running)
        await client.request("conversation:import", {"data": tool_document(), "new_id": "tools"})
        child = spawn(short_tmp, "chat", "--cid", "tools", *where(short_tmp))
        shown = await expect(child, "you> ")
        child.sendline("/exit")
        _rest, code = await finish(child)
    assert code == 0
    assert 'earlier answer: Let me check. \u2192 call weather({"city": "Oslo"}) [c1]' in shown, shown
    assert "earlier you: \u2190 c1: 12C" in shown, shown
    assert f"earlier you: And what is in this picture? [image sha256:{IMAGE_SHA[:12]}" in shown, shown
    assert "earlier answer: (reasoning) looked at the whiskers A cat." in shown, shown
