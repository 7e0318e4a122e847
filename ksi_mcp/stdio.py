"""MCP messages over this process's stdin and stdout through non-blocking pipes.

The SDK's stdio transport reads and writes through worker threads (a hop per line read, two
per message written); on a busy machine each hop waits for a CPU. Pipes on the event loop need
none. Like the SDK's, it keeps stdout for the protocol: fd 1 points at stderr while serving, so
stray prints cannot corrupt the stream. Anything but pipes (a file, a terminal) gets the SDK's.

A line that is not JSON is answered with JSON-RPC's parse error, one that is not a JSON-RPC
message with an invalid request, and one over the line limit is skipped and answered so too; the
server reads on after each of them.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import anyio
import mcp_types as types
from mcp.shared.message import SessionMessage
from pydantic import ValidationError

from ksi_common.errors import ErrorCode

LINE_LIMIT = 64 * 1024 * 1024


def _is_pipe(fd: int) -> bool:
    mode = os.fstat(fd).st_mode
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)


def stdio_transport() -> AbstractAsyncContextManager[tuple[Any, Any]]:
    """(read stream, write stream) of MCP messages on stdin/stdout."""
    if _is_pipe(0) and _is_pipe(1):
        return _pipes()
    from mcp.server.stdio import stdio_server

    return stdio_server()


@asynccontextmanager
async def _pipes() -> AsyncIterator[tuple[Any, Any]]:
    loop = asyncio.get_running_loop()
    in_fd, out_fd = os.dup(0), os.dup(1)
    saved_stdin, saved_stdout = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # children and stray reads see end of file
    os.dup2(2, 1)  # stray prints go to stderr
    os.close(null)
    reader = asyncio.StreamReader(limit=LINE_LIMIT)
    read_transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader),
                                                     os.fdopen(in_fd, "rb", buffering=0))
    write_transport, write_protocol = await loop.connect_write_pipe(
        asyncio.streams.FlowControlMixin, os.fdopen(out_fd, "wb", buffering=0))
    writer = asyncio.StreamWriter(write_transport, write_protocol, None, loop)
    inbound_send, inbound = anyio.create_memory_object_stream[SessionMessage | Exception](0)
    outbound, outbound_receive = anyio.create_memory_object_stream[SessionMessage](0)

    async def read_lines() -> None:
        async with inbound_send, outbound.clone() as replies:
            while (line := await _read_line(reader)) != b"":
                if line is None:
                    await replies.send(_refusal(None, types.INVALID_REQUEST,
                                                f"{ErrorCode.PAYLOAD_TOO_LARGE}: a line over {LINE_LIMIT} bytes",
                                                {"code": ErrorCode.PAYLOAD_TOO_LARGE, "limit": LINE_LIMIT}))
                    continue
                if not line.strip():
                    continue
                try:
                    message = types.jsonrpc_message_adapter.validate_json(line, by_name=False)
                except ValidationError:
                    await replies.send(_refusal_of(line))
                    continue
                await inbound_send.send(SessionMessage(message))

    async def write_messages() -> None:
        async with outbound_receive:
            async for session_message in outbound_receive:
                data = session_message.message.model_dump_json(by_alias=True, exclude_unset=True)
                writer.write(data.encode() + b"\n")
                await writer.drain()

    try:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(read_lines)
            tasks.start_soon(write_messages)
            yield inbound, outbound
            tasks.cancel_scope.cancel()
    finally:
        read_transport.close()
        write_transport.close()
        os.dup2(saved_stdin, 0)
        os.dup2(saved_stdout, 1)
        os.close(saved_stdin)
        os.close(saved_stdout)


async def _read_line(reader: asyncio.StreamReader) -> bytes | None:
    """The next line (b"" at the end of input), or None for a line over the reader's limit,
    which is read past without being kept."""
    try:
        return await reader.readuntil(b"\n")
    except asyncio.IncompleteReadError as end:
        return end.partial  # the last line had no newline
    except asyncio.LimitOverrunError as over:
        skip = over.consumed
    while True:
        try:
            await reader.readexactly(skip)
            await reader.readuntil(b"\n")
            return None
        except asyncio.IncompleteReadError:
            return None  # the input ended inside the long line
        except asyncio.LimitOverrunError as more:
            skip = more.consumed


def _refusal_of(line: bytes) -> SessionMessage:
    """The answer to a line that is no JSON-RPC message: a parse error, or an invalid request."""
    try:
        decoded = json.loads(line)
    except (ValueError, RecursionError):  # also bad UTF-8, huge numbers, deep nesting
        return _refusal(None, types.PARSE_ERROR, "Parse error: the line is not JSON")
    return _refusal(_id_of(decoded), types.INVALID_REQUEST, "Invalid Request: not a JSON-RPC 2.0 message")


def _id_of(decoded: Any) -> types.RequestId | None:
    """The id of a malformed request, when it has a usable one, so the client can match the error."""
    if isinstance(decoded, dict):
        request_id = decoded.get("id")
        if isinstance(request_id, str | int) and not isinstance(request_id, bool):
            return request_id
    return None


def _refusal(request_id: types.RequestId | None, code: int, message: str,
             data: dict[str, Any] | None = None) -> SessionMessage:
    error = types.ErrorData(code=code, message=message, data=data)
    return SessionMessage(types.JSONRPCError(jsonrpc="2.0", id=request_id, error=error))
