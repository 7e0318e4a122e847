"""Lists tell conversations apart: where each came from, the start of its first input, and what
a fork shares with its parent; kept in metadata, so a listing reads no response record."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ksi_common.client import KsiClient
from ksi_common.errors import KsiError
from ksi_daemon.daemon import Daemon
from ksi_daemon.storage.models import PREVIEW_CHARS, ConversationMeta
from tests.conftest import complete, connected, running_daemon
from tests.stored import stored_meta

pytestmark = pytest.mark.backends


async def listed(client: KsiClient) -> dict[str, dict[str, Any]]:
    found = await client.request("conversation:list", {"limit": 1000})
    return {c["conversation_id"]: c for c in found["conversations"]}


async def test_a_conversation_records_its_door_and_first_input(stub_daemon: Daemon) -> None:
    long_input = "Plan   the\nrelease " + "in detail " * 40
    async with connected(stub_daemon) as client:
        first = await complete(client, prompt=long_input, origin="cli")
        await complete(client, prompt="and the second turn", conversation_id=first["conversation_id"], origin="mcp")
        await complete(client, prompt="made by a web client", conversation_id="from-http", create=True, origin="http")
        await client.request("conversation:update", {"conversation_id": "from-http", "title": "Named"})
        await client.request("agent:spawn", {"agent_id": "worker", "model": "openai/stub-model"})
        await client.request("agent:send_message", {"agent_id": "worker", "message": "agent work", "wait": 30})
        conversations = await listed(client)
    mine = conversations[first["conversation_id"]]
    assert mine["origin"] == "cli"  # the door that created it; a later turn through another door keeps it
    assert mine["preview"].startswith("Plan the release in detail")  # on one line, white space collapsed
    assert len(mine["preview"]) == PREVIEW_CHARS and mine["preview"].endswith("…")
    assert (mine["turns"], mine["inherited"]) == (2, 0)
    assert (conversations["from-http"]["origin"], conversations["from-http"]["title"]) == ("http", "Named")
    assert conversations["from-http"]["preview"] == "made by a web client"
    assert (conversations["worker"]["origin"], conversations["worker"]["preview"]) == ("agent", "agent work")
    meta = await stored_meta(stub_daemon, first["conversation_id"])
    assert meta is not None and (meta["origin"], meta["preview"]) == ("cli", mine["preview"])  # in storage itself


async def test_a_fork_counts_the_turns_it_inherits_and_keeps_its_parents_first_input(stub_daemon: Daemon) -> None:
    async with connected(stub_daemon) as client:
        await complete(client, prompt="root question", conversation_id="root", create=True, origin="cli")
        await complete(client, prompt="second", conversation_id="root")
        await complete(client, prompt="third", conversation_id="root")
        fork = await client.request("conversation:fork", {"conversation_id": "root", "at": 2, "new_id": "branch",
                                                          "origin": "console"})
        assert (fork["conversation"]["turns"], fork["conversation"]["inherited"]) == (2, 2)
        await complete(client, prompt="a different third", conversation_id="branch")
        empty = await client.request("conversation:fork", {"conversation_id": "root", "at": 0, "new_id": "blank"})
        await complete(client, prompt="starts afresh", conversation_id="blank")
        conversations = await listed(client)
        shown = await client.request("conversation:show", {"conversation_id": "branch", "limit": 1})
    branch = conversations["branch"]
    assert (branch["turns"], branch["inherited"], branch["exchanges"]) == (3, 2, 1)
    assert (branch["parent_id"], branch["origin"], branch["preview"]) == ("root", "console", "root question")
    assert shown["conversation"]["turns"] == shown["total_exchanges"] == 3
    assert (conversations["root"]["turns"], conversations["root"]["inherited"]) == (3, 0)
    assert empty["conversation"]["inherited"] == 0
    assert (conversations["blank"]["origin"], conversations["blank"]["preview"]) == (None, "starts afresh")


async def test_an_unknown_door_is_refused_and_creates_nothing(stub_daemon: Daemon) -> None:
    async with connected(stub_daemon) as client:
        with pytest.raises(KsiError) as refused:
            await client.request("completion:async", {"prompt": "hi", "conversation_id": "nowhere", "create": True,
                                                      "origin": "carrier-pigeon"})
        assert refused.value.code == "validation_error" and "origin" in refused.value.details["fields"]
        with pytest.raises(KsiError) as refused_fork:
            await client.request("conversation:fork", {"conversation_id": "nowhere", "origin": "fax"})
        assert refused_fork.value.code == "validation_error"
        assert (await client.request("conversation:list", {}))["total"] == 0
    assert await stub_daemon.storage.conversations.exists("nowhere") is False


async def test_a_conversation_older_than_the_record_lists_as_unknown(stub_daemon: Daemon) -> None:
    await stub_daemon.storage.conversations.create(ConversationMeta(conversation_id="older", title=None))
    async with connected(stub_daemon) as client:
        older = (await listed(client))["older"]
        await complete(client, prompt="a turn now", conversation_id="older")
        after = (await listed(client))["older"]
    assert (older["origin"], older["preview"], older["turns"]) == (None, None, 0)
    assert (after["origin"], after["preview"]) == (None, "a turn now")  # its first exchange is recorded


async def test_listing_reads_the_preview_from_metadata_not_from_response_records(short_tmp: Path, stub: Any) -> None:
    from tests.conftest import stub_settings

    async with running_daemon(short_tmp, **stub_settings(stub)) as daemon, connected(daemon) as client:
        result = await complete(client, prompt="remembered without its record", origin="llm")
        daemon.settings.layout.response_file(result["response_id"]).unlink()  # the only place the input is
        item = (await listed(client))[result["conversation_id"]]
    assert (item["preview"], item["origin"]) == ("remembered without its record", "llm")


async def test_ksi_conversations_shows_first_inputs_doors_and_forks_and_never_cuts_an_id(
        short_tmp: Path, stub: Any, backend: dict[str, Any]) -> None:
    from tests.conftest import stub_settings
    from tests.test_inspect import ksi

    async with running_daemon(short_tmp, **stub_settings(stub), **backend) as daemon, connected(daemon) as client:
        untitled = await complete(client, prompt="Where does the river bend?", origin="cli")
        await complete(client, prompt="and then?", conversation_id=untitled["conversation_id"])
        fork = await client.request("conversation:fork", {"conversation_id": untitled["conversation_id"], "at": 1,
                                                          "origin": "console"})
    env = {"KSI_STORAGE": "postgres", "KSI_DATABASE_URL": backend["database_url"]} if backend else {}
    narrow = ksi("conversations", "--var-dir", str(short_tmp / "var"), cwd=short_tmp, tty=True,
                 env={**env, "COLUMNS": "70"})  # narrower than a row: the other columns give way
    assert narrow.returncode == 0, narrow.stderr
    lines = narrow.stdout.splitlines()
    parent = untitled["conversation_id"]
    for whole in (parent, fork["conversation_id"], f"{parent}@1"):  # each on one line, uncut
        assert any(whole in line for line in lines), (whole, narrow.stdout)
    wide = ksi("conversations", "--var-dir", str(short_tmp / "var"), cwd=short_tmp, tty=True, env=env).stdout
    assert "“Where does the river bend?”" in wide and "1 (1 inherited)" in wide
    assert "cli" in wide and "console" in wide
    listed = ksi("conversations", "--var-dir", str(short_tmp / "var"), "--json", cwd=short_tmp, env=env)
    items = {c["conversation_id"]: c for c in json.loads(listed.stdout)["conversations"]}
    assert items[fork["conversation_id"]]["inherited"] == 1 and items[fork["conversation_id"]]["origin"] == "console"
    assert items[untitled["conversation_id"]]["preview"] == "Where does the river bend?"


async def test_the_first_input_costs_no_extra_metadata_write(short_tmp: Path, stub: Any) -> None:
    from tests.conftest import stub_settings

    async with running_daemon(short_tmp, **stub_settings(stub)) as daemon, connected(daemon) as client:
        ack = await client.request("completion:async", {"prompt": "first words", "conversation_id": "lean",
                                                        "create": True, "origin": "cli"})
        meta_file = daemon.settings.layout.meta_file("lean")
        created = meta_file.stat().st_ino
        await client.request("completion:wait", {"request_id": ack["request_id"], "timeout": 30})
        # written with the creation: the first exchange changes only totals, which are saved lazily
        assert meta_file.stat().st_ino == created
        assert json.loads(meta_file.read_text())["preview"] == "first words"


async def test_ksi_ask_and_ksi_send_name_the_cli(short_tmp: Path, stub: Any) -> None:
    from tests.conftest import stub_settings
    from tests.test_cli_ask import ksi, where

    async with running_daemon(short_tmp, **stub_settings(stub)) as daemon, connected(daemon) as client:
        asked = await ksi(short_tmp, "ask", "--json", "asked from a shell", *where(short_tmp))
        assert asked.code == 0, asked.err
        sent = await ksi(short_tmp, "send", *where(short_tmp), "--wait", "completion:async", "--prompt", "sent raw")
        assert sent.code == 0, sent.err
        conversations = await listed(client)
    assert sorted((c["origin"], c["preview"]) for c in conversations.values()) == [
        ("cli", "asked from a shell"), ("cli", "sent raw")]
