"""A request body trickled a byte at a time, by a client holding the token: once its head has come,
the whole body must arrive within `http_body_timeout`, or the connection is answered 408
`timeout` and closed (a byte now and then no longer keeps it, and a descriptor, forever). A body
sent whole on the next connection is served."""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson

from tests.conftest import HTTP_TOKEN, running_http_daemon
from tests.test_connection_budget import everything_until_closed, http_connection, parse_response

BODY = orjson.dumps({"model": "echo/x", "messages": [{"role": "user", "content": "slowly " * 20}]})


def head(length: int) -> bytes:
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + HTTP_TOKEN.encode() + b"\r\nContent-Length: "
            + str(length).encode() + b"\r\n\r\n")


async def test_a_body_trickled_past_the_timeout_is_answered_408_and_closed(short_tmp: Path) -> None:
    async with running_http_daemon(short_tmp, http_body_timeout=1.0, http_head_timeout=600,
                                   default_model="echo/x") as http:
        reader, writer = await http_connection(http.base_url)
        writer.write(head(len(BODY)))

        async def trickle() -> None:
            for byte in BODY[:-1]:  # never the last byte: the body never completes
                if writer.is_closing():
                    return
                writer.write(bytes([byte]))
                await asyncio.sleep(0.2)

        feeding = asyncio.create_task(trickle())
        try:
            ending = await everything_until_closed(reader, wait=60.0)  # a safety net, not a timing check
            trickled_all = feeding.done()
        finally:
            feeding.cancel()
            writer.close()
        status, _headers, body = parse_response(ending)
        assert status == 408 and body["error"]["code"] == "timeout", ending
        assert not trickled_all  # ended by the daemon while the client was still trickling
        # the daemon goes on serving, a body sent whole included
        reader, writer = await http_connection(http.base_url)
        writer.write(head(len(BODY)).replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n") + BODY)
        status, _headers, body = parse_response(await everything_until_closed(reader))
        writer.close()
        assert status == 200 and body["choices"][0]["message"]["content"]
        while http.daemon.connection_budget.held:
            await asyncio.sleep(0.01)
