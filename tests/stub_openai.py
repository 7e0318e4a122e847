"""A local chat server that records what it receives and plays scripted answers and faults: the
OpenAI chat-completions API, and for the same script Anthropic's Messages API (`POST /v1/messages`)
and Ollama's chat API (`POST /api/chat`, not streamed).
A scripted answer may call tools (`Reply(calls=[...])`), in either format, streamed or not."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass
class Reply:
    """One scripted answer: text, or a fault (status/body/headers), optionally slow or drip-fed."""

    text: str | None = None
    status: int = 200
    body: str | None = None  # raw body, e.g. malformed JSON
    headers: dict[str, str] = field(default_factory=dict)
    delay: float = 0.0
    drip: float | None = None  # seconds between bytes of the body
    close: bool = False  # drop the connection without answering
    cut: bool = False  # a stream that stops after its text: no finish reason, no [DONE]
    endless: bool = False  # a 200 body that never ends (until the client stops reading)
    gate: asyncio.Event | None = None  # a stream holds its rest after the first chunk until this is set
    # tool calls the answer makes: {"name", "arguments" (JSON text or an object), "id" (made up when left out)};
    # one with "input" (free text) is a custom tool's call, in OpenAI's chat form {"type": "custom", ...}
    calls: list[dict[str, Any]] = field(default_factory=list)
    reasoning: str | None = None  # a reasoning summary given beside the answer (reasoning_content)
    # Anthropic only: a thinking block (its text, its signature) before the answer's blocks
    thinking: tuple[str, str] | None = None
    redacted: str | None = None  # Anthropic only: a redacted_thinking block's data, after the thinking block

    def tool_calls(self) -> list[dict[str, Any]]:
        """The calls with their ids and JSON arguments settled (the same ids in every format)."""
        settled = []
        for position, call in enumerate(self.calls):
            arguments = call.get("arguments", {})
            settled.append({"id": call.get("id") or f"call_{position}_{uuid.uuid4().hex[:8]}", "name": call["name"],
                            "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
                            **({"input": call["input"]} if "input" in call else {})})
        self.calls = settled  # a retried request sees the same ids
        return settled


def word_pieces(text: str) -> list[str]:
    """`text` in word pieces, as a model streams it (each but the last keeps its space)."""
    words = text.split(" ") if text else []
    return [word if position == len(words) - 1 else word + " " for position, word in enumerate(words)]


def word_count(messages: list[dict[str, Any]]) -> int:
    return sum(len(str(m.get("content", "")).split()) for m in messages)


def default_answer(messages: list[dict[str, Any]]) -> str:
    users = [str(m.get("content")) for m in messages if m.get("role") == "user"]
    return f"stub answer to: {users[-1] if users else ''}"


class StubOpenAI:
    def __init__(self, answer: Callable[[list[dict[str, Any]]], str] = default_answer, port: int = 0) -> None:
        self.answer = answer
        self.requests: list[dict[str, Any]] = []
        self.anthropic_requests: list[dict[str, Any]] = []  # bodies POSTed to /v1/messages
        self.ollama_requests: list[dict[str, Any]] = []  # bodies POSTed to /api/chat
        self.headers: list[dict[str, str]] = []
        self.script: deque[Reply] = deque()
        self.in_flight = 0
        self.max_in_flight = 0
        # calls that came through /via/<name>/v1 (one api_base per daemon): who sent each, and at once
        self.via: list[str | None] = []
        self.in_flight_via: dict[str, int] = {}
        self.max_in_flight_via: dict[str, int] = {}
        self.hold = 0.0  # every answer waits this long (to observe concurrency)
        # a tokenizer of the stub's own (default: words) and a context window it enforces
        self.prompt_tokens: Callable[[list[dict[str, Any]]], int] = word_count
        self.window: int | None = None
        self.counted: list[int] = []  # the prompt tokens of every request, as the stub counted them
        self.overflows = 0
        self.model_delay: dict[str, float] = {}  # model name -> seconds every answer of it waits
        self.model_gate: dict[str, asyncio.Event] = {}  # model name -> answers of it wait until set
        self.model_script: dict[str, deque[Reply]] = {}  # model name -> its own scripted answers
        self.hung_up = 0  # streams whose client went away while a gate held them (a cancelled call)
        self._runner: web.AppRunner | None = None
        self.port = port  # 0: one the kernel chooses

    @property
    def api_base(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def api_base_via(self, name: str) -> str:
        """An api_base whose calls the stub counts under `name` (one per daemon)."""
        return f"http://127.0.0.1:{self.port}/via/{name}/v1"

    def enqueue(self, *replies: Reply | str) -> None:
        for reply in replies:
            self.script.append(Reply(text=reply) if isinstance(reply, str) else reply)

    def messages(self, index: int = -1) -> list[dict[str, Any]]:
        return self.requests[index]["messages"]

    async def start(self) -> StubOpenAI:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/chat/completions", self._chat)
        app.router.add_post("/via/{via}/v1/chat/completions", self._chat)
        app.router.add_post("/v1/messages", self._messages)
        app.router.add_post("/api/chat", self._ollama_chat)
        app.router.add_post("/api/show", self._ollama_show)
        # a request still held open for a killed daemon (a slow model) is dropped at stop after a
        # second, instead of aiohttp's 60 s wait for it to end
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def __aenter__(self) -> StubOpenAI:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        self.headers.append(dict(request.headers))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        via = request.match_info.get("via")
        self.via.append(via)
        if via is not None:
            self.in_flight_via[via] = self.in_flight_via.get(via, 0) + 1
            self.max_in_flight_via[via] = max(self.max_in_flight_via.get(via, 0), self.in_flight_via[via])
        try:
            model = str(body.get("model"))
            own = self.model_script.get(model)
            reply = own.popleft() if own else self.script.popleft() if self.script else Reply()
            counted = self.prompt_tokens(body.get("messages", []))
            self.counted.append(counted)
            if self.window is not None and counted > self.window:
                self.overflows += 1
                reply = Reply(status=400, body=json.dumps({"error": {
                    "message": f"This model's maximum context length is {self.window} tokens. However, your "
                               f"messages resulted in {counted} tokens.",
                    "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}}))
            if self.hold:
                await asyncio.sleep(self.hold)
            if self.model_delay.get(model):
                await asyncio.sleep(self.model_delay[model])
            if model in self.model_gate:
                await self.model_gate[model].wait()
            if reply.delay:
                await asyncio.sleep(reply.delay)
            if reply.close:
                assert request.transport is not None
                request.transport.close()
                return web.Response(status=500)
            if reply.endless:
                return await self._endless(request)
            if reply.status != 200 or reply.body is not None:
                return await self._raw(request, reply)
            text = reply.text if reply.text is not None else "" if reply.calls else self.answer(body.get("messages", []))
            if body.get("stream"):
                return await self._stream(request, body, text, counted, cut=reply.cut, drip=reply.drip or 0.0,
                                          gate=reply.gate, calls=reply.tool_calls(), reasoning=reply.reasoning)
            return web.json_response(self._completion(body, text, counted, reply))
        finally:
            self.in_flight -= 1
            if via is not None:
                self.in_flight_via[via] -= 1

    async def _raw(self, request: web.Request, reply: Reply) -> web.StreamResponse:
        payload = reply.body if reply.body is not None else json.dumps(
            {"error": {"message": f"stub error {reply.status}", "type": "stub", "code": reply.status}})
        if reply.drip is None:
            return web.Response(status=reply.status, text=payload, headers=reply.headers,
                                content_type="application/json")
        response = web.StreamResponse(status=reply.status, headers=reply.headers)
        response.content_type = "application/json"
        await response.prepare(request)
        for byte in payload.encode():
            await response.write(bytes([byte]))
            await asyncio.sleep(reply.drip)
        await response.write_eof()
        return response

    @staticmethod
    def _completion(body: dict[str, Any], text: str, prompt_tokens: int, reply: Reply) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": text or None}
        calls = reply.tool_calls()
        if calls:
            message["tool_calls"] = [{"id": c["id"], "type": "custom", "custom": {"name": c["name"], "input": c["input"]}}
                                     if "input" in c else {"id": c["id"], "type": "function",
                                      "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]
        if reply.reasoning:
            message["reasoning_content"] = reply.reasoning
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex[:10]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model", "stub"),
            "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls" if calls else "stop"}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(text.split()),
                      "total_tokens": prompt_tokens + len(text.split())},
        }

    @staticmethod
    async def _endless(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        await response.write(b'{"id": "chatcmpl-endless", "choices": [{"index": 0, "message": {"content": "')
        block = b"x" * 65536
        try:
            while True:
                await response.write(block)
        except (ConnectionError, asyncio.CancelledError):
            pass
        return response

    @staticmethod
    async def _held(request: web.Request, gate: asyncio.Event) -> bool:
        """Wait for the gate; False when the client hangs up first (the daemon cancelled the call)."""
        while not gate.is_set():
            transport = request.transport
            if transport is None or transport.is_closing():
                return False
            try:
                await asyncio.wait_for(gate.wait(), 0.05)
            except TimeoutError:
                pass
        return True

    async def _stream(self, request: web.Request, body: dict[str, Any], text: str,
                      prompt_tokens: int, cut: bool = False, drip: float = 0.0,
                      gate: asyncio.Event | None = None,
                      calls: list[dict[str, Any]] | None = None, reasoning: str | None = None) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        ident = f"chatcmpl-{uuid.uuid4().hex[:10]}"
        for thought in word_pieces(reasoning or ""):  # a reasoning model's summary comes before its answer
            chunk = {"id": ident, "object": "chat.completion.chunk", "created": int(time.time()),
                     "model": body.get("model", "stub"),
                     "choices": [{"index": 0, "delta": {"reasoning_content": thought}, "finish_reason": None}]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        words = text.split(" ") if text or not calls else []
        for position, word in enumerate(words):
            piece = word if position == len(words) - 1 else word + " "
            chunk = {"id": ident, "object": "chat.completion.chunk", "created": int(time.time()),
                     "model": body.get("model", "stub"),
                     "choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            if drip:
                await asyncio.sleep(drip)  # seconds between streamed words
            if position == 0 and gate is not None and not await self._held(request, gate):
                self.hung_up += 1
                return response
        for index, call in enumerate(calls or []):
            # a call in pieces, as OpenAI streams it: id and name first, the arguments in two halves
            half = len(call["arguments"]) // 2
            pieces = [{"index": index, "id": call["id"], "type": "function",
                       "function": {"name": call["name"], "arguments": call["arguments"][:half]}},
                      {"index": index, "function": {"arguments": call["arguments"][half:]}}]
            if "input" in call:  # a custom tool's call: its free text input in two halves
                half = len(call["input"]) // 2
                pieces = [{"index": index, "id": call["id"], "type": "custom",
                           "custom": {"name": call["name"], "input": call["input"][:half]}},
                          {"index": index, "custom": {"input": call["input"][half:]}}]
            for piece in pieces:
                chunk = {"id": ident, "object": "chat.completion.chunk", "created": int(time.time()),
                         "model": body.get("model", "stub"),
                         "choices": [{"index": 0, "delta": {"tool_calls": [piece]}, "finish_reason": None}]}
                await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        if cut:
            await response.write_eof()
            return response
        final = {"id": ident, "object": "chat.completion.chunk", "created": int(time.time()),
                 "model": body.get("model", "stub"),
                 "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls" if calls else "stop"}],
                 "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(words),
                           "total_tokens": len(words) + prompt_tokens}}
        await response.write(f"data: {json.dumps(final)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    # -- Anthropic's Messages API ---------------------------------------------------------------------

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        """`POST /v1/messages`: recorded, answered from the same script as text or `tool_use` blocks."""
        body = await request.json()
        self.anthropic_requests.append(body)
        self.headers.append(dict(request.headers))
        reply = self.script.popleft() if self.script else Reply()
        if reply.status != 200 or reply.body is not None:
            return await self._raw(request, reply)
        users = [m for m in body.get("messages", []) if m.get("role") == "user"]
        last = users[-1]["content"] if users else ""
        if isinstance(last, list):
            last = " ".join(str(block.get("text", "")) for block in last if isinstance(block, dict))
        text = reply.text if reply.text is not None else "" if reply.calls else f"stub answer to: {last}"
        content: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
        if reply.thinking is not None:
            content.insert(0, {"type": "thinking", "thinking": reply.thinking[0], "signature": reply.thinking[1]})
        if reply.redacted is not None:
            content.insert(1 if reply.thinking is not None else 0, {"type": "redacted_thinking", "data": reply.redacted})
        content += [{"type": "tool_use", "id": c["id"], "name": c["name"], "input": json.loads(c["arguments"] or "{}")}
                    for c in reply.tool_calls()]
        answer = {"id": f"msg_{uuid.uuid4().hex[:12]}", "type": "message", "role": "assistant",
                  "model": body.get("model", "stub"), "content": content,
                  "stop_reason": "tool_use" if reply.calls else "end_turn", "stop_sequence": None,
                  "usage": {"input_tokens": word_count(body.get("messages", [])), "output_tokens": len(text.split())}}
        if not body.get("stream"):
            return web.json_response(answer)
        return await self._message_stream(request, answer)

    @staticmethod
    async def _message_stream(request: web.Request, answer: dict[str, Any]) -> web.StreamResponse:
        """The answer as Anthropic streams it: message_start, a start/delta/stop per block, message_delta."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)

        async def send(kind: str, data: dict[str, Any]) -> None:
            await response.write(f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode())

        await send("message_start", {"message": {**answer, "content": [], "stop_reason": None,
                                                 "usage": {**answer["usage"], "output_tokens": 0}}})
        for index, block in enumerate(answer["content"]):
            if block["type"] == "text":
                await send("content_block_start", {"index": index, "content_block": {"type": "text", "text": ""}})
                await send("content_block_delta", {"index": index, "delta": {"type": "text_delta", "text": block["text"]}})
            elif block["type"] == "thinking":
                await send("content_block_start", {"index": index, "content_block": {
                    "type": "thinking", "thinking": "", "signature": ""}})
                for thought in word_pieces(block["thinking"]):
                    await send("content_block_delta", {"index": index, "delta": {
                        "type": "thinking_delta", "thinking": thought}})
                await send("content_block_delta", {"index": index, "delta": {
                    "type": "signature_delta", "signature": block["signature"]}})
            elif block["type"] == "redacted_thinking":
                await send("content_block_start", {"index": index, "content_block": block})
            else:
                await send("content_block_start", {"index": index, "content_block": {**block, "input": {}}})
                await send("content_block_delta", {"index": index, "delta": {
                    "type": "input_json_delta", "partial_json": json.dumps(block["input"])}})
            await send("content_block_stop", {"index": index})
        await send("message_delta", {"delta": {"stop_reason": answer["stop_reason"], "stop_sequence": None},
                                     "usage": {"output_tokens": answer["usage"]["output_tokens"]}})
        await send("message_stop", {})
        await response.write_eof()
        return response

    # -- Ollama's chat API ----------------------------------------------------------------------------

    async def _ollama_chat(self, request: web.Request) -> web.StreamResponse:
        """`POST /api/chat` (not streamed): recorded, answered from the script; Ollama's tool calls
        carry no id (litellm makes one) and their arguments are objects."""
        body = await request.json()
        self.ollama_requests.append(body)
        reply = self.script.popleft() if self.script else Reply()
        if reply.status != 200 or reply.body is not None:
            return await self._raw(request, reply)
        text = reply.text if reply.text is not None else "" if reply.calls else self.answer(body.get("messages", []))
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if reply.calls:
            message["tool_calls"] = [{"function": {"name": c["name"], "arguments": json.loads(c["arguments"])}}
                                     for c in reply.tool_calls()]
        return web.json_response({"model": body.get("model", "stub"), "created_at": "2026-01-01T00:00:00Z",
                                  "message": message, "done": True, "done_reason": "stop",
                                  "prompt_eval_count": word_count(body.get("messages", [])),
                                  "eval_count": len(text.split())})

    async def _ollama_show(self, _request: web.Request) -> web.StreamResponse:
        """`POST /api/show`: a model whose template takes tools (litellm reads that as function calling)."""
        return web.json_response({"template": "{{ if .Tools }}{{ .Tools }}{{ end }}{{ .Prompt }}",
                                  "model_info": {"llama.context_length": 8192}, "details": {}})


@contextmanager
def served_from_a_thread(stub: StubOpenAI) -> Iterator[StubOpenAI]:
    """`stub` served by an event loop of its own: litellm asks an Ollama server for its model
    info with a blocking call from the caller's event loop, which a stub on that loop could never
    answer."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(stub.start(), loop).result(30)
    try:
        yield stub
    finally:
        asyncio.run_coroutine_threadsafe(stub.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()
