"""A damaged JSONL digest log never routes a turn into another conversation: after a restart, a
candidate the log names is checked against the digest its own conversation stored before it is
used; a directory in the log's place is set aside and the log rebuilt from the indexes, never an
internal error. (The log is the JSONL store's; PostgreSQL finds digests in its exchanges table.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from tests.conftest import complete, connected, running_daemon, stub_settings
from tests.stored import stored_index


def history(pairs: list[tuple[str, str]]) -> list[dict[str, Any]]:
    return [message for user, reply in pairs for message in
            ({"role": "user", "content": user}, {"role": "assistant", "content": reply})]


async def test_a_log_line_naming_the_wrong_conversation_is_not_followed(short_tmp: Path, stub: Any) -> None:
    settings = stub_settings(stub)
    async with running_daemon(short_tmp, **settings) as daemon, connected(daemon) as client:
        mine = [(p, (await complete(client, prompt=p, conversation_id="mine", create=True))["content"])
                for p in ("m1", "m2", "m3")]
        for prompt in ("o1", "o2", "o3", "o4"):
            await complete(client, prompt=prompt, conversation_id="other", create=True)
        other_index = await stored_index(daemon, "other")
        log_file = daemon.layout.state_dir / "digests.jsonl"
    # every line of "mine" now names "other" (a damaged or edited log), whose exchanges differ
    lines = [orjson.loads(text) for text in log_file.read_bytes().splitlines()]
    log_file.write_bytes(b"".join(orjson.dumps({**line, "c": "other"} if line.get("c") == "mine" else line) + b"\n"
                                  for line in lines))
    async with running_daemon(short_tmp, **settings) as daemon, connected(daemon) as client:
        for upto in (1, 3):
            result = await complete(client, prompt="next", history=history(mine[:upto]))
            assert result["conversation_id"] != "other", upto
            meta = (await client.request("conversation:show", {"conversation_id": result["conversation_id"]}))
            assert meta["conversation"].get("parent_id") != "other", upto  # nor a fork of it
        assert await stored_index(daemon, "other") == other_index


async def test_a_directory_in_the_logs_place_is_rebuilt_not_an_internal_error(short_tmp: Path, stub: Any) -> None:
    settings = stub_settings(stub)
    async with running_daemon(short_tmp, **settings) as daemon, connected(daemon) as client:
        first = await complete(client, prompt="hello", conversation_id="c1", create=True)
        log_file = daemon.layout.state_dir / "digests.jsonl"
    log_file.unlink()
    log_file.mkdir()
    (log_file / "stray").write_bytes(b"x")
    async with running_daemon(short_tmp, **settings) as daemon, connected(daemon) as client:
        result = await complete(client, prompt="again", history=history([("hello", first["content"])]))
        assert result["conversation_id"] == "c1" and result["exchange"] == 2
        assert log_file.is_file()  # rebuilt in its place; the directory set aside, not removed
        assert [p for p in log_file.parent.iterdir() if p.name.startswith("digests.jsonl.damaged")]
    async with running_daemon(short_tmp, **settings) as daemon, connected(daemon) as client:
        grown = history([("hello", first["content"]), ("again", result["content"])])
        again = await complete(client, prompt="third", history=grown)
        assert again["conversation_id"] == "c1" and again["exchange"] == 3
