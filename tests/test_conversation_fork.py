"""conversation:fork: shared history without copying, divergence, forks of forks, bad fork
points and cycles in hand-edited metadata."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ksi_common.errors import KsiError
from ksi_daemon.daemon import Daemon
from tests.conftest import complete, connected, running_daemon, stub_settings
from tests.stored import hand_edit_meta, names, stored_index, stored_meta, stored_snapshot

pytestmark = pytest.mark.backends


def users(messages: list[dict[str, Any]]) -> list[str]:
    return [m["content"] for m in messages if m["role"] == "user"]


async def four_exchanges(client: Any, conversation_id: str = "base") -> list[dict[str, Any]]:
    results = [await complete(client, prompt="p1", conversation_id=conversation_id, create=True)]
    for i in range(2, 5):
        results.append(await complete(client, prompt=f"p{i}", conversation_id=conversation_id))
    return results


async def test_fork_shares_history_up_to_its_point_and_then_diverges(stub_daemon: Daemon, stub: Any) -> None:
    async with connected(stub_daemon) as client:
        await four_exchanges(client)
        before = await stored_snapshot(stub_daemon.settings)
        fork = await client.request("conversation:fork", {"conversation_id": "base", "at": 2, "new_id": "f1"})
        assert fork["conversation_id"] == "f1" and fork["parent_id"] == "base" and fork["fork_at"] == 2
        # nothing was copied: no new response file, no index for the fork yet
        after = await stored_snapshot(stub_daemon.settings)
        assert names(after, "logs/responses/") == names(before, "logs/responses/")
        assert "logs/conversations/f1.jsonl" not in after
        meta = await stored_meta(stub_daemon, "f1") or {}
        assert (meta["parent_id"], meta["fork_at"]) == ("base", 2)

        in_fork = await complete(client, prompt="fork says", conversation_id="f1")
        assert users(stub.messages()) == ["p1", "p2", "fork says"]
        assert in_fork["exchange"] == 3  # a fork's own exchanges are numbered after its fork point
        await complete(client, prompt="parent goes on", conversation_id="base")
        assert users(stub.messages()) == ["p1", "p2", "p3", "p4", "parent goes on"]
        await complete(client, prompt="fork again", conversation_id="f1")
        assert users(stub.messages()) == ["p1", "p2", "fork says", "fork again"]

        # a fork of the fork (default: at its last exchange) and one inside the inherited part
        f2 = await client.request("conversation:fork", {"conversation_id": "f1"})
        assert f2["fork_at"] == 4
        await complete(client, prompt="grandchild", conversation_id=f2["conversation_id"])
        assert users(stub.messages()) == ["p1", "p2", "fork says", "fork again", "grandchild"]
        f3 = await client.request("conversation:fork", {"conversation_id": "f1", "at": 1, "new_id": "f3"})
        assert f3["fork_at"] == 1
        await complete(client, prompt="only one before me", conversation_id="f3")
        assert users(stub.messages()) == ["p1", "only one before me"]

        shown = await client.request("conversation:show", {"conversation_id": f2["conversation_id"]})
        assert [(x["n"], x["inherited"], x["conversation_id"]) for x in shown["exchanges"]] == [
            (1, True, "base"), (2, True, "base"), (3, True, "f1"), (4, True, "f1"),
            (5, False, f2["conversation_id"])]
        own_only = await client.request("conversation:show", {"conversation_id": "f1", "inherited": False})
        assert [x["n"] for x in own_only["exchanges"]] == [3, 4]

    # the parent keeps its own exchanges, untouched by the forks
    assert [line["n"] for line in await stored_index(stub_daemon, "base")] == [1, 2, 3, 4, 5]
    assert [line["n"] for line in await stored_index(stub_daemon, "f1")] == [3, 4]


async def test_bad_fork_points_and_ids_are_refused(stub_daemon: Daemon, stub: Any) -> None:
    async with connected(stub_daemon) as client:
        await complete(client, prompt="p1", conversation_id="two", create=True)
        await complete(client, prompt="p2", conversation_id="two")
        for at in (3, -1, 100):
            with pytest.raises(KsiError) as caught:
                await client.request("conversation:fork", {"conversation_id": "two", "at": at})
            assert caught.value.code == "validation_error"
            assert "at" in caught.value.details["fields"]
        with pytest.raises(KsiError) as caught:
            await client.request("conversation:fork", {"conversation_id": "nope"})
        assert caught.value.code == "conversation_not_found"
        with pytest.raises(KsiError) as caught:
            await client.request("conversation:fork", {"conversation_id": "two", "new_id": "two"})
        assert caught.value.code == "conversation_exists"
        with pytest.raises(KsiError) as caught:
            await client.request("conversation:fork", {"conversation_id": "two", "new_id": "../evil"})
        assert caught.value.code == "validation_error"
        at_zero = await client.request("conversation:fork", {"conversation_id": "two", "at": 0})
        await complete(client, prompt="fresh", conversation_id=at_zero["conversation_id"])
        assert users(stub.messages()) == ["fresh"]
    # nothing was written for the refused forks
    metas = names(await stored_snapshot(stub_daemon.settings), "state/conversations/")
    assert metas == {"two.json", f"{at_zero['conversation_id']}.json"}


async def test_a_cycle_in_hand_edited_metadata_is_fork_cycle(short_tmp: Path, stub: Any,
                                                             backend: dict[str, Any]) -> None:
    settings = stub_settings(stub, **backend)
    async with running_daemon(short_tmp, **settings) as daemon, connected(daemon) as client:
        await complete(client, prompt="a1", conversation_id="a", create=True)
        await client.request("conversation:fork", {"conversation_id": "a", "new_id": "b"})
        await complete(client, prompt="b1", conversation_id="b")
    # by hand, with the daemon stopped: a's parent is b, b's parent is a
    await hand_edit_meta(daemon.settings, "a", parent_id="b", fork_at=1)
    index_before = {k: v for k, v in (await stored_snapshot(daemon.settings)).items()
                    if k.startswith("logs/conversations/")}
    calls = len(stub.requests)

    async with running_daemon(short_tmp, **settings) as daemon, connected(daemon) as client:
        for conversation_id in ("a", "b"):
            # at the ack when the open tool calls are looked up along the chain, else when the turn runs
            with pytest.raises(KsiError) as caught:
                ack = await client.request("completion:async", {"prompt": "loop?", "conversation_id": conversation_id})
                await client.request("completion:wait", {"request_id": ack["request_id"], "timeout": 30})
            assert caught.value.code == "fork_cycle"
            for event in ("conversation:show", "conversation:stats", "conversation:fork"):
                with pytest.raises(KsiError) as caught:
                    await client.request(event, {"conversation_id": conversation_id})
                assert caught.value.code == "fork_cycle"
    assert len(stub.requests) == calls  # no provider call
    assert {k: v for k, v in (await stored_snapshot(daemon.settings)).items()
            if k.startswith("logs/conversations/")} == index_before


async def test_a_chain_deeper_than_the_limit_is_fork_cycle(short_tmp: Path, stub: Any,
                                                            backend: dict[str, Any]) -> None:
    async with running_daemon(short_tmp, max_fork_depth=2, **stub_settings(stub, **backend)) as daemon, \
            connected(daemon) as client:
        await complete(client, prompt="root", conversation_id="r", create=True)
        parent = "r"
        for i in range(3):
            parent = (await client.request("conversation:fork", {"conversation_id": parent}))["conversation_id"]
            if i < 1:
                await complete(client, prompt=f"level {i}", conversation_id=parent)
        with pytest.raises(KsiError) as caught:  # at the ack, before anything is queued
            await client.request("completion:async", {"prompt": "deep", "conversation_id": parent})
        assert caught.value.code == "fork_cycle"
