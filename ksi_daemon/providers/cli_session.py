"""CLI tools that keep their own sessions (`claude-cli/...`, `gemini-cli/...`) as litellm providers.

Only the new input is sent when the session can be resumed; otherwise a fresh session is seeded
with the rebuilt history. Imported only by litellm_provider after litellm is loaded.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from typing import Any

from litellm import CustomLLM, ModelResponse
from litellm.llms.custom_llm import CustomLLMError
from litellm.types.utils import Usage

from ksi_daemon.providers.base import SESSION_ID_KEY, SESSION_METADATA_KEY, SESSION_NOTE_KEY, CommandMissing
from ksi_daemon.providers.base import message_text as _text


def seeded_prompt(messages: list[dict[str, Any]]) -> str:
    """History and new input as one prompt, for a fresh session that must know the past."""
    turns = [m for m in messages if m.get("role") != "system"]
    if len(turns) <= 1:
        return _text(turns[-1]) if turns else ""
    lines = ["Here is our conversation so far:"]
    for message in turns[:-1]:
        lines.append(f"[{message.get('role')}]: {_text(message)}")
    lines.append("")
    lines.append("Continue it. My new message:")
    lines.append(_text(turns[-1]))
    return "\n".join(lines)


def system_text(messages: list[dict[str, Any]]) -> str:
    return "\n\n".join(_text(m) for m in messages if m.get("role") == "system")


class SessionLost(Exception):
    pass


class CLISession(CustomLLM):
    """Runs one CLI invocation per call with a timeout; the session id comes back as response id."""

    binary = ""

    def __init__(self, timeout: float) -> None:
        super().__init__()
        self.timeout = timeout

    def command(self, model: str, prompt: str, system: str, session: str | None) -> list[str]:
        raise NotImplementedError

    def parse(self, stdout: str) -> tuple[str, str | None, dict[str, int], float | None]:
        raise NotImplementedError

    def session_lost(self, stdout: str, stderr: str) -> bool:
        text = (stdout + stderr).lower()
        return "no conversation found" in text or "session not found" in text or "invalid session" in text

    async def _run(self, argv: list[str], timeout: float) -> tuple[int, str, str]:
        process = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, start_new_session=True,
        )
        try:
            stdout, stderr = await asyncio.wait_for(process.communicate(), timeout)
        except (TimeoutError, asyncio.CancelledError):
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            await process.wait()
            raise
        return process.returncode or 0, stdout.decode(errors="replace"), stderr.decode(errors="replace")

    async def _invoke(self, model: str, prompt: str, system: str, session: str | None, timeout: float) -> tuple[str, str | None, dict[str, int], float | None]:
        try:
            code, stdout, stderr = await self._run(self.command(model, prompt, system, session), timeout)
        except FileNotFoundError:
            raise CommandMissing(self.binary) from None
        except TimeoutError:
            raise CustomLLMError(status_code=408, message=f"{self.binary} did not answer within {timeout}s") from None
        if code != 0:
            if session and self.session_lost(stdout, stderr):
                raise SessionLost(stderr.strip() or stdout.strip())
            raise CustomLLMError(status_code=500, message=f"{self.binary} exited {code}: {(stderr or stdout).strip()[:500]}")
        try:
            return self.parse(stdout)
        except (ValueError, KeyError, TypeError) as exc:
            raise CustomLLMError(status_code=502, message=f"unreadable {self.binary} output: {exc}") from None

    async def acompletion(self, model: str, messages: list, api_base: str, custom_prompt_dict: dict,
                          model_response: ModelResponse, *args: Any, **kwargs: Any) -> ModelResponse:
        litellm_params = kwargs.get("litellm_params") or {}
        metadata = litellm_params.get("metadata") or {}
        session = metadata.get(SESSION_METADATA_KEY)
        timeout = float(kwargs.get("timeout") or self.timeout)
        system = system_text(messages)
        note = None
        try:
            if session:
                new_input = _text([m for m in messages if m.get("role") != "system"][-1])
                result = await self._invoke(model, new_input, system, session, timeout)
            else:
                result = await self._invoke(model, seeded_prompt(messages), system, None, timeout)
        except SessionLost as lost:
            note = f"session {session} could not be resumed ({str(lost)[:200]}); started a fresh session with the rebuilt history"
            result = await self._invoke(model, seeded_prompt(messages), system, None, timeout)
        content, session_id, usage, cost = result
        model_response.choices[0].message.content = content  # type: ignore[union-attr]
        model_response.choices[0].finish_reason = "stop"
        model_response.model = f"{self.binary}-cli/{model}"
        model_response.created = int(time.time())
        if session_id:
            model_response.id = session_id
        model_response.usage = Usage(  # type: ignore[attr-defined]
            prompt_tokens=usage.get("input", 0), completion_tokens=usage.get("output", 0),
            total_tokens=usage.get("input", 0) + usage.get("output", 0),
        )
        hidden = getattr(model_response, "_hidden_params", None)
        if isinstance(hidden, dict):
            if session_id:
                hidden[SESSION_ID_KEY] = session_id
            if note:
                hidden[SESSION_NOTE_KEY] = note
            if cost is not None:
                hidden["response_cost"] = cost
        return model_response


class ClaudeCLI(CLISession):
    binary = "claude"

    def command(self, model: str, prompt: str, system: str, session: str | None) -> list[str]:
        argv = [self.binary, "-p", "--output-format", "json"]
        if model and model != "default":
            argv += ["--model", model]
        if session:
            argv += ["--resume", session]
        elif system:
            argv += ["--append-system-prompt", system]
        return [*argv, "--", prompt]  # "--": a prompt such as "- a list item" is not an option

    def parse(self, stdout: str) -> tuple[str, str | None, dict[str, int], float | None]:
        data = json.loads(stdout)
        if data.get("is_error"):
            raise CustomLLMError(status_code=500, message=str(data.get("result") or "claude reported an error"))
        usage = data.get("usage") or {}
        return (
            str(data["result"]),
            data.get("session_id"),
            {"input": int(usage.get("input_tokens") or 0), "output": int(usage.get("output_tokens") or 0)},
            data.get("total_cost_usd"),
        )


class GeminiCLI(CLISession):
    binary = "gemini"

    def command(self, model: str, prompt: str, system: str, session: str | None) -> list[str]:
        argv = [self.binary, "--output-format", "json"]
        if model and model != "default":
            argv += ["--model", model]
        if session:
            argv += ["--resume", session]
        elif system:
            prompt = f"{system}\n\n{prompt}"
        return [*argv, f"--prompt={prompt}"]  # one token: yargs takes "- a list item" as the value

    def parse(self, stdout: str) -> tuple[str, str | None, dict[str, int], float | None]:
        data = json.loads(stdout)
        if data.get("error"):
            raise CustomLLMError(status_code=500, message=str(data["error"]))
        stats = data.get("stats") or {}
        return (
            str(data["response"]),
            data.get("session_id"),
            {"input": int(stats.get("input_tokens") or 0), "output": int(stats.get("output_tokens") or 0)},
            None,
        )
