"""`ksi chat` in a real pseudo-terminal: models and conversations, multi-line input, slash
commands, a recap on resume, and a daemon restart in the middle."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

from ksi_common.client import KsiClient
from tests.conftest import running_daemon, stub_settings
from tests.stub_openai import Reply
from tests.test_cli_ask import where
from tests.test_cli_ask_stream import expect, finish, spawn


async def test_chat_with_a_model_then_resume_the_conversation(short_tmp: Path) -> None:
    async with running_daemon(short_tmp):
        child = spawn(short_tmp, "chat", "--model", "echo/chat", *where(short_tmp))
        await expect(child, "you> ")
        child.sendline("hello there")
        await expect(child, "You said: hello there")
        await expect(child, "you> ")
        child.sendline('"""')
        child.sendline("line one")
        child.sendline("line two")
        child.sendline('"""')
        await expect(child, "You said: line one\r\nline two")
        await expect(child, "you> ")
        child.sendline("/help")
        await expect(child, "/fork")
        child.sendline("/model echo/other")
        await expect(child, "you> ")
        child.sendline("/nonsense")
        await expect(child, "unknown")
        child.sendline("/exit")
        rest, code = await finish(child)
        assert code == 0, rest
        conversation = re.search(r"ksi chat --cid ([A-Za-z0-9_.-]+)", rest)
        assert conversation, rest
        assert "Traceback" not in str(child.before)

        again = spawn(short_tmp, "chat", "--cid", conversation.group(1), *where(short_tmp))
        shown = await expect(again, "you> ")
        assert "2 exchanges so far" in shown
        # the recap shows the last turns: what was asked and what came back
        assert "earlier you: hello there" in shown and "earlier answer: You said: hello there" in shown
        assert "earlier you: line one" in shown
        again.sendline("and now?")
        await expect(again, "You said: and now")
        again.sendline("/exit")
        _rest, code = await finish(again)
        assert code == 0


async def test_chat_goes_on_after_a_daemon_restart(short_tmp: Path) -> None:
    async with running_daemon(short_tmp):
        child = spawn(short_tmp, "chat", "--model", "echo/chat", *where(short_tmp))
        await expect(child, "you> ")
        child.sendline("before")
        await expect(child, "You said: before")
        await expect(child, "you> ")
    async with running_daemon(short_tmp):
        child.sendline("after")
        await expect(child, "reconnected")
        await expect(child, "you> ")
        child.sendline("after again")
        await expect(child, "Earlier user inputs: before")
        child.sendline("/exit")
        rest, code = await finish(child)
    assert code == 0, rest
    assert "Traceback" not in rest


async def test_ctrl_c_during_a_reply_cancels_it_and_the_chat_goes_on(short_tmp: Path, stub: Any) -> None:
    gate = asyncio.Event()
    stub.enqueue(Reply(text="first words of a reply never finished", gate=gate))
    async with running_daemon(short_tmp, **stub_settings(stub)) as daemon:
        child = spawn(short_tmp, "chat", "--model", "openai/stub-model", *where(short_tmp))
        await expect(child, "you> ")
        child.sendline("start a long one")
        await expect(child, "first")
        child.sendintr()
        await expect(child, r"cancelled request (\S+)")
        request_id = child.match.group(1)
        await expect(child, "you> ")  # back at the prompt, still in the chat
        async with KsiClient(daemon.settings.socket) as client:
            status = await client.request("completion:status", {"request_id": request_id})
            assert status["status"] == "cancelled"
            for _ in range(100):  # the daemon hung up on the provider: the call was cancelled
                if stub.hung_up:
                    break
                await asyncio.sleep(0.05)
            assert stub.hung_up == 1
            child.sendline("and now a short one")
            await expect(child, "stub answer to: and now a short one")
            await expect(child, "you> ")
            child.sendline("/exit")
            rest, code = await finish(child)
            assert code == 0, rest
            conversation = re.search(r"ksi chat --cid ([A-Za-z0-9_.-]+)", rest)
            assert conversation, rest
            shown = await client.request("conversation:show", {"conversation_id": conversation.group(1)})
        # the cancelled reply was never stored: only the exchange after it
        asked = [item["content"] for exchange in shown["exchanges"] for item in exchange["inputs"]]
        assert asked == ["and now a short one"]
        assert "first words" not in json.dumps(shown["exchanges"])
        assert "Traceback" not in str(child.before) + rest
        gate.set()


async def test_a_failed_first_turn_leaves_no_conversation_and_the_chat_goes_on(short_tmp: Path, stub: Any) -> None:
    stub.enqueue(Reply(status=400))
    async with running_daemon(short_tmp, **stub_settings(stub)) as daemon:
        child = spawn(short_tmp, "chat", "--model", "openai/stub-model", *where(short_tmp))
        await expect(child, "you> ")
        child.sendline("refused")
        await expect(child, r"error \[provider_error\]")
        await expect(child, "you> ")
        async with KsiClient(daemon.settings.socket) as client:
            assert (await client.request("conversation:list", {}))["total"] == 0
            child.sendline("accepted")
            await expect(child, "stub answer to: accepted")
            child.sendline("/exit")
            rest, code = await finish(child)
            listed = await client.request("conversation:list", {})
    assert code == 0, rest
    assert listed["total"] == 1 and listed["conversations"][0]["exchanges"] == 1
