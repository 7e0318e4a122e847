"""A provider emulator that applies OpenAI's published automatic prompt-cache rules to the chat
completions it answers, so tests see the cache counts a real provider would report.

The rules: every request's prompt is cached; a later request reads the longest prefix it shares
with a cached prompt still within its lifetime, counted in steps of 128 tokens, and nothing below
1024 tokens. Requests are routed by their `prompt_cache_key`: a request reads only prompts cached
under the same key (none: only those sent without one), as a key sends requests to one cache. A
token here is a word of the serialized messages (with tools ahead of them), which keeps counts
easy to reason about in tests.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

from aiohttp import web

MINIMUM = 1024  # no prefix shorter than this is cached
STEP = 128  # cached prefixes grow in these steps
LIFETIME_S = 300.0  # an unused prefix is evicted after five minutes
LIFETIMES = {"5m": LIFETIME_S, "1h": 3600.0}  # Anthropic's breakpoint lifetimes by `ttl`
MAX_BREAKPOINTS = 4  # Anthropic refuses a request with more


def prompt_words(body: dict[str, Any]) -> list[str]:
    """The request's prompt as the emulator tokenizes it: tools, then each message in order."""
    words: list[str] = []
    if body.get("tools"):
        words.extend(json.dumps(body["tools"], sort_keys=True).split())
    for message in body.get("messages") or []:
        words.append(f"<{message.get('role')}>")
        content = message.get("content")
        text = content if isinstance(content, str) else json.dumps(content, sort_keys=True)
        words.extend((text or "").split())
        if message.get("tool_calls"):
            words.extend(json.dumps(message["tool_calls"], sort_keys=True).split())
    return words


def shared_prefix(first: list[str], second: list[str]) -> int:
    length = 0
    for a, b in zip(first, second, strict=False):
        if a != b:
            break
        length += 1
    return length


class CacheEmulator:
    """An OpenAI-compatible chat server with an automatic prefix cache; `usages` lists what it
    reported for every request, in order."""

    def __init__(self) -> None:
        # prompt words, last used (monotonic), the prompt_cache_key they were sent with
        self.cached: list[tuple[list[str], float, str | None]] = []
        self.requests: list[dict[str, Any]] = []
        self.usages: list[dict[str, Any]] = []
        self.anthropic_requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []  # every request's headers, in order, whichever route
        self.anthropic_usages: list[dict[str, Any]] = []
        # prefix digest (up to a breakpoint) -> (last used, lifetime in seconds)
        self.anthropic_cached: dict[str, tuple[float, float]] = {}
        self.skew = 0.0  # seconds the emulator's clock is ahead: a test moves time without waiting
        self.port = 0
        self._runner: web.AppRunner | None = None

    @property
    def api_base(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def __aenter__(self) -> CacheEmulator:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/messages", self._messages)
        # a request still held open for a killed daemon (a slow model) is dropped at stop after a
        # second, instead of aiohttp's 60 s wait for it to end
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def now(self) -> float:
        return time.monotonic() + self.skew

    def read_from_cache(self, words: list[str], key: str | None = None) -> int:
        """The cached tokens of a prompt sent with `key`, by the rules above; the prompt is cached
        afterwards, under that key."""
        now = self.now()
        self.cached = [(prompt, used, k) for prompt, used, k in self.cached if now - used < LIFETIME_S]
        longest = max((shared_prefix(prompt, words) for prompt, _used, k in self.cached if k == key), default=0)
        read = longest // STEP * STEP if longest >= MINIMUM else 0
        if len(words) >= MINIMUM:
            self.cached.append((words, now, key))
        return read

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.headers.append(dict(request.headers))
        self.requests.append(body)
        words = prompt_words(body)
        usage = {"prompt_tokens": len(words), "completion_tokens": 2, "total_tokens": len(words) + 2,
                 "prompt_tokens_details": {"cached_tokens": self.read_from_cache(words, body.get("prompt_cache_key"))}}
        self.usages.append(usage)
        text = f"answer {len(self.requests)}"
        if body.get("stream"):
            return await self._stream(request, body, text, usage)
        return web.json_response({
            "id": f"chatcmpl-{len(self.requests)}", "object": "chat.completion", "created": int(time.time()),
            "model": body.get("model"), "usage": usage,
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}]})

    @staticmethod
    async def _stream(request: web.Request, body: dict[str, Any], text: str,
                      usage: dict[str, Any]) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        base = {"id": "chatcmpl-s", "object": "chat.completion.chunk", "created": int(time.time()),
                "model": body.get("model")}
        chunks = [
            {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": text}}]},
            {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
            {**base, "choices": [], "usage": usage},
        ]
        for chunk in chunks:
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    def anthropic_cache(self, blocks: list[tuple[str, int, float]]) -> tuple[int, int]:
        """Anthropic's rules over (block text, tokens, breakpoint lifetime or 0) in prompt order: each
        breakpoint caches the prefix up to it for its lifetime; a read is the longest cached prefix
        ending at a breakpoint or at one of the 20 blocks before it, and refreshes that prefix's
        lifetime. Returns (tokens read, tokens written)."""
        now = self.now()
        self.anthropic_cached = {k: (t, life) for k, (t, life) in self.anthropic_cached.items() if now - t < life}
        digests, totals, running, total = [], [], hashlib.sha256(), 0
        for text, tokens, _mark in blocks:
            running.update(text.encode() + b"\0")
            total += tokens
            digests.append(running.copy().hexdigest())
            totals.append(total)
        read = 0
        for index in (i for i, block in enumerate(blocks) if block[2]):
            for back in range(index, max(-1, index - 21), -1):
                if digests[back] in self.anthropic_cached:
                    read = max(read, totals[back])
                    self.anthropic_cached[digests[back]] = (now, self.anthropic_cached[digests[back]][1])
                    break
        written = 0
        for index in (i for i, block in enumerate(blocks) if block[2]):
            if totals[index] >= MINIMUM and digests[index] not in self.anthropic_cached:
                self.anthropic_cached[digests[index]] = (now, blocks[index][2])
                written = max(written, totals[index] - read)
        return read, written

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.headers.append(dict(request.headers))
        self.anthropic_requests.append(body)
        blocks = anthropic_blocks(body)
        refusal = breakpoint_refusal([life for _t, _n, life in blocks if life])
        if refusal:
            return web.json_response({"type": "error", "error": {"type": "invalid_request_error",
                                                                 "message": refusal}}, status=400)
        read, written = self.anthropic_cache(blocks)
        total = sum(tokens for _t, tokens, _m in blocks)
        usage = {"input_tokens": total - read - written, "output_tokens": 2,
                 "cache_read_input_tokens": read, "cache_creation_input_tokens": written}
        self.anthropic_usages.append(usage)
        return web.json_response({
            "id": f"msg_{len(self.anthropic_requests)}", "type": "message", "role": "assistant",
            "model": body.get("model"), "stop_reason": "end_turn", "stop_sequence": None, "usage": usage,
            "content": [{"type": "text", "text": f"answer {len(self.anthropic_requests)}"}]})


def breakpoint_refusal(lifetimes: list[float]) -> str | None:
    """Anthropic's refusal of a request's breakpoints (their lifetimes in prompt order), if any."""
    if len(lifetimes) > MAX_BREAKPOINTS:
        return f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided. Found {len(lifetimes)}."
    if any(shorter < longer for shorter, longer in zip(lifetimes, lifetimes[1:], strict=False)):
        return "a ttl='1h' cache_control block must not come after a ttl='5m' cache_control block"
    return None


def breakpoint_lifetime(block: dict[str, Any]) -> float:
    """The lifetime of a block's breakpoint in seconds; 0 when it carries none."""
    marker = block.get("cache_control")
    return LIFETIMES[marker.get("ttl", "5m")] if isinstance(marker, dict) else 0.0


def anthropic_blocks(body: dict[str, Any]) -> list[tuple[str, int, float]]:
    """A Messages request as (text, tokens, breakpoint lifetime or 0) blocks in cache order: tools,
    system, messages."""
    blocks: list[tuple[str, int, float]] = []
    for tool in body.get("tools") or []:
        text = json.dumps({k: v for k, v in tool.items() if k != "cache_control"}, sort_keys=True)
        blocks.append((text, len(text.split()), breakpoint_lifetime(tool)))
    system = body.get("system") or []
    for block in [{"type": "text", "text": system}] if isinstance(system, str) else system:
        blocks.append((block.get("text", ""), len(block.get("text", "").split()), breakpoint_lifetime(block)))
    for message in body.get("messages") or []:
        content = message.get("content")
        for block in [{"type": "text", "text": content}] if isinstance(content, str) else content:
            text = message["role"] + json.dumps({k: v for k, v in block.items() if k != "cache_control"},
                                                sort_keys=True)
            blocks.append((text, len(text.split()), breakpoint_lifetime(block)))
    return blocks
