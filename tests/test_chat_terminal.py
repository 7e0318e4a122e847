"""`ksi chat` in a real pseudo-terminal: models and conversations, multi-line input, slash
commands, a recap on resume, and a daemon restart in the middle."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import running_daemon
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
