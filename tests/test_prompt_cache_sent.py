"""`conversation:sent` marks the prompt-cache breakpoints where the provider received them and the
first message where a request differed from the one before it. The provider is the cache emulator
speaking Anthropic's Messages API (real daemon requests through litellm); the record is read back
after a restart, on both storage backends."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from ksi_cli.sent_command import DIFFERS, sent_lines
from ksi_daemon.services.conversations.sent import first_difference
from tests.cache_emulator import MINIMUM, CacheEmulator
from tests.conftest import complete, connected, running_daemon
from tests.test_compaction import FILLER, settled
from tests.test_prompt_cache_placement import ANTHROPIC, SMALL, SYSTEM, WRITER, anthropic_settings

pytestmark = pytest.mark.backends

SYSTEM_LINES = len(SYSTEM.splitlines())  # the system prompt's lines, printed under its message


async def ksi_sent(*args: str) -> dict[str, Any]:
    """`ksi conversation sent ... --json` run as a user runs it; its reply."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "ksi_cli", "conversation", "sent", *args, "--json", stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await process.communicate()
    assert process.returncode == 0, err.decode()
    return dict(json.loads(out))

OFF = "anthropic/cache-off"


@pytest.fixture
def emulator_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHE_EMULATOR_KEY", "sk-ant-local")


def _text(block: dict[str, Any]) -> str:
    return str(block.get("text", ""))


def received_marks(body: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Each breakpoint the emulator received, in prompt order: role, lifetime, the text it closes
    (for the system, its text up to the marked block)."""
    found, system = [], ""
    for block in body.get("system") or []:
        system += _text(block)
        if "cache_control" in block:
            found.append(("system", block["cache_control"].get("ttl", "5m"), system))
    for message in body["messages"]:
        content = message["content"]
        for block in content if isinstance(content, list) else []:
            if "cache_control" in block:
                found.append((message["role"], block["cache_control"].get("ttl", "5m"), _text(block)))
    return found


def shown_marks(sent: dict[str, Any]) -> list[tuple[str, str, str]]:
    return [(m["role"], mark["ttl"], m["content"]) for m in sent["messages"] for mark in m.get("cache_breakpoints", [])]


def same_marks(sent: dict[str, Any], body: dict[str, Any]) -> bool:
    """The breakpoints `conversation:sent` marks are those the provider received: on the same
    messages, with the same lifetimes (a system mark closes a prefix of the system message)."""
    shown, received = shown_marks(sent), received_marks(body)
    return len(shown) == len(received) and all(
        s[:2] == r[:2] and (s[2].startswith(r[2].rstrip()) if s[0] == "system" else s[2] == r[2])
        for s, r in zip(shown, received, strict=True))


async def test_sent_marks_the_breakpoints_the_provider_received_and_where_each_request_first_differed(
        short_tmp: Path, backend: dict[str, Any], emulator_key: None) -> None:
    async with CacheEmulator() as emulator:
        settings = anthropic_settings(emulator, backend, **{ANTHROPIC: {"cache_ttl": "1h"},
                                                            OFF: {"cache_placement": "off"}})
        async with running_daemon(short_tmp, **settings) as daemon, connected(daemon) as client:
            for n, prompt in enumerate(["first question", "second question", "third question"]):
                await complete(client, prompt=prompt, conversation_id="a", create=n == 0, system=SYSTEM,
                               model=ANTHROPIC)
            await complete(client, prompt="fourth question", conversation_id="a", model=OFF)
            own = {"type": "message", "role": "user", "content": "fifth question",
                   "cache_control": {"type": "ephemeral"}}
            await complete(client, input=[own], conversation_id="a", model=OFF)
        # read back by a daemon started again on the same storage: the record, not a memory
        async with running_daemon(short_tmp, **settings) as daemon, connected(daemon) as client:
            sent = [await client.request("conversation:sent", {"conversation_id": "a", "n": n}) for n in range(1, 6)]
            where = ["--socket", str(daemon.settings.socket), "--var-dir", str(daemon.settings.var_dir)]
            printed = [await ksi_sent("a", str(n), *where) for n in (3, 5)]
    bodies = emulator.anthropic_requests
    assert len(bodies) == 5
    for shown, body in zip(sent[:3], bodies, strict=False):
        assert received_marks(body) and same_marks(shown, body)
        assert {mark["by"] for mark in shown["breakpoints"]} == {"ksi"}
    # the system prompt alone (no notes yet): one breakpoint closes it, at the model's lifetime;
    # the newest reply holds one (where a fork at that exchange stops sharing) and the input the last
    assert sent[2]["breakpoints"] == [{"at": 0, "part": "system", "ttl": "1h", "by": "ksi"},
                                      {"at": 4, "part": "history", "ttl": "5m", "by": "ksi", "n": 2},
                                      {"at": 5, "part": "input", "ttl": "5m", "by": "ksi"}]
    assert sent[2]["messages"][0]["cache_breakpoints"][0] == {"part": "system", "ttl": "1h", "by": "ksi"}
    # each turn extends the one before: the cache can read all of the previous request
    assert sent[0]["first_difference"] is None and sent[0]["extends_previous"] is False
    assert [(s["first_difference"], s["extends_previous"], s["compared_with"]) for s in sent[1:4]] == [
        (2, True, 1), (4, True, 2), (6, True, 3)]
    # placement off: none placed, and none received
    assert sent[3]["breakpoints"] == [] and received_marks(bodies[3]) == []
    assert not any("cache_breakpoints" in m for m in sent[3]["messages"])
    # the client's own marker goes out even with placement off, and is said to be the client's
    assert received_marks(bodies[4]) == [("user", "5m", "fifth question")] and same_marks(sent[4], bodies[4])
    assert sent[4]["breakpoints"] == [{"at": 9, "part": "input", "ttl": "5m", "by": "client"}]
    # `ksi conversation sent` prints the same marks under their messages, plainly
    third, fifth = printed
    assert third == sent[2] and fifth == sent[4]
    lines = sent_lines(third)
    assert lines[lines.index("[1] system (system)") + 1:][SYSTEM_LINES] == "  ^ cache breakpoint: 1h, KSI's"
    assert lines.index(DIFFERS) == lines.index("[5] assistant (from #2)") - 1
    assert "extends the request of #2 (new from message 5)" in lines
    assert sent_lines(fifth)[-1] == "  ^ cache breakpoint: 5m, the client's"


async def test_a_turn_after_a_summary_took_over_differs_from_the_system_message_on(
        short_tmp: Path, backend: dict[str, Any], emulator_key: None) -> None:
    async with CacheEmulator() as emulator:
        settings = anthropic_settings(emulator, backend, **{SMALL: {"context_window": MINIMUM + 2400,
                                                                    "output_reserve": 100}})
        settings.update(summariser=WRITER, default_model=SMALL)
        async with running_daemon(short_tmp, **settings) as daemon, connected(daemon) as client:
            for turn in range(10):
                await complete(client, prompt=f"turn {turn} {FILLER * 3}", conversation_id="s", create=turn == 0,
                               system=SYSTEM, model=SMALL)
                await settled(daemon)
            sent = [await client.request("conversation:sent", {"conversation_id": "s", "n": n}) for n in range(1, 11)]
    for shown, body in zip(sent, emulator.anthropic_requests, strict=True):
        assert same_marks(shown, body)
    moved = [s for s, before in zip(sent[1:], sent, strict=False)
             if before["history"] and s["history"][:1] != before["history"][:1]]
    assert moved, "the window never moved"
    for shown in moved:  # what went before the history changed: the system message carries the stand-in
        assert shown["first_difference"] == 0 and shown["extends_previous"] is False
    summarised = [s for s in sent if any(m["part"] == "summary" for m in s["breakpoints"])]
    assert summarised, "no summary was closed by a breakpoint"
    for shown in summarised:
        assert [mark["part"] for mark in shown["messages"][0]["cache_breakpoints"]][:2] == ["system", "summary"]


async def test_an_exchange_recorded_without_breakpoints_says_they_are_unknown_not_none(
        short_tmp: Path, backend: dict[str, Any]) -> None:
    def exchange(n: int) -> dict[str, Any]:
        return {"input": [{"type": "message", "role": "user", "content": f"question {n}"}],
                "output": [{"type": "message", "role": "assistant", "content": f"answer {n}"}],
                "reply": {"model": "echo/test", "content": f"answer {n}"}, "model": "echo/test"}

    document = {"v": 1, "format": "ksi.conversation", "conversation": {"conversation_id": "x"},
                "exchanges": [exchange(1), exchange(2)]}
    async with running_daemon(short_tmp, **backend) as daemon, connected(daemon) as client:
        await client.request("conversation:import", {"data": document, "new_id": "old"})
        sent = await client.request("conversation:sent", {"conversation_id": "old", "n": 2})
    assert sent["recorded"] is False and sent["breakpoints"] is None
    assert not any("cache_breakpoints" in m for m in sent["messages"])
    # no system message: [q1], then [q1, a1, q2]
    assert (sent["first_difference"], sent["extends_previous"], sent["compared_with"]) == (1, True, 1)
    assert "cache breakpoints: not recorded" in sent_lines(sent)


def test_a_request_shorter_than_the_one_before_differs_where_it_ends() -> None:
    before = [{"role": "system", "content": "s"}, {"role": "user", "content": "a"},
              {"role": "assistant", "content": "b"}]
    assert first_difference(before, before[:2]) == {"first_difference": 2, "extends_previous": False}
    assert first_difference(before, before) == {"first_difference": None, "extends_previous": False}
    changed = [{**before[0], "content": "t"}, *before[1:]]
    assert first_difference(before, changed) == {"first_difference": 0, "extends_previous": False}
    assert first_difference(None, before) == {"first_difference": None, "extends_previous": False}
