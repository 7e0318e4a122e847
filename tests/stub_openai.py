"""A local OpenAI-compatible chat server that records what it receives and plays scripted faults."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import deque
from collections.abc import Callable
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


def word_count(messages: list[dict[str, Any]]) -> int:
    return sum(len(str(m.get("content", "")).split()) for m in messages)


def default_answer(messages: list[dict[str, Any]]) -> str:
    users = [str(m.get("content")) for m in messages if m.get("role") == "user"]
    return f"stub answer to: {users[-1] if users else ''}"


class StubOpenAI:
    def __init__(self, answer: Callable[[list[dict[str, Any]]], str] = default_answer, port: int = 0) -> None:
        self.answer = answer
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.script: deque[Reply] = deque()
        self.in_flight = 0
        self.max_in_flight = 0
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

    def enqueue(self, *replies: Reply | str) -> None:
        for reply in replies:
            self.script.append(Reply(text=reply) if isinstance(reply, str) else reply)

    def messages(self, index: int = -1) -> list[dict[str, Any]]:
        return self.requests[index]["messages"]

    async def start(self) -> StubOpenAI:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/chat/completions", self._chat)
        self._runner = web.AppRunner(app, access_log=None)
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
            text = reply.text if reply.text is not None else self.answer(body.get("messages", []))
            if body.get("stream"):
                return await self._stream(request, body, text, counted, cut=reply.cut, drip=reply.drip or 0.0,
                                          gate=reply.gate)
            return web.json_response(self._completion(body, text, counted))
        finally:
            self.in_flight -= 1

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
    def _completion(body: dict[str, Any], text: str, prompt_tokens: int) -> dict[str, Any]:
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex[:10]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model", "stub"),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
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
                      gate: asyncio.Event | None = None) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        ident = f"chatcmpl-{uuid.uuid4().hex[:10]}"
        words = text.split(" ")
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
        if cut:
            await response.write_eof()
            return response
        final = {"id": ident, "object": "chat.completion.chunk", "created": int(time.time()),
                 "model": body.get("model", "stub"),
                 "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                 "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(words),
                           "total_tokens": len(words) + prompt_tokens}}
        await response.write(f"data: {json.dumps(final)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response
