"""`ksi storage migrate` through a real PostgreSQL database: a var dir copied in by the CLI, served
by a daemon on the database with the same exports, continued there, and copied back out to files
that give the same exports again; a second run copies nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.conftest import complete, connected, running_daemon
from tests.pg_cluster import PASSWORD
from tests.test_crash import REPO, daemon_env
from tests.test_storage_migrate import fill


def ksi_migrate(target: str, var: Path, url: str) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "ksi_cli", "storage", "migrate", "--to", target,
                           "--var-dir", str(var), "--database-url", url, "--json"],
                          cwd=REPO, env=daemon_env("http://127.0.0.1:9/v1"), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert PASSWORD not in done.stdout + done.stderr
    return json.loads(done.stdout)


async def test_a_var_dir_goes_into_the_database_and_back_out_unchanged(short_tmp: Path, stub: Any,
                                                                        pg_url: str) -> None:
    exports = await fill(short_tmp / "a", stub)
    first = ksi_migrate("postgres", short_tmp / "a" / "var", pg_url)
    again = ksi_migrate("postgres", short_tmp / "a" / "var", pg_url)
    assert first["verified"] and again["verified"] and again["copied"] == {}

    models = {"openai/*": {"api_base": stub.api_base}}
    async with running_daemon(short_tmp / "db", models=models, storage="postgres", database_url=pg_url) as daemon, \
            connected(daemon) as client:
        for conversation_id, content in exports.items():
            copied = await client.request("conversation:export", {"conversation_id": conversation_id,
                                                                  "format": "jsonl"})
            assert copied["content"] == content, conversation_id
        result = await complete(client, prompt="after the move", conversation_id="talk")
        assert result["exchange"] == 4
        exports["talk"] = (await client.request("conversation:export", {"conversation_id": "talk",
                                                                        "format": "jsonl"}))["content"]
    assert [m["content"] for m in stub.messages() if m["role"] == "user"] == [
        "first 0", "first 1", "first 2", "after the move"]

    back = ksi_migrate("jsonl", short_tmp / "c" / "var", pg_url)
    assert back["verified"]
    async with running_daemon(short_tmp / "c", models=models) as daemon, connected(daemon) as client:
        for conversation_id, content in exports.items():
            copied = await client.request("conversation:export", {"conversation_id": conversation_id,
                                                                  "format": "jsonl"})
            assert copied["content"] == content, conversation_id
