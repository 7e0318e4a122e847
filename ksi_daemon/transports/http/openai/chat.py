"""/v1/chat/completions: the new input (the messages after the last assistant one) is sent with
the client's own earlier turns, if any, as the history KSI matches to the conversation they belong
to (continued, forked where it differs, or new); with a conversation id only the new input is
needed, and a history sent with one must be that conversation's."""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ksi_common.errors import KsiError
from ksi_daemon.transports.http.openai import shapes, tool_shapes
from ksi_daemon.transports.http.openai.responses import SSE_HEADERS
from ksi_daemon.transports.http.openai.runs import Chunk, CompletionStream, Done, complete
from ksi_daemon.transports.http.openai.schemas import ChatCompletionCreate, ChatFilePart
from ksi_daemon.transports.http.openai.translate import (
    CHAT_FIELDS,
    HISTORY_HEADER,
    Door,
    chat_payload,
    history_used,
    renamed,
    split_chat,
)

CONVERSATION_HEADER = "X-KSI-Conversation-Id"
FILE_FIELD = re.compile(r"^messages\.(\d+)\.content\.(\d+)\.(file_data|filename)$")


def nested_file_fields(error: KsiError, body: ChatCompletionCreate) -> KsiError:
    """`error` naming a PDF's fields where a Chat Completions client put them, under its part's
    `file` (completion:async, which checks the bytes, names them flat, as a Responses part has them)."""
    fields = error.details.get("fields")
    if not isinstance(fields, dict):
        return error
    mapped, message = {}, error.message
    for key, value in fields.items():
        found = FILE_FIELD.match(key)
        if found is not None and _is_chat_file(body, int(found[1]), int(found[2])):
            nested = key.replace(f".{found[3]}", f".file.{found[3]}")
            message = message.replace(key, nested)
            key = nested
        mapped[key] = value
    return KsiError(error.code, message, **{**error.details, "fields": mapped})


def _is_chat_file(body: ChatCompletionCreate, position: int, index: int) -> bool:
    content = body.messages[position].content if position < len(body.messages) else None
    return isinstance(content, list) and index < len(content) and isinstance(content[index], ChatFilePart)


class ChatCompletions:
    def __init__(self, door: Door) -> None:
        self.door = door

    async def create(self, request: Request) -> Response:
        body: ChatCompletionCreate = await self.door.body(request, ChatCompletionCreate)
        conversation_id = body.conversation_id or request.headers.get(CONVERSATION_HEADER)
        chat = split_chat(body)
        created = int(time.time())
        try:
            payload = chat_payload(body, chat, conversation_id)
            if body.stream:
                stream = CompletionStream(self.door.handle_request, self.door.background)
                ack = await stream.start(payload)
                return StreamingResponse(self._chunks(stream, ack, body, created), media_type="text/event-stream",
                                         headers={**SSE_HEADERS, CONVERSATION_HEADER: ack["conversation_id"]})
            result = await complete(self.door.handle_request, payload)
        except KsiError as error:
            raise nested_file_fields(renamed(error, CHAT_FIELDS, chat.positions), body) from None
        shaped = tool_shapes.with_tool_calls(shapes.chat_completion(result, created), result)
        headers = {CONVERSATION_HEADER: result["conversation_id"]}
        used = history_used(result)
        if used is not None:
            shaped["metadata"] = {**(body.metadata or {}), "ksi_history": used}
            headers[HISTORY_HEADER] = used
        return JSONResponse(shaped, headers=headers)

    async def _chunks(self, stream: CompletionStream, ack: dict[str, Any], body: ChatCompletionCreate,
                      created: int) -> AsyncIterator[bytes]:
        chunk_id = f"chatcmpl-{ack['response_id']}"
        ids = {"conversation_id": ack["conversation_id"], "response_id": ack["response_id"]}

        def line(data: dict[str, Any]) -> bytes:
            return b"data: " + orjson.dumps(data) + b"\n\n"

        calls = tool_shapes.ChatCallDeltas()
        try:
            yield line(shapes.chat_chunk(chunk_id, ack["model"], created, {"role": "assistant", "content": ""}, **ids))
            async for outcome in stream.events():
                if isinstance(outcome, Chunk):
                    if outcome.text:
                        yield line(shapes.chat_chunk(chunk_id, ack["model"], created, {"content": outcome.text}))
                    if outcome.tool_call is not None:
                        yield line(shapes.chat_chunk(chunk_id, ack["model"], created, calls.delta(outcome.tool_call)))
                elif isinstance(outcome, Done):
                    result = outcome.result
                    used = history_used(result)
                    unsent = calls.unsent(result.get("output") or [])
                    if unsent is not None:
                        yield line(shapes.chat_chunk(chunk_id, ack["model"], created, unsent))
                    yield line(shapes.chat_chunk(chunk_id, ack["model"], created, {},
                                                 result.get("finish_reason") or "stop", **ids,
                                                 **({"metadata": {"ksi_history": used}} if used else {})))
                    if body.stream_options is not None and body.stream_options.include_usage:
                        usage = shapes.chat_completion(result, created)["usage"]
                        yield line({**shapes.chat_chunk(chunk_id, ack["model"], created, {}), "choices": [],
                                    "usage": usage})
                else:
                    error = outcome.error
                    yield line({"error": {"message": error.message, "type": "server_error", "code": error.code,
                                          "param": None}})
            yield b"data: [DONE]\n\n"
        finally:
            stream.abandon()


