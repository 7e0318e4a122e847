"""Exchange numbers past any conversation (10**20, beyond what a database integer holds) sent
through MCP's `conversation` pins and `fork`, and through the events themselves: each is a
`validation_error` naming the field, nothing changes, and the daemon goes on serving. Both
storage backends."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from ksi_common.errors import KsiError
from ksi_daemon.context import EventContext
from tests.conftest import HttpDaemon, complete, connected, running_http_daemon
from tests.test_cli_ask import where
from tests.test_mcp_stdio import call, mcp_session, refused

pytestmark = pytest.mark.backends

HUGE = 10**20


@pytest.fixture
async def http(short_tmp: Path, backend: dict[str, Any]) -> AsyncIterator[HttpDaemon]:
    async with running_http_daemon(short_tmp, default_model="echo/x", **backend) as running:
        yield running


async def test_huge_exchange_numbers_are_validation_errors(http: HttpDaemon) -> None:
    async with connected(http.daemon) as client:
        await complete(client, prompt="one", conversation_id="big", create=True)
        await client.request("conversation:pin", {"conversation_id": "big", "n": [1]})
        for event, data in (("conversation:pin", {"n": [HUGE]}), ("conversation:unpin", {"n": [HUGE]}),
                            ("conversation:pin", {"n": [-HUGE]}), ("conversation:fork", {"at": HUGE})):
            with pytest.raises(KsiError) as refused_event:  # in-process: the socket's JSON holds 64 bits
                await http.daemon.router.request(event, {"conversation_id": "big", **data}, EventContext.root())
            assert refused_event.value.code == "validation_error", (event, refused_event.value)
        headers = {"Authorization": f"Bearer {http.token}"}
        async with httpx2.AsyncClient(headers=headers, timeout=30) as http2, \
                Client(streamable_http_client(f"{http.base_url}/mcp", http_client=http2)) as mcp:
            await refused(mcp, "validation_error", "conversation", continuation_id="big", pin=[HUGE])
            await refused(mcp, "validation_error", "conversation", continuation_id="big", unpin=[HUGE])
            await refused(mcp, "validation_error", "fork", continuation_id="big", at=HUGE)
            shown = await call(mcp, "conversation", continuation_id="big")
            assert shown["exchanges"] == 1
        # `ksi mcp` over stdio calls the daemon through its socket, whose JSON holds 64 bits
        root = http.daemon.settings.var_dir.parent
        async with mcp_session(root, *where(root)) as mcp:
            await refused(mcp, "validation_error", "conversation", continuation_id="big", pin=[HUGE])
            await refused(mcp, "validation_error", "conversation", continuation_id="big", unpin=[HUGE])
            await refused(mcp, "validation_error", "fork", continuation_id="big", at=HUGE)
        shown = await client.request("conversation:show", {"conversation_id": "big"})
        assert shown["conversation"]["pins"] == [1]
        listed = await client.request("conversation:list", {})
        assert [c["conversation_id"] for c in listed["conversations"]] == ["big"]  # no fork was made
