"""CLI-session providers (`claude-cli/...`, `gemini-cli/...`) against fake executables on PATH:
resume only when the previous exchange came from that session, else a fresh seeded session."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from ksi_common.errors import KsiError
from ksi_daemon.daemon import Daemon
from tests.conftest import complete, connected, running_daemon

FAKES = Path(__file__).parent / "fake_cli"


class Fake:
    """The fake CLIs' session directories and argv log."""

    def __init__(self, root: Path) -> None:
        self.sessions = {"claude": root / "claude-sessions", "gemini": root / "gemini-sessions"}
        for directory in self.sessions.values():
            directory.mkdir()
        self.log = root / "cli-argv.jsonl"

    def calls(self, cli: str | None = None) -> list[list[str]]:
        if not self.log.exists():
            return []
        lines = [json.loads(line) for line in self.log.read_text().splitlines()]
        return [line["argv"] for line in lines if cli is None or line["cli"] == cli]

    def session(self, cli: str, session_id: str) -> dict[str, Any]:
        return json.loads((self.sessions[cli] / f"{session_id}.json").read_text())

    def session_files(self, cli: str) -> list[str]:
        return sorted(p.stem for p in self.sessions[cli].glob("*.json"))


@pytest.fixture
def fake(short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Fake:
    for name in ("claude", "gemini"):
        mode = (FAKES / name).stat().st_mode
        assert mode & stat.S_IXUSR, f"tests/fake_cli/{name} must be executable"
    state = short_tmp / "fake"
    state.mkdir()
    fake = Fake(state)
    # `#!/usr/bin/env python3` finds this interpreter directly, not a slow version-manager shim
    interpreter = short_tmp / "bin"
    interpreter.mkdir()
    (interpreter / "python3").symlink_to(sys.executable)
    monkeypatch.setenv("PATH", os.pathsep.join([str(FAKES), str(interpreter), os.environ.get("PATH", "")]))
    monkeypatch.setenv("FAKE_CLAUDE_DIR", str(fake.sessions["claude"]))
    monkeypatch.setenv("FAKE_GEMINI_DIR", str(fake.sessions["gemini"]))
    monkeypatch.setenv("FAKE_CLI_LOG", str(fake.log))
    return fake


@pytest.fixture
async def cli_daemon(short_tmp: Path, fake: Fake) -> Any:
    async with running_daemon(short_tmp) as daemon:
        yield daemon


def response_lines(daemon: Daemon, response_id: str) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in daemon.layout.response_file(response_id).read_bytes().splitlines()]


def index_of(daemon: Daemon, conversation_id: str) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in daemon.layout.index_file(conversation_id).read_bytes().splitlines()]


def resumed(argv: list[str]) -> str | None:
    return argv[argv.index("--resume") + 1] if "--resume" in argv else None


def claude_prompt(argv: list[str]) -> str:
    return argv[-1]


def gemini_prompt(argv: list[str]) -> str:
    if "--prompt" in argv:
        return argv[argv.index("--prompt") + 1]
    return next(arg for arg in argv if arg.startswith("--prompt="))[len("--prompt="):]


# -- the fakes themselves ----------------------------------------------------------------------


def test_the_fake_claude_behaves_like_the_cli(fake: Fake) -> None:
    import subprocess

    first = subprocess.run(["claude", "-p", "--output-format", "json", "--model", "sonnet", "hello"],
                           capture_output=True, text=True, check=True)
    answer = json.loads(first.stdout)
    assert answer["type"] == "result" and answer["subtype"] == "success" and answer["is_error"] is False
    assert answer["usage"]["input_tokens"] > 0 and answer["total_cost_usd"] == 0.0
    second = subprocess.run(["claude", "-p", "--output-format", "json", "--resume", answer["session_id"], "again"],
                            capture_output=True, text=True, check=True)
    assert "has seen 2 prompts: hello || again" in json.loads(second.stdout)["result"]
    lost = subprocess.run(["claude", "-p", "--output-format", "json", "--resume", "nope", "x"],
                          capture_output=True, text=True)
    assert lost.returncode != 0
    assert "No conversation found with session ID: nope" in lost.stderr


# -- claude ------------------------------------------------------------------------------------


async def test_claude_resumes_its_session_with_only_the_new_input(cli_daemon: Daemon, fake: Fake) -> None:
    async with connected(cli_daemon) as client:
        first = await complete(client, model="claude-cli/sonnet", prompt="My name is Alice",
                               system="You are kind.", conversation_id="cc", create=True)
        second = await complete(client, prompt="What is my name?", conversation_id="cc")
    calls = fake.calls("claude")
    assert len(calls) == 2
    assert calls[0][:7] == ["-p", "--output-format", "json", "--model", "sonnet",
                            "--append-system-prompt", "You are kind."]
    assert claude_prompt(calls[0]) == "My name is Alice"
    assert resumed(calls[0]) is None
    session_id = first["content"].split()[2]
    assert fake.session_files("claude") == [session_id]
    assert resumed(calls[1]) == session_id
    assert claude_prompt(calls[1]) == "What is my name?"  # only the new input: the CLI keeps the rest
    assert second["model"] == "claude-cli/sonnet"
    assert f"claude session {session_id} has seen 2 prompts: My name is Alice || What is my name?" == second["content"]
    assert fake.session("claude", session_id)["system"] == "You are kind."
    for result in (first, second):
        assistant = response_lines(cli_daemon, result["response_id"])[-1]
        assert assistant["type"] == "assistant"
        assert assistant["session_id"] == session_id
        assert assistant["model"] == "claude-cli/sonnet"
        assert assistant["usage"]["completion_tokens"] > 0
        assert "session_note" not in result
    assert result["response_id"].startswith("claude-cli-sonnet-")
    index = index_of(cli_daemon, "cc")
    assert [line["n"] for line in index] == [1, 2]
    assert {line["provider"] for line in index} == {"claude-cli"}


async def test_a_lost_claude_session_falls_back_to_a_fresh_seeded_one(cli_daemon: Daemon, fake: Fake) -> None:
    async with connected(cli_daemon) as client:
        first = await complete(client, model="claude-cli/sonnet", prompt="My name is Alice",
                               conversation_id="lost", create=True)
        second = await complete(client, prompt="I am a dentist", conversation_id="lost")
        old_session = first["content"].split()[2]
        (fake.sessions["claude"] / f"{old_session}.json").unlink()
        third = await complete(client, prompt="Who am I?", conversation_id="lost")
        fourth = await complete(client, prompt="Thanks", conversation_id="lost")
    calls = fake.calls("claude")
    assert len(calls) == 5  # first, second (resumed), the failed resume, the fresh session, fourth
    assert resumed(calls[2]) == old_session
    assert resumed(calls[3]) is None
    seeded = claude_prompt(calls[3])
    for text in ("My name is Alice", first["content"], "I am a dentist", second["content"], "Who am I?"):
        assert text in seeded
    assert seeded.index("My name is Alice") < seeded.index("I am a dentist") < seeded.index("Who am I?")
    assert "session_note" in third
    assert old_session in third["session_note"] and "fresh session" in third["session_note"]
    new_session = fake.session_files("claude")
    assert len(new_session) == 1 and new_session[0] != old_session
    assert response_lines(cli_daemon, third["response_id"])[-1]["session_id"] == new_session[0]
    assert response_lines(cli_daemon, third["response_id"])[-1]["session_note"] == third["session_note"]
    # the fresh session is resumed from then on
    assert resumed(calls[4]) == new_session[0]
    assert claude_prompt(calls[4]) == "Thanks"
    assert "session_note" not in fourth
    assert [line["n"] for line in index_of(cli_daemon, "lost")] == [1, 2, 3, 4]


async def test_another_model_in_between_starts_a_fresh_seeded_session(cli_daemon: Daemon, fake: Fake) -> None:
    async with connected(cli_daemon) as client:
        first = await complete(client, model="claude-cli/sonnet", prompt="Remember 7", conversation_id="mix",
                               create=True)
        echo = await complete(client, model="echo/x", prompt="Remember 9 too", conversation_id="mix")
        third = await complete(client, model="claude-cli/sonnet", prompt="Which numbers?", conversation_id="mix")
    assert "Earlier user inputs: Remember 7" in echo["content"]  # the echo model saw the claude exchange
    calls = fake.calls("claude")
    assert len(calls) == 2
    assert resumed(calls[1]) is None  # the previous exchange did not come from the claude session
    seeded = claude_prompt(calls[1])
    for text in ("Remember 7", first["content"], "Remember 9 too", echo["content"], "Which numbers?"):
        assert text in seeded
    assert "session_note" not in third
    assert len(fake.session_files("claude")) == 2


async def test_another_claude_model_does_not_resume_the_session(cli_daemon: Daemon, fake: Fake) -> None:
    async with connected(cli_daemon) as client:
        await complete(client, model="claude-cli/sonnet", prompt="one", conversation_id="two-models", create=True)
        await complete(client, model="claude-cli/opus", prompt="two", conversation_id="two-models")
        await complete(client, model="claude-cli/opus", prompt="three", conversation_id="two-models")
    calls = fake.calls("claude")
    assert resumed(calls[1]) is None and "--model" in calls[1] and calls[1][calls[1].index("--model") + 1] == "opus"
    assert "one" in claude_prompt(calls[1])
    assert resumed(calls[2]) is not None and claude_prompt(calls[2]) == "three"


async def test_a_new_system_prompt_starts_a_fresh_seeded_session(cli_daemon: Daemon, fake: Fake) -> None:
    async with connected(cli_daemon) as client:
        await complete(client, model="claude-cli/sonnet", prompt="hello", system="Be formal.",
                       conversation_id="sys", create=True)
        await complete(client, prompt="same system again", system="Be formal.", conversation_id="sys")
        await complete(client, prompt="now be casual", system="Be casual.", conversation_id="sys")
        await complete(client, prompt="and keep it", conversation_id="sys")
    calls = fake.calls("claude")
    assert resumed(calls[1]) is not None  # the same system prompt changes nothing
    # a resumed session would never see the new system prompt: start a fresh one that has it
    assert resumed(calls[2]) is None
    assert calls[2][calls[2].index("--append-system-prompt") + 1] == "Be casual."
    assert "hello" in claude_prompt(calls[2]) and "same system again" in claude_prompt(calls[2])
    assert resumed(calls[3]) is not None and claude_prompt(calls[3]) == "and keep it"
    sessions = {resumed(calls[1]), resumed(calls[3])}
    assert len(sessions) == 2


async def test_the_claude_session_survives_a_daemon_restart(short_tmp: Path, fake: Fake) -> None:
    async with running_daemon(short_tmp) as daemon, connected(daemon) as client:
        first = await complete(client, model="claude-cli/sonnet", prompt="hello", conversation_id="keep", create=True)
    async with running_daemon(short_tmp) as daemon, connected(daemon) as client:
        await complete(client, prompt="again", conversation_id="keep")
    calls = fake.calls("claude")
    assert resumed(calls[1]) == first["content"].split()[2]
    assert claude_prompt(calls[1]) == "again"


async def test_a_failing_cli_is_a_provider_error_and_not_indexed(short_tmp: Path, fake: Fake,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    async with running_daemon(short_tmp, retry_attempts=1) as cli_daemon, connected(cli_daemon) as client:
        await complete(client, model="claude-cli/sonnet", prompt="hello", conversation_id="broken", create=True)
        monkeypatch.setenv("FAKE_CLAUDE_DIR", str(fake.sessions["claude"] / "missing"))  # the CLI now crashes
        ack = await client.request("completion:async", {"prompt": "boom", "conversation_id": "broken"})
        with pytest.raises(KsiError) as caught:
            await client.request("completion:wait", {"request_id": ack["request_id"], "timeout": 30})
        status = await client.request("completion:status", {"request_id": ack["request_id"]})
        assert len(index_of(cli_daemon, "broken")) == 1
        assert response_lines(cli_daemon, status["response_id"])[-1]["type"] == "error"
    assert caught.value.code == "provider_error"
    assert "claude exited" in caught.value.message


async def test_a_missing_cli_is_refused_at_once(cli_daemon: Daemon, monkeypatch: pytest.MonkeyPatch,
                                                short_tmp: Path) -> None:
    monkeypatch.setenv("PATH", str(short_tmp))  # no claude anywhere
    async with connected(cli_daemon) as client:
        with pytest.raises(KsiError) as caught:  # the ack itself: nothing is queued, nothing written
            await client.request("completion:async", {"model": "claude-cli/sonnet", "prompt": "hello"})
        listed = await client.request("conversation:list", {})
    assert caught.value.code == "provider_unavailable"
    assert caught.value.details["binary"] == "claude"
    assert "`claude`" in caught.value.message and "PATH" in caught.value.message
    assert listed["total"] == 0


async def test_a_cli_missing_when_called_is_not_retried(monkeypatch: pytest.MonkeyPatch, short_tmp: Path) -> None:
    from ksi_daemon.providers.base import ProviderCall, ProviderFailure
    from ksi_daemon.providers.litellm_provider import LiteLLMProvider
    from ksi_daemon.services.resilience import CircuitBreaker, RetryPolicy, with_retries
    from tests.conftest import make_settings

    monkeypatch.setenv("PATH", str(short_tmp))  # gone after the request was accepted
    provider = LiteLLMProvider(make_settings(short_tmp))
    breaker = CircuitBreaker(threshold=1, reset=60)
    attempts: list[dict[str, Any]] = []
    call = ProviderCall(model="claude-cli/sonnet", messages=[{"role": "user", "content": "hello"}])
    with pytest.raises(ProviderFailure) as caught:
        await with_retries(lambda: provider.complete(call), RetryPolicy(3, 0.01, 0.01), breaker, "claude", attempts)
    assert caught.value.code == "provider_unavailable" and caught.value.details["binary"] == "claude"
    assert len(attempts) == 1
    assert breaker.report() == {}


@pytest.mark.parametrize("model", ["claude-cli/sonnet", "gemini-cli/default"])
async def test_prompts_that_look_like_options_reach_the_cli_as_prompts(cli_daemon: Daemon, fake: Fake,
                                                                      model: str) -> None:
    prompts = ["- buy milk\n- buy bread", "--help", "-p"]
    async with connected(cli_daemon) as client:
        results = [await complete(client, model=model, prompt=prompts[0], conversation_id="dash", create=True)]
        for prompt in prompts[1:]:
            results.append(await complete(client, prompt=prompt, conversation_id="dash"))
    cli = model.split("-", 1)[0]
    read = claude_prompt if cli == "claude" else gemini_prompt
    calls = fake.calls(cli)
    assert [read(argv) for argv in calls] == prompts
    assert resumed(calls[1]) is not None and resumed(calls[2]) is not None
    assert results[-1]["content"].endswith(" || ".join(prompts))


# -- gemini ------------------------------------------------------------------------------------


async def test_gemini_resumes_and_falls_back(cli_daemon: Daemon, fake: Fake) -> None:
    async with connected(cli_daemon) as client:
        first = await complete(client, model="gemini-cli/gemini-2.5-pro", prompt="My name is Bob",
                               conversation_id="gem", create=True)
        second = await complete(client, prompt="What is my name?", conversation_id="gem")
        session_id = first["content"].split()[2]
        (fake.sessions["gemini"] / f"{session_id}.json").unlink()
        third = await complete(client, prompt="Still there?", conversation_id="gem")
    calls = fake.calls("gemini")
    assert calls[0][:4] == ["--output-format", "json", "--model", "gemini-2.5-pro"]
    assert gemini_prompt(calls[0]) == "My name is Bob"
    assert resumed(calls[1]) == session_id and gemini_prompt(calls[1]) == "What is my name?"
    assert second["content"] == (f"gemini session {session_id} has seen 2 prompts: "
                                 "My name is Bob || What is my name?")
    assert resumed(calls[2]) == session_id
    assert resumed(calls[3]) is None
    seeded = gemini_prompt(calls[3])
    for text in ("My name is Bob", "What is my name?", second["content"], "Still there?"):
        assert text in seeded
    assert "session_note" in third and session_id in third["session_note"]
    assistant = response_lines(cli_daemon, third["response_id"])[-1]
    assert assistant["session_id"] == fake.session_files("gemini")[0] != session_id
    assert first["response_id"].startswith("gemini-cli-gemini-2-5-pro-")
    assert [line["n"] for line in index_of(cli_daemon, "gem")] == [1, 2, 3]


async def test_switching_between_the_two_clis_reseeds_each_time(cli_daemon: Daemon, fake: Fake) -> None:
    async with connected(cli_daemon) as client:
        await complete(client, model="claude-cli/sonnet", prompt="alpha", conversation_id="both", create=True)
        await complete(client, model="gemini-cli/default", prompt="beta", conversation_id="both")
        await complete(client, model="claude-cli/sonnet", prompt="gamma", conversation_id="both")
    claude, gemini = fake.calls("claude"), fake.calls("gemini")
    assert "--model" not in gemini[0]  # the "default" model passes no --model
    assert resumed(gemini[0]) is None and "alpha" in gemini_prompt(gemini[0])
    assert resumed(claude[1]) is None
    assert "alpha" in claude_prompt(claude[1]) and "beta" in claude_prompt(claude[1])


async def test_cli_history_reaches_stateless_models(cli_daemon: Daemon, fake: Fake, short_tmp: Path) -> None:
    async with connected(cli_daemon) as client:
        first = await complete(client, model="claude-cli/sonnet", prompt="I like tea", conversation_id="share",
                               create=True)
        echo = await complete(client, model="echo/x", prompt="What do I like?", conversation_id="share")
    assert "Earlier user inputs: I like tea" in echo["content"]
    assert "Messages received: 3" in echo["content"]
    assert first["content"].startswith("claude session ")


# -- slow CLIs: timeouts and cancellation kill the process ---------------------------------------


def pids(path: Path) -> list[int]:
    return [int(line) for line in path.read_text().split()] if path.exists() else []


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie still answers kill(0); it is gone once its state is Z
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
    except (FileNotFoundError, IndexError):
        return True


async def test_a_cli_that_does_not_answer_in_time_is_killed(short_tmp: Path, fake: Fake,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    pid_file = short_tmp / "pids"
    monkeypatch.setenv("FAKE_CLI_PIDFILE", str(pid_file))
    monkeypatch.setenv("FAKE_CLI_SLEEP", "30")
    async with running_daemon(short_tmp, retry_attempts=1) as daemon, connected(daemon) as client:
        ack = await client.request("completion:async", {"model": "claude-cli/sonnet", "prompt": "hello",
                                                        "timeout": 1.0, "conversation_id": "slow",
                                                        "create": True})
        reply = await client.send_frame("completion:wait", {"request_id": ack["request_id"], "timeout": 20})
        assert not daemon.layout.index_file("slow").exists()
    assert reply["error"]["code"] == "timeout"
    assert len(pids(pid_file)) == 1
    assert gone(pids(pid_file)[0])


async def test_cancelling_a_cli_call_kills_the_process(short_tmp: Path, fake: Fake,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    pid_file = short_tmp / "pids"
    monkeypatch.setenv("FAKE_CLI_PIDFILE", str(pid_file))
    monkeypatch.setenv("FAKE_CLI_SLEEP", "30")
    async with running_daemon(short_tmp) as daemon, connected(daemon) as client:
        ack = await client.request("completion:async", {"model": "gemini-cli/default", "prompt": "hello"})
        for _ in range(1000):
            if pids(pid_file):
                break
            await asyncio.sleep(0.01)
        assert pids(pid_file), "the CLI never started"
        cancelled = await asyncio.wait_for(client.request("completion:cancel", {"request_id": ack["request_id"]}),
                                           20)
    assert cancelled["cancelled"] is True and cancelled["status"] == "cancelled"
    assert gone(pids(pid_file)[0])
    assert fake.session_files("gemini") == []


async def test_request_options_to_a_cli_model_are_refused_not_dropped(cli_daemon: Daemon, fake: Fake) -> None:
    async with connected(cli_daemon) as client:
        with pytest.raises(KsiError) as caught:
            await client.request("completion:async", {"prompt": "hi", "model": "claude-cli/sonnet",
                                                      "options": {"seed": 7, "stop": ["x"]}})
        listed = await client.request("conversation:list", {})
    assert caught.value.code == "unsupported_parameter"
    assert set(caught.value.details["fields"]) == {"options.seed", "options.stop"}
    assert fake.calls() == [] and listed["total"] == 0  # nothing ran, nothing was created


async def test_tools_to_a_cli_model_are_refused(cli_daemon: Daemon, fake: Fake) -> None:
    tool = {"type": "function", "name": "weather", "parameters": {"type": "object", "properties": {}}}
    async with connected(cli_daemon) as client:
        for model in ("claude-cli/sonnet", "gemini-cli/default"):
            with pytest.raises(KsiError) as caught:
                await client.request("completion:async", {"prompt": "hi", "model": model, "tools": [tool]})
            assert caught.value.code == "unsupported_parameter"
            assert list(caught.value.details["fields"]) == ["tools"]
        listed = await client.request("conversation:list", {})
    assert fake.calls() == [] and listed["total"] == 0
