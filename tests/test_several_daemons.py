"""Several daemons, one PostgreSQL database: any daemon continues any conversation with its whole
history, order holds across daemons, agents and events cross over, and a daemon killed in a burst
loses nothing it acknowledged."""

from __future__ import annotations

import asyncio
import os
import signal
from collections import deque
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

from ksi_common.client import KsiClient
from ksi_common.dburl import mask_url
from ksi_common.errors import KsiError
from ksi_common.layout import VarLayout
from ksi_common.reading import open_reader
from ksi_daemon.daemon import Daemon
from tests import test_compaction as compaction
from tests.conftest import complete, connected, running_daemon, stub_settings
from tests.stub_openai import Reply
from tests.test_crash import DaemonProcess, daemon_env


@asynccontextmanager
async def two_daemons(root: Path, url: str, stub: Any, **overrides: Any) -> AsyncIterator[tuple[Daemon, Daemon]]:
    settings = {**stub_settings(stub), "storage": "postgres", "database_url": url, **overrides}
    async with AsyncExitStack() as stack:
        daemons = []
        for name in ("a", "b"):
            (root / name).mkdir()
            daemons.append(await stack.enter_async_context(running_daemon(root / name, **settings)))
        yield daemons[0], daemons[1]


def chat(messages: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(m["role"], m["content"]) for m in messages]


async def test_twenty_turns_alternating_between_two_daemons_see_every_earlier_exchange(
        short_tmp: Path, pg_url: str, stub: Any) -> None:
    async with two_daemons(short_tmp, pg_url, stub) as (a, b), connected(a) as on_a, connected(b) as on_b:
        for turn in range(1, 21):
            client = on_a if turn % 2 else on_b
            result = await complete(client, prompt=f"turn {turn}", conversation_id="shared", create=turn == 1)
            assert result["exchange"] == turn
            expected: list[tuple[str, str]] = []
            for earlier in range(1, turn):
                expected += [("user", f"turn {earlier}"), ("assistant", f"stub answer to: turn {earlier}")]
            assert chat(stub.messages()) == [*expected, ("user", f"turn {turn}")]
        stored = await a.storage.conversations.entries("shared")
        assert [e.n for e in stored] == list(range(1, 21))
        shown = await on_b.request("conversation:show", {"conversation_id": "shared"})
        assert shown["conversation"]["exchanges"] == 20


async def test_a_metadata_change_on_one_daemon_survives_a_turn_on_the_other(short_tmp: Path, pg_url: str,
                                                                           stub: Any) -> None:
    async with two_daemons(short_tmp, pg_url, stub) as (a, b), connected(a) as on_a, connected(b) as on_b:
        await complete(on_a, prompt="one", conversation_id="meta", create=True)
        await complete(on_a, prompt="two", conversation_id="meta")  # A holds the conversation in memory
        await on_b.request("conversation:update", {"conversation_id": "meta", "title": "Named on B",
                                                   "tags": ["b"]})
        third = await complete(on_a, prompt="three", conversation_id="meta")
        assert third["exchange"] == 3
        for client in (on_a, on_b):
            shown = (await client.request("conversation:show", {"conversation_id": "meta"}))["conversation"]
            assert (shown["title"], shown["tags"], shown["exchanges"]) == ("Named on B", ["b"], 3)


async def test_a_summary_due_on_one_daemon_is_not_written_over_a_conversation_replaced_on_the_other(
        short_tmp: Path, pg_url: str, stub: Any) -> None:
    """A compactor decides on the conversation as its daemon holds it (no query per turn); one that
    is about to summarise asks the database first, so it never summarises exchanges another daemon
    has since deleted into a conversation that now has the same id."""
    stub.answer = compaction.answering(compaction.good)
    stub.model_script[compaction.WRITER_AT_STUB] = deque([Reply(status=500)])  # A's first summary fails
    shared = {"storage": "postgres", "database_url": pg_url, "summary_retry_delay": 600, "summary_retry_max_delay": 600}
    (short_tmp / "a").mkdir()
    (short_tmp / "b").mkdir()
    async with running_daemon(short_tmp / "a", **compaction.settings(stub, summariser=compaction.WRITER, **shared)) as a, \
            running_daemon(short_tmp / "b", **compaction.settings(stub, summariser="off", **shared)) as b, \
            connected(b) as on_b:
        await compaction.grow(a, "long", range(1, 13))
        assert len(compaction.summariser_calls(stub)) == 1  # due, refused, its retry far off
        assert await a.storage.summaries.read("long") == []
        await on_b.request("conversation:delete", {"conversation_id": "long"})
        await complete(on_b, model=compaction.SMALL, prompt="a new start", conversation_id="long", create=True)

        assert await a.completion.compactor.extend("long", compaction.SMALL) is None
        assert len(compaction.summariser_calls(stub)) == 1
        assert await a.storage.summaries.read("long") == []
        after = await complete(on_b, model=compaction.SMALL, prompt="and on", conversation_id="long")
        assert after["exchange"] == 2 and "summary_upto" not in after["history"]


async def test_eight_clients_on_two_daemons_append_to_one_conversation_without_gap_loss_or_duplicate(
        short_tmp: Path, pg_url: str, stub: Any) -> None:
    stub.hold = 0.003
    clients, turns = 8, 4
    async with two_daemons(short_tmp, pg_url, stub, summariser="off") as daemons:  # every stub call is a turn
        async def one_client(i: int) -> list[dict[str, Any]]:
            async with KsiClient(daemons[i % 2].settings.socket) as client:
                return [await complete(client, prompt=f"c{i} t{t}", conversation_id="busy", create=True)
                        for t in range(turns)]

        results = [r for rs in await asyncio.gather(*(one_client(i) for i in range(clients))) for r in rs]
        entries = await daemons[0].storage.conversations.entries("busy")
        assert [e.n for e in entries] == list(range(1, clients * turns + 1))
        assert sorted(e.response_id for e in entries) == sorted(r["response_id"] for r in results)
        assert sorted(r["exchange"] for r in results) == list(range(1, clients * turns + 1))
        records = await daemons[1].storage.responses.read_many([e.response_id for e in entries])
        inputs = [record.inputs[0]["content"] for record in records if record is not None]
        assert sorted(inputs) == sorted(f"c{i} t{t}" for i in range(clients) for t in range(turns))
        for i in range(clients):  # one client's turns keep their order in the conversation
            mine = [n for n, text in enumerate(inputs) if text.startswith(f"c{i} ")]
            assert [inputs[n] for n in mine] == [f"c{i} t{t}" for t in range(turns)]
        # each model call saw a prefix of the conversation as it is numbered: exchanges 1..k in order
        # (k < n: a turn prepared while the other daemon's was being answered is appended after it)
        numbered = [("user", text) for text in inputs]
        for request in stub.requests:
            sent = chat(request["messages"])
            history, new = sent[:-1], sent[-1]
            users = [m for m in history if m[0] == "user"]
            assert users == numbered[:len(users)], (new, users)
            assert new in numbered[len(users):]


async def test_agents_and_events_cross_from_one_daemon_to_the_other(short_tmp: Path, pg_url: str, stub: Any) -> None:
    async with two_daemons(short_tmp, pg_url, stub) as (a, b), connected(a) as on_a, connected(b) as on_b:
        await on_b.request("monitor:subscribe", {"patterns": ["completion:*"]})
        spawned = await on_a.request("agent:spawn", {"agent_id": "helper", "system": "Be brief."})
        assert spawned["agent_id"] == "helper"
        reply = await on_b.request("agent:send_message", {"agent_id": "helper", "message": "hello", "wait": 30})
        assert reply["content"] == "stub answer to: hello"
        assert stub.messages()[0] == {"role": "system", "content": "Be brief."}
        # a completion on A is pushed to B's subscriber (and B's own is pushed once, not twice)
        result = await complete(on_a, prompt="from a", conversation_id="helper")
        pushed: list[dict[str, Any]] = []
        async for frame in on_b.pushes():
            if frame["event"] == "completion:result":
                pushed.append(frame)
            if any(f["data"]["response_id"] == result["response_id"] for f in pushed):
                break
        assert [f["data"]["response_id"] for f in pushed] == [reply["response_id"], result["response_id"]]
        assert pushed[1]["data"]["content"] == "stub answer to: from a"
        assert pushed[1]["data"]["history"]["exchanges_sent"] == 1  # B's exchange, seen on A
        # each daemon's health names its backend, the masked database, itself and what crossed over
        on_b_storage = (await on_b.request("system:health"))["storage"]
        # A counts a publication when its NOTIFY returns, which may come after B got the event
        for _ in range(100):
            on_a_storage = (await on_a.request("system:health"))["storage"]
            if on_a_storage["events_published"]:
                break
            await asyncio.sleep(0.05)
        assert on_a_storage["backend"] == on_b_storage["backend"] == "postgres"
        assert on_a_storage["url"] == on_b_storage["url"] == mask_url(pg_url) != pg_url
        assert on_a_storage["daemon_id"] != on_b_storage["daemon_id"]
        assert on_a_storage["events_published"] >= 1 and on_b_storage["events_received"] >= 1
        assert on_a_storage["database_calls"] > 0 and on_b_storage["database_calls"] > 0


async def test_a_daemon_killed_in_a_burst_loses_nothing_it_acknowledged(short_tmp: Path, pg_url: str,
                                                                        stub: Any) -> None:
    """Two subprocess daemons on one database; A is killed with SIGKILL while both serve a burst."""
    stub.hold = 0.02
    env = daemon_env(stub.api_base, KSI_STORAGE="postgres", KSI_DATABASE_URL=pg_url)
    processes = [DaemonProcess(short_tmp / name, env) for name in ("a", "b")]
    for process in processes:
        process.root.mkdir()
    await asyncio.gather(*(p.start() for p in processes))
    a, b = processes
    acknowledged: list[dict[str, Any]] = []
    try:
        async def burst(process: DaemonProcess, i: int, count: int) -> list[str]:
            """Queue `count` turns; return the request ids whose ack came back."""
            ids = []
            try:
                async with KsiClient(process.socket) as client:
                    for t in range(count):
                        ack = await client.request("completion:async", {
                            "prompt": f"{process.root.name}{i} t{t}", "conversation_id": f"burst-{i % 3}",
                            "create": True})
                        ids.append(ack["request_id"])
                    for request_id in ids:
                        acknowledged.append(await client.request("completion:wait",
                                                                 {"request_id": request_id, "timeout": 60}))
            except (KsiError, OSError, ConnectionError, asyncio.IncompleteReadError):
                pass  # the daemon was killed under this client
            return ids

        tasks = [asyncio.ensure_future(burst(p, i, 10)) for i, p in enumerate([a, b] * 3)]
        while len(acknowledged) < 6:
            await asyncio.sleep(0.01)
        assert a.process is not None
        os.kill(a.process.pid, signal.SIGKILL)
        a.process.wait()
        submitted = await asyncio.gather(*tasks)
        on_b = [ids for i, ids in enumerate(submitted) if i % 2 == 1]
        # B went on serving every request it took
        b_results = [r for r in acknowledged if r["request_id"] in {x for ids in on_b for x in ids}]
        assert len(b_results) == sum(len(ids) for ids in on_b) == 30
        # A comes back; what it had accepted is held by the pool, so it is run again (by A or B) and
        # answered, or, when its exchange was committed before the kill, rebuilt from storage
        await a.start(litellm=False)  # recovery needs no model
        on_a = [x for i, ids in enumerate(submitted) if i % 2 == 0 for x in ids]
        answered = {r["request_id"] for r in acknowledged}
        async with KsiClient(a.socket) as client:
            for request_id in on_a:
                if request_id in answered:
                    continue
                outcome = await client.request("completion:wait", {"request_id": request_id, "timeout": 60})
                assert outcome["request_id"] == request_id and outcome.get("response_id"), outcome
                acknowledged.append(outcome)
        # every acknowledged exchange is in its conversation, once, numbered without a gap
        reader = open_reader("postgres", VarLayout(a.var), pg_url)
        try:
            stored: dict[str, int] = {}
            for i in range(3):
                entries = await reader.entries(f"burst-{i}")
                assert [e.n for e in entries] == list(range(1, len(entries) + 1))
                for e in entries:
                    assert e.response_id not in stored
                    stored[e.response_id] = e.n
        finally:
            await reader.aclose()
        lost = [r for r in acknowledged if r["response_id"] not in stored]
        assert lost == []
    finally:
        for process in processes:
            await process.stop()
