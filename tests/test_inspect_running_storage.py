"""The inspection commands with KSI_STORAGE unset ask the running daemon which storage it uses: a
daemon on PostgreSQL is read there (its URL as the daemon shows it), or, when that URL holds a
password the daemon masks, the commands say which two settings to give instead of showing an
empty var dir."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import complete, connected, running_daemon
from tests.pg_cluster import ThrowawayCluster
from tests.test_cli_ask import ksi


def located(root: Path, **more: str) -> dict[str, str]:
    """The daemon's var dir and socket, as the inspection commands find them (they take no --socket)."""
    return {"KSI_VAR_DIR": str(root / "var"), "KSI_SOCKET_PATH": str(root / "d.sock"), **more}


async def test_a_daemon_on_postgres_is_read_there_when_the_url_needs_no_password(
        short_tmp: Path, pg_cluster: ThrowawayCluster, pg_url: str) -> None:
    name = pg_url.rsplit("/", 1)[1]
    local = f"postgresql://ksi@/{name}?host={pg_cluster.sockets}&port={pg_cluster.port}"  # trust on the socket
    async with running_daemon(short_tmp, storage="postgres", database_url=local) as daemon, \
            connected(daemon) as client:
        made = await complete(client, model="echo/x", prompt="kept in the database")
        listed = await ksi(short_tmp, "conversations", "--json", env=located(short_tmp))
        shown = await ksi(short_tmp, "conversation", "show", made["conversation_id"], "--json", env=located(short_tmp))
    assert listed.code == 0, listed.err
    assert [c["conversation_id"] for c in json.loads(listed.out)["conversations"]] == [made["conversation_id"]]
    assert shown.code == 0 and "kept in the database" in shown.out
    assert not (short_tmp / "var" / "logs" / "conversations").exists() or \
        not list((short_tmp / "var" / "logs" / "conversations").iterdir())  # nothing of it in the var dir


async def test_a_masked_url_names_the_settings_to_give(short_tmp: Path, pg_url: str) -> None:
    async with running_daemon(short_tmp, storage="postgres", database_url=pg_url) as daemon, \
            connected(daemon) as client:
        await complete(client, model="echo/x", prompt="kept in the database")
        refused = await ksi(short_tmp, "conversations", "--json", env=located(short_tmp))
        given = await ksi(short_tmp, "conversations", "--json",
                          env=located(short_tmp, KSI_STORAGE="postgres", KSI_DATABASE_URL=pg_url))
    assert refused.code == 1
    error = json.loads(refused.err)["error"]
    assert error["code"] == "storage_unavailable"
    assert "KSI_STORAGE=postgres" in error["message"] and "KSI_DATABASE_URL" in error["message"]
    password = pg_url.split(":")[2].split("@")[0]
    assert password not in refused.err and "***" in refused.err
    assert given.code == 0 and json.loads(given.out)["total"] == 1
