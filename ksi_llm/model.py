"""`ksi/...` models for `llm`: each prompt is one KSI request in the KSI conversation tied to
`llm`'s conversation, so `llm` sends only the new prompt and KSI rebuilds the history."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Generator, Iterator
from pathlib import Path
from typing import Any

import llm
from pydantic import Field

from ksi_common.client import KsiClient
from ksi_common.errors import ErrorCode, KsiError
from ksi_common.events import (
    COMPLETION_ASYNC,
    COMPLETION_CANCEL,
    COMPLETION_CHUNK,
    COMPLETION_RESULT,
    MONITOR_SUBSCRIBE,
)
from ksi_common.ids import is_safe_id
from ksi_common.oneshot import Connection
from ksi_common.submitting import WAIT_SLICE, follow, follow_blocking

PREFIX = "ksi/"
AGENT_PREFIX = "agent/"
CONVERSATION_PREFIX = "llm-"  # the KSI conversation of llm conversation X is llm-X
LINK_KEY = "llm"  # the name of llm's id in a KSI conversation's external ids
ACK_TIMEOUT = 30.0  # seconds for a request's acknowledgement, beyond a wait's own time
# KSI embeds attached files as text in the prompt, so only text-like files are offered
TEXT_TYPES = frozenset({
    "text/plain", "text/markdown", "text/csv", "text/html", "text/xml", "text/x-python", "text/x-script.python",
    "text/x-c", "text/x-shellscript", "text/javascript", "application/json", "application/xml",
    "application/x-yaml", "application/yaml", "application/toml", "application/javascript",
})


class KsiModelError(llm.ModelError):
    """A KSI error as `llm` shows it: the code first, then the message and what to do."""

    def __init__(self, code: str, message: str, hint: str | None = None) -> None:
        super().__init__(f"[{code}] {message}" + (f"\n{hint}" if hint else ""))
        self.code = code


def ksi_conversation_id(llm_conversation_id: str) -> str:
    """The KSI conversation that holds llm conversation `llm_conversation_id`."""
    ksi_id = CONVERSATION_PREFIX + llm_conversation_id
    if not is_safe_id(ksi_id):
        raise KsiModelError(ErrorCode.VALIDATION_ERROR,
                            f"llm conversation id {llm_conversation_id!r} cannot name a KSI conversation")
    return ksi_id


def continues_in_ksi(conversation: llm.Conversation | llm.AsyncConversation) -> bool:
    """Whether an earlier turn of this llm conversation was answered through KSI (so its KSI
    conversation exists); on the first KSI turn it is created instead."""
    return any(response.model.model_id.startswith(PREFIX) for response in conversation.responses)


def hint_for(error: KsiError, socket_path: Path, conversation_id: str | None) -> str | None:
    match error.code:
        case ErrorCode.DAEMON_UNREACHABLE:
            return f"Is the KSI daemon running? Start it with: ksi daemon start (this looked for {socket_path})"
        case ErrorCode.CONVERSATION_EXPIRED | ErrorCode.CONVERSATION_FULL | ErrorCode.CONVERSATION_ARCHIVED:
            return (f"Start a new llm conversation (leave out -c/--cid), or see it with: "
                    f"ksi conversation show {conversation_id}")
        case ErrorCode.CONVERSATION_NOT_FOUND:
            return ("Its KSI conversation is gone (deleted, or this daemon has another var dir); "
                    "start a new llm conversation (leave out -c/--cid)")
        case ErrorCode.CONSORTIUM_NOT_FOUND:
            return "Saved consortia: ksi send consortium:list"
        case ErrorCode.AGENT_NOT_FOUND | ErrorCode.AGENT_TERMINATED:
            return "Agents: ksi agents"
    return None


class KsiTarget:
    """What the blocking and the async `ksi/...` model share: the name, the request, the record."""

    can_stream = True
    attachment_types = TEXT_TYPES

    class Options(llm.Options):
        temperature: float | None = Field(default=None, ge=0, le=2, description="Sampling temperature")
        max_tokens: int | None = Field(default=None, gt=0, description="Upper bound on the answer's tokens")

    def __init__(self, name: str, socket_path: Path) -> None:
        self.model_id = PREFIX + name
        self.name = name
        self.socket_path = socket_path

    def request_data(self, prompt: llm.Prompt, stream: bool, response_id: str,
                     conversation: llm.Conversation | llm.AsyncConversation | None) -> dict[str, Any]:
        """The `completion:async` payload: only this turn's input, in the tied KSI conversation."""
        data: dict[str, Any] = {"prompt": prompt.prompt, "stream": stream, "origin": "llm",
                                "metadata": {"llm_response_id": response_id}}
        if self.name.startswith(AGENT_PREFIX):
            data["agent_id"] = self.name[len(AGENT_PREFIX):]
        else:
            data["model"] = self.name
        if conversation is not None:
            data["conversation_id"] = ksi_conversation_id(conversation.id)
            data["metadata"]["llm_conversation_id"] = conversation.id
            if not continues_in_ksi(conversation):
                data["create"] = True
                data["external_ids"] = {LINK_KEY: conversation.id}
        if prompt.system:
            data["system"] = prompt.system
        for option in ("temperature", "max_tokens"):
            value = getattr(prompt.options, option, None)
            if value is not None:
                data[option] = value
        files = []
        for attachment in prompt.attachments:
            if not attachment.path:
                raise KsiModelError(ErrorCode.VALIDATION_ERROR,
                                    f"KSI attaches files by path; {attachment.url or 'piped content'} has none",
                                    "Save it to a file and attach that path with -a")
            files.append(str(Path(attachment.path).resolve()))
        if files:
            data["files"] = files
        return data

    def model_error(self, error: KsiError, data: dict[str, Any]) -> KsiModelError:
        return KsiModelError(error.code, error.message, hint_for(error, self.socket_path, data.get("conversation_id")))

    def record(self, response: llm.Response | llm.AsyncResponse, result: dict[str, Any]) -> None:
        """Where to find the answer in KSI, its usage, and the model that gave it."""
        response.response_json = {
            key: result[key] for key in ("conversation_id", "response_id", "request_id", "model", "agent_id",
                                         "finish_reason", "cost", "run_id") if result.get(key) is not None
        }
        usage = result.get("usage") or {}
        response.set_usage(input=usage.get("prompt_tokens"), output=usage.get("completion_tokens"))
        if result.get("model") and result["model"] != self.name:
            response.set_resolved_model(result["model"])


def remainder(result: dict[str, Any], shown: list[str]) -> str:
    """What the streamed chunks did not show: chunks still on their way when the result came are
    not waited for, the result completes them."""
    content, streamed = str(result["content"]), "".join(shown)
    return content[len(streamed):] if content.startswith(streamed) else ""


class KsiModel(KsiTarget, llm.Model):
    """`ksi/NAME`: KSI model, `ksi/consortium/NAME`, or `ksi/agent/ID` (the agent answers)."""

    def execute(self, prompt: llm.Prompt, stream: bool, response: llm.Response,
                conversation: llm.Conversation | None) -> Iterator[str]:
        data = self.request_data(prompt, stream, response.id, conversation)
        try:
            result = yield from self._answer(data, stream)
        except KsiError as error:
            raise self.model_error(error, data) from None
        self.record(response, result)

    def _answer(self, data: dict[str, Any], stream: bool) -> Generator[str, None, dict[str, Any]]:
        """Yield the answer's text as it streams in; return the result data."""
        with Connection(self.socket_path, timeout=WAIT_SLICE + ACK_TIMEOUT) as connection:
            if stream:
                connection.request(MONITOR_SUBSCRIBE, {"patterns": [COMPLETION_CHUNK]})
            request_id = connection.request(COMPLETION_ASYNC, data)["request_id"]
            shown: list[str] = []
            try:
                result: dict[str, Any] = {}
                for event, payload in follow_blocking(connection, request_id):
                    if event == COMPLETION_RESULT:
                        result = payload
                    else:
                        shown.append(str(payload.get("text") or ""))
                        yield shown[-1]
            except (KeyboardInterrupt, GeneratorExit):
                try:  # do not leave the abandoned answer running
                    connection.send(COMPLETION_CANCEL, {"request_id": request_id})
                except KsiError:
                    pass
                raise
        if rest := remainder(result, shown):
            yield rest
        return result


class AsyncKsiModel(KsiTarget, llm.AsyncModel):
    """The same models for `llm --async` and llm's async Python API, on the async client."""

    async def execute(self, prompt: llm.Prompt, stream: bool, response: llm.AsyncResponse,
                      conversation: llm.AsyncConversation | None) -> AsyncIterator[str]:
        data = self.request_data(prompt, stream, response.id, conversation)
        shown: list[str] = []
        try:
            async with KsiClient(self.socket_path) as client:
                if stream:
                    await client.request(MONITOR_SUBSCRIBE, {"patterns": [COMPLETION_CHUNK]})
                request_id = (await client.request(COMPLETION_ASYNC, data))["request_id"]
                try:
                    result: dict[str, Any] = {}
                    async for event, payload in follow(client, request_id):
                        if event == COMPLETION_RESULT:
                            result = payload
                        else:
                            shown.append(str(payload.get("text") or ""))
                            yield shown[-1]
                except (asyncio.CancelledError, GeneratorExit):
                    try:  # do not leave the abandoned answer running
                        await asyncio.shield(client.send_frame(COMPLETION_CANCEL, {"request_id": request_id}))
                    except KsiError:
                        pass
                    raise
        except KsiError as error:
            raise self.model_error(error, data) from None
        if rest := remainder(result, shown):
            yield rest
        self.record(response, result)
