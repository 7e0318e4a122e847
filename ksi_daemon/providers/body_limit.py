"""An HTTP transport that stops reading a provider's answer at the size limit, so a flood is
refused while it arrives instead of after it was buffered whole."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx


class ResponseTooLarge(httpx.ReadError):
    """The body passed the limit; the connection is dropped. `limit` is the answer's limit."""

    def __init__(self, limit: int, request: httpx.Request) -> None:
        super().__init__(f"the answer exceeds {limit} bytes", request=request)
        self.limit = limit


def body_limit(answer_limit: int) -> int:
    """Bytes of body allowed for an answer of `answer_limit` bytes: JSON escaping can double the
    text (non-ASCII as \\uXXXX), plus room for the envelope around it."""
    return 2 * answer_limit + 64 * 1024


class _LimitedStream(httpx.AsyncByteStream):
    def __init__(self, inner: httpx.AsyncByteStream, limit: int, answer_limit: int,
                 request: httpx.Request) -> None:
        self._inner = inner
        self._limit = limit
        self._answer_limit = answer_limit
        self._request = request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        received = 0
        async for chunk in self._inner:
            received += len(chunk)
            if received > self._limit:
                await self._inner.aclose()
                raise ResponseTooLarge(self._answer_limit, self._request)
            yield chunk

    async def aclose(self) -> None:
        await self._inner.aclose()


class BodyLimitTransport(httpx.AsyncBaseTransport):
    """Wraps a transport; a non-streamed body over `limit` bytes fails at the byte that passes it.

    Event streams are let through: the stream reader counts the answer's text against the same
    limit as it goes, and their framing would count against it several times over.
    """

    def __init__(self, answer_limit: int, inner: httpx.AsyncBaseTransport | None = None) -> None:
        self.answer_limit = answer_limit
        self.limit = body_limit(answer_limit)
        self.inner = inner or httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if "text/event-stream" in response.headers.get("content-type", ""):
            return response
        declared = response.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await response.aclose()
            raise ResponseTooLarge(self.answer_limit, request)
        assert isinstance(response.stream, httpx.AsyncByteStream)
        response.stream = _LimitedStream(response.stream, self.limit, self.answer_limit, request)
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()
