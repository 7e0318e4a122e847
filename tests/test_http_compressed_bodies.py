"""Request bodies sent with `Content-Encoding: zstd` or `gzip` (Codex compresses its requests):
read as the JSON they hold, bounded after decompression by the same size limit, and a body that is
not what its header says, or in an encoding KSI does not read, refused before anything is written."""

from __future__ import annotations

import gzip
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import zstandard

from ksi_common.errors import ErrorCode
from tests.conftest import HttpDaemon, running_http_daemon, stub_settings
from tests.stub_openai import StubOpenAI
from tests.test_request_options import stored

LIMIT = 64 * 1024
# mtime=0: the same bytes whenever they are made (pytest-xdist's workers must collect the same ids)
COMPRESS = {"zstd": lambda data: zstandard.ZstdCompressor().compress(data),
            "gzip": lambda data: gzip.compress(data, mtime=0)}


@pytest.fixture
async def http(short_tmp: Path, stub: StubOpenAI) -> AsyncIterator[HttpDaemon]:
    models = {"openai/stub*": {"api_base": stub.api_base, "context_window": 1_000_000}}  # a body near the limit fits
    async with running_http_daemon(short_tmp, **stub_settings(stub, models=models, line_limit=LIMIT)) as running:
        yield running


async def post(http: HttpDaemon, body: bytes, encoding: str) -> httpx.Response:
    headers = {"Authorization": f"Bearer {http.token}", "Content-Type": "application/json",
               "Content-Encoding": encoding}
    async with httpx.AsyncClient(base_url=http.base_url) as api:
        return await api.post("/v1/responses", content=body, headers=headers)


def request(text: str) -> bytes:
    body: dict[str, Any] = {"model": "openai/stub-model", "input": text}
    return orjson.dumps(body)


@pytest.mark.parametrize("encoding", ["zstd", "gzip"])
async def test_a_compressed_body_is_read(http: HttpDaemon, stub: StubOpenAI, encoding: str) -> None:
    reply = await post(http, COMPRESS[encoding](request("hello compressed")), encoding)
    assert reply.status_code == 200, reply.text
    assert reply.json()["output"][0]["content"][0]["text"] == "stub answer to: hello compressed"


@pytest.mark.parametrize("encoding", ["zstd", "gzip"])
async def test_a_body_past_the_limit_once_decompressed_is_refused(
        http: HttpDaemon, stub: StubOpenAI, encoding: str) -> None:
    squeezed = COMPRESS[encoding](request("x" * (LIMIT + 1)))
    assert len(squeezed) < LIMIT // 10  # small on the wire
    reply = await post(http, squeezed, encoding)
    assert reply.status_code == 413
    assert reply.json()["error"]["code"] == ErrorCode.PAYLOAD_TOO_LARGE
    assert stored(http.daemon) == [] and stub.requests == []
    just_fits = COMPRESS[encoding](request("x" * (LIMIT - 100)))
    assert (await post(http, just_fits, encoding)).status_code == 200


@pytest.mark.parametrize(("body", "encoding", "status", "code"), [
    (b"not zstd at all", "zstd", 400, ErrorCode.INVALID_REQUEST),
    (b"not gzip at all", "gzip", 400, ErrorCode.INVALID_REQUEST),
    (gzip.compress(b'{"input": "hi"}', mtime=0)[:-12], "gzip", 400, ErrorCode.INVALID_REQUEST),
    (b'{"input": "hi"}', "br", 415, ErrorCode.UNSUPPORTED_MEDIA_TYPE),
], ids=["not-zstd", "not-gzip", "cut-gzip", "brotli"])
async def test_a_body_that_is_not_what_its_header_says_is_refused(
        http: HttpDaemon, stub: StubOpenAI, body: bytes, encoding: str, status: int, code: str) -> None:
    reply = await post(http, body, encoding)
    assert (reply.status_code, reply.json()["error"]["code"]) == (status, code)
    assert stored(http.daemon) == [] and stub.requests == []
