"""A fork records the digest of its fork point when it is made, so its first commit continues the
chain of digests without reading its parent's index; on both backends."""

from __future__ import annotations

from typing import Any

import pytest

from ksi_daemon.daemon import Daemon
from tests.conftest import complete, connected
from tests.stored import stored_index, stored_meta

pytestmark = pytest.mark.backends


def document(turns: int) -> dict[str, Any]:
    return {"format": "ksi.conversation", "v": 1, "conversation": {"system": "Be brief."}, "exchanges": [
        {"inputs": [{"type": "user", "content": f"question {i}"}], "reply": {"content": f"answer {i}"}}
        for i in range(turns)]}


async def test_a_forks_first_commit_reads_no_index_of_its_parent(stub_daemon: Daemon) -> None:
    async with connected(stub_daemon) as client:
        await client.request("conversation:import", {"data": document(300), "new_id": "long"})
        stored = await stored_index(stub_daemon, "long")
        store = stub_daemon.cache.store
        read: list[str] = []

        class CountingReads(type(store)):  # type: ignore[misc]
            async def entries(self, conversation_id: str) -> Any:
                read.append(conversation_id)
                return await super().entries(conversation_id)

        store.__class__ = CountingReads
        try:
            # the digest a caller matched at exchange 2 (a client-held history's): the store agrees
            fork = await client.request("conversation:fork", {"conversation_id": "long", "at": 2,
                                                              "digest": stored[1]["digest"]})
            await client.request("conversation:append", {"conversation_id": fork["conversation_id"],
                                                         "exchanges": [{"inputs": ["a new turn"], "reply": "ok"}]})
            assert read == []  # the parent's 300 index lines were never read
            # a digest the store does not name there is not taken: the fork point is read instead
            other = await client.request("conversation:fork", {"conversation_id": "long", "at": 2, "digest": "0" * 64})
        finally:
            store.__class__ = CountingReads.__bases__[0]
        for forked in (fork["conversation_id"], other["conversation_id"]):
            meta = await stored_meta(stub_daemon, forked) or {}
            assert meta["extra"]["fork_digest"] == stored[1]["digest"]
        # the chain goes on as the parent's would: the appended exchange is matched by its history
        result = await complete(client, prompt="next", history=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "question 0"}, {"role": "assistant", "content": "answer 0"},
            {"role": "user", "content": "question 1"}, {"role": "assistant", "content": "answer 1"},
            {"role": "user", "content": "a new turn"}, {"role": "assistant", "content": "ok"}])
        assert (result["conversation_id"], result["exchange"]) == (fork["conversation_id"], 4)
