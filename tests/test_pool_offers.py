"""A turn offered to the pool (three or two daemon processes on one database): cancelled while
offered, it is taken back before the cancel is answered; taken over, it is no longer offered; claimed
by another daemon, it is sent to the model with the images admission took out of its files."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
from pathlib import Path
from typing import Any

import asyncpg

from ksi_common.client import KsiClient
from tests.image_bytes import png
from tests.test_pool_order import daemon_processes, user_turns

BUSY = "openai/stub-busy"


async def request_row(url: str, request_id: str) -> dict[str, Any] | None:
    connection = await asyncpg.connect(url)
    try:
        row = await connection.fetchrow("SELECT daemon_id, status, offered, finished, taken_from FROM ksi_requests "
                                        "WHERE request_id = $1", request_id)
        return dict(row) if row is not None else None
    finally:
        await connection.close()


async def until_row(url: str, request_id: str, wanted: Any) -> dict[str, Any]:
    """The request's row once `wanted(row)` holds (60 s at most)."""
    for _ in range(600):
        row = await request_row(url, request_id)
        if row is not None and wanted(row):
            return row
        await asyncio.sleep(0.1)
    raise AssertionError(f"{request_id}: {row}")


async def busy(client: KsiClient, name: str) -> dict[str, Any]:
    """A slow call holding the daemon's one slot."""
    return await client.request("completion:async", {"prompt": f"busy {name}", "conversation_id": f"busy-{name}",
                                                     "create": True, "model": BUSY})


async def test_a_turn_cancelled_while_offered_is_taken_back_before_the_cancel_is_answered_and_never_run(
        short_tmp: Path, pg_url: str, stub: Any) -> None:
    stub.model_delay["stub-busy"] = 4.0
    async with daemon_processes(short_tmp, pg_url, stub, KSI_MAX_CONCURRENCY="1") as daemons:
        clients = [await KsiClient(d.socket).__aenter__() for d in daemons]
        try:
            busies = [await busy(client, name) for client, name in zip(clients, "abc", strict=True)]
            while len(stub.requests) < 3:  # every daemon's one slot is held
                await asyncio.sleep(0.02)
            on_a = clients[0]
            ack = await on_a.request("completion:async", {"prompt": "offered", "conversation_id": "o",
                                                          "create": True})
            await until_row(pg_url, ack["request_id"], lambda r: r["offered"])
            answer = await on_a.request("completion:cancel", {"request_id": ack["request_id"]})
            # answered once the offer was taken back: no other daemon can claim it from here on
            row = await request_row(pg_url, ack["request_id"])
            for client, started in zip(clients, busies, strict=True):
                await client.request("completion:wait", {"request_id": started["request_id"], "timeout": 60})
            ended = await until_row(pg_url, ack["request_id"], lambda r: r["finished"] is not None)
        finally:
            for client in clients:
                await client.__aexit__(None, None, None)
    assert (answer["cancelled"], answer["status"]) == (True, "cancelled")
    assert row is not None and row["offered"] is False, row
    assert (ended["status"], ended["daemon_id"], ended["taken_from"]) == ("cancelled", row["daemon_id"], None)
    assert not [r for r in stub.requests if user_turns(r["messages"])[-1:] == ["offered"]]  # never run


async def test_a_turn_taken_over_from_a_silent_daemon_is_no_longer_offered(
        short_tmp: Path, pg_url: str, stub: Any) -> None:
    stub.model_delay["stub-busy"] = 8.0
    # stopped with the busy calls still running: cancelled after a second, not waited for
    async with daemon_processes(short_tmp, pg_url, stub, names="ab", KSI_MAX_CONCURRENCY="1",
                                KSI_SHUTDOWN_TIMEOUT="1") as (a, b), \
            KsiClient(a.socket) as on_a, KsiClient(b.socket) as on_b:
        await busy(on_a, "a")
        await busy(on_b, "b")
        while len(stub.requests) < 2:
            await asyncio.sleep(0.02)
        ack = await on_a.request("completion:async", {"prompt": "offered", "conversation_id": "o", "create": True})
        await until_row(pg_url, ack["request_id"], lambda r: r["offered"])
        assert a.process is not None
        os.kill(a.process.pid, signal.SIGSTOP)
        try:
            row = await until_row(pg_url, ack["request_id"], lambda r: r["taken_from"] is not None)
        finally:
            os.kill(a.process.pid, signal.SIGCONT)
    # a third daemon with a free slot could otherwise claim it from B and call the model for it again
    assert (row["offered"], row["taken_from"], row["finished"]) == (False, row["taken_from"], None), row
    assert row["daemon_id"] != row["taken_from"]


async def test_a_turn_with_an_image_file_claimed_by_another_daemon_is_sent_with_its_image(
        short_tmp: Path, pg_url: str, stub: Any) -> None:
    stub.answer = lambda _messages: "a chart"  # the default answer would echo the image back
    stub.model_delay["stub-busy"] = 3.0
    allowed = short_tmp / "allowed"
    allowed.mkdir()
    image = png(64, 64)
    chart = allowed / "chart.png"
    chart.write_bytes(image)
    models = json.dumps({"openai/stub*": {"api_base": stub.api_base, "supports_vision": True}})
    async with daemon_processes(short_tmp, pg_url, stub, names="ab", KSI_MAX_CONCURRENCY="1", KSI_MODELS=models,
                                KSI_ALLOWED_FILE_ROOTS=str(allowed)) as (a, b), \
            KsiClient(a.socket) as on_a, KsiClient(b.socket) as on_b:
        held = await busy(on_a, "a")
        while not stub.requests:  # A's one slot is held: the turn is offered and B claims it
            await asyncio.sleep(0.02)
        ack = await on_a.request("completion:async", {"prompt": "what is in it?", "files": [str(chart)],
                                                      "conversation_id": "pic", "create": True})
        result = await on_a.request("completion:wait", {"request_id": ack["request_id"], "timeout": 60})
        health = await on_b.request("system:health", {})
        await on_a.request("completion:wait", {"request_id": held["request_id"], "timeout": 60})
    assert result["content"] == "a chart"
    assert health["storage"]["requests_stolen"] == 1
    sent = [r["messages"][-1] for r in stub.requests if r["model"] != "stub-busy"]
    assert len(sent) == 1
    text, picture = sent[0]["content"]
    assert text["type"] == "text" and text["text"].endswith("what is in it?")
    url = f"data:image/png;base64,{base64.b64encode(image).decode()}"
    assert picture == {"type": "image_url", "image_url": {"url": url}}


async def test_a_claimed_turn_that_cannot_be_queued_is_ended_failed_and_leaves_its_line(
        short_tmp: Path, pg_url: str, stub: Any) -> None:
    async with daemon_processes(short_tmp, pg_url, stub, names="ab") as (a, _b), KsiClient(a.socket) as on_a:
        await on_a.request("system:health", {})
        # as a live daemon offering a turn of a conversation deleted since: its claimer cannot queue it
        record = {"v": 1, "request_id": "req-lost", "conversation_id": "deleted", "model": "openai/stub-model",
                  "response_id": "resp-lost", "request": {"prompt": "lost"}, "context": {}}
        connection = await asyncpg.connect(pg_url)
        try:
            async with connection.transaction():
                await connection.execute(
                    "INSERT INTO ksi_daemons (daemon_id, host, pid, version, started, heartbeat) "
                    "VALUES ('far-daemon', 'far', 1, 'x', now(), now() + interval '1 hour')")
                await connection.execute("INSERT INTO ksi_turn_line (conversation_id, request_id, daemon_id) "
                                         "VALUES ('deleted', 'req-lost', 'far-daemon')")
                await connection.execute(
                    "INSERT INTO ksi_requests (request_id, conversation_id, daemon_id, status, response_id, record, "
                    "offered) VALUES ('req-lost', 'deleted', 'far-daemon', 'queued', 'resp-lost', $1, true)",
                    json.dumps(record))
                await connection.execute("SELECT pg_notify('ksi_work', 'offered ')")
        finally:
            await connection.close()
        row = await until_row(pg_url, "req-lost", lambda r: r["finished"] is not None)
        connection = await asyncpg.connect(pg_url)
        try:
            line = await connection.fetch("SELECT * FROM ksi_turn_line WHERE request_id = 'req-lost'")
            code = await connection.fetchval("SELECT code FROM ksi_requests WHERE request_id = 'req-lost'")
        finally:
            await connection.close()
    assert (row["status"], code, row["taken_from"]) == ("failed", "conversation_not_found", "far-daemon"), row
    assert line == []
    assert not stub.requests


async def test_a_daemon_claims_no_turn_of_a_model_whose_slots_it_has_all_taken(
        short_tmp: Path, pg_url: str, stub: Any) -> None:
    stub.model_delay["stub-busy"] = 3.0
    stub.model_delay["stub-slow"] = 3.0
    models = json.dumps({"openai/stub-busy": {"api_base": stub.api_base, "max_concurrency": 1},
                         "openai/stub*": {"api_base": stub.api_base}})
    async with daemon_processes(short_tmp, pg_url, stub, names="ab", KSI_MODELS=models,
                                KSI_MAX_CONCURRENCY="4") as (a, b), \
            KsiClient(a.socket) as on_a, KsiClient(b.socket) as on_b:
        # B has free slots but its one stub-busy slot is held; A has none free
        held_b = await busy(on_b, "b")
        fills = [await on_a.request("completion:async", {"prompt": f"fill {i}", "conversation_id": f"fill-{i}",
                                                         "create": True, "model": "openai/stub-slow"})
                 for i in range(4)]
        while len(stub.requests) < 5:
            await asyncio.sleep(0.02)
        ack = await on_a.request("completion:async", {"prompt": "busy turn", "conversation_id": "o",
                                                      "create": True, "model": BUSY})
        result = await on_a.request("completion:wait", {"request_id": ack["request_id"], "timeout": 60})
        health = await on_b.request("system:health", {})
        for started in fills:
            await on_a.request("completion:wait", {"request_id": started["request_id"], "timeout": 60})
        await on_b.request("completion:wait", {"request_id": held_b["request_id"], "timeout": 60})
    assert result["content"] == "stub answer to: busy turn"
    # claimed, it would have waited for B's stub-busy slot there, never offered again
    assert health["storage"]["requests_stolen"] == 0
