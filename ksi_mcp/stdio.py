"""MCP messages over this process's stdin and stdout through non-blocking pipes.

The SDK's stdio transport reads and writes through worker threads (a hop per line read, two
per message written); on a busy machine each hop waits for a CPU. Pipes on the event loop need
none. Like the SDK's, it keeps stdout for the protocol: fd 1 points at stderr while serving, so
stray prints cannot corrupt the stream. Anything but pipes (a file, a terminal) gets the SDK's.
"""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import anyio
import mcp_types as types
from mcp.shared.message import SessionMessage

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
        async with inbound_send:
            while line := await reader.readline():
                try:
                    message = types.jsonrpc_message_adapter.validate_json(line, by_name=False)
                except Exception as exc:  # the session answers a malformed line; the stream goes on
                    await inbound_send.send(exc)
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
