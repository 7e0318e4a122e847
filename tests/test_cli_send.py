"""`ksi send` without sharp edges, run as a real `ksi` process against an in-process daemon."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.conftest import running_daemon, stub_settings
from tests.test_cli_ask import ksi


def sock(root: Path) -> list[str]:
    return ["--socket", str(root / "d.sock")]


async def test_options_after_the_event_and_help_for_the_event(short_tmp: Path) -> None:
    async with running_daemon(short_tmp):
        run = await ksi(short_tmp, "send", *sock(short_tmp), "completion:async", "--prompt", "hi",
                        "--model", "echo/x", "--wait", "--json")
        assert run.code == 0, run.err
        assert "You said: hi" in run.json()["content"]
        helped = await ksi(short_tmp, "send", *sock(short_tmp), "completion:async", "--help")
        assert helped.code == 0, helped.err
        fields = helped.json()["fields"]
        assert fields["prompt"]["type"] == "str | None" and "conversation_id" in fields
        # an event's own `timeout` and `wait` fields stay its data
        waited = await ksi(short_tmp, "send", *sock(short_tmp), "completion:async", "--prompt", "t",
                           "--model", "echo/x", "--timeout", "5", "--wait")
        assert waited.code == 0, waited.err
        ack = await ksi(short_tmp, "send", *sock(short_tmp), "completion:async", "--prompt", "w", "--model", "echo/x")
        done = await ksi(short_tmp, "send", *sock(short_tmp), "completion:wait",
                         "--request-id", ack.json()["request_id"], "--timeout", "10")
        assert done.code == 0, done.err
        assert done.json()["content"].startswith("You said: w")


async def test_values_are_json_only_where_the_field_is_not_text(short_tmp: Path) -> None:
    async with running_daemon(short_tmp):
        for word in ("null", "42", "true", '{"a": 1}', "[1]"):
            run = await ksi(short_tmp, "send", *sock(short_tmp), "--wait", "completion:async",
                            "--prompt", word, "--model", "echo/x")
            assert run.code == 0, (word, run.err)
            assert run.json()["content"].startswith(f"You said: {word}"), word
        typed = await ksi(short_tmp, "send", *sock(short_tmp), "--wait", "completion:async",
                          "--prompt", "t", "--model", "echo/x", "--max-tokens", "abc")
        assert typed.code == 1
        assert typed.out == ""
        assert json.loads(typed.err.splitlines()[0])["error"]["code"] == "validation_error"


async def test_a_wait_that_ends_before_the_result_exits_4(short_tmp: Path, stub: Any) -> None:
    stub.hold = 3.0
    async with running_daemon(short_tmp, **stub_settings(stub)):
        run = await ksi(short_tmp, "send", *sock(short_tmp), "--wait", "--timeout", "0.3",
                        "completion:async", "--prompt", "slow")
        assert run.code == 4, run.err
        assert run.json()["status"] in ("queued", "running")
        assert "before the result" in run.err and "completion:wait" in run.err
        agent = await ksi(short_tmp, "send", *sock(short_tmp), "agent:spawn", "--agent-id", "slowpoke",
                          "--model", "openai/stub-model")
        assert agent.code == 0, agent.err
        told = await ksi(short_tmp, "send", *sock(short_tmp), "agent:send_message", "--agent-id", "slowpoke",
                         "--message", "hello", "--wait", "--timeout", "0.3")
        assert told.code == 4, told.err
