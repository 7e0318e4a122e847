"""A client-held history matches only conversations stored for whom its request names (an agent,
the provider options `user` and `safety_identifier`); one naming nobody only conversations stored
for nobody. Through the socket and the HTTP door, on both backends."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest

from ksi_daemon.daemon import Daemon
from tests.conftest import complete, connected, running_http_daemon, stub_settings
from tests.stored import stored_meta

pytestmark = pytest.mark.backends

OPENING = [{"role": "user", "content": "Hello, I am the app's canned opening."}]


async def test_two_users_of_one_app_with_the_same_opening_keep_their_own_conversations(stub_daemon: Daemon) -> None:
    async with connected(stub_daemon) as client:
        first = await complete(client, messages=OPENING, options={"user": "alice"})
        history = [*OPENING, {"role": "assistant", "content": first["content"]}]
        # bob's app holds the same turn (its canned opening and the same reply)
        bob = await complete(client, prompt="I am Bob", history=history, options={"user": "bob"})
        assert bob["conversation_id"] != first["conversation_id"]
        assert ((await stored_meta(stub_daemon, bob["conversation_id"])) or {})["extra"]["scope"] == {"user": "bob"}
        alice = await complete(client, prompt="I am Alice", history=history, options={"user": "alice"})
        assert (alice["conversation_id"], alice["exchange"]) == (first["conversation_id"], 2)
        # bob's next turn continues bob's conversation, not alice's, though both start alike
        bob_history = [*history, {"role": "user", "content": "I am Bob"},
                       {"role": "assistant", "content": bob["content"]}]
        again = await complete(client, prompt="who am I?", history=bob_history, options={"user": "bob"})
        assert (again["conversation_id"], again["exchange"]) == (bob["conversation_id"], 3)
        # a request naming nobody matches neither (both are stored for someone)
        nobody = await complete(client, prompt="and me?", history=history)
        assert nobody["conversation_id"] not in (first["conversation_id"], bob["conversation_id"])
        assert "scope" not in (((await stored_meta(stub_daemon, nobody["conversation_id"])) or {})["extra"])
        # and one naming nobody is matched by nobody's next turn, not by a named user
        nobody_history = [*history, {"role": "user", "content": "and me?"},
                          {"role": "assistant", "content": nobody["content"]}]
        named = await complete(client, prompt="next", history=nobody_history, options={"safety_identifier": "carol"})
        assert named["conversation_id"] != nobody["conversation_id"]
        unnamed = await complete(client, prompt="next", history=nobody_history)
        assert (unnamed["conversation_id"], unnamed["exchange"]) == (nobody["conversation_id"], 3)


async def test_a_fork_keeps_its_parents_scope(stub_daemon: Daemon) -> None:
    async with connected(stub_daemon) as client:
        first = await complete(client, prompt="p1", options={"user": "alice"})
        second = await complete(client, prompt="p2", conversation_id=first["conversation_id"])
        history = [{"role": "user", "content": "p1"}, {"role": "assistant", "content": first["content"]},
                   {"role": "user", "content": "p2 edited"}, {"role": "assistant", "content": second["content"]}]
        forked = await complete(client, prompt="p3", history=history, options={"user": "alice"})
        meta = await stored_meta(stub_daemon, forked["conversation_id"]) or {}
        assert meta["parent_id"] == first["conversation_id"] and meta["extra"]["scope"] == {"user": "alice"}


async def test_a_history_naming_no_agent_does_not_match_an_agents_conversation(stub_daemon: Daemon) -> None:
    async with connected(stub_daemon) as client:
        await client.request("agent:spawn", {"agent_id": "helper", "system": "You are Helper."})
        first = await complete(client, prompt="t0", agent_id="helper")
        history = [{"role": "system", "content": "You are Helper."}, {"role": "user", "content": "t0"},
                   {"role": "assistant", "content": first["content"]}]
        other = await complete(client, prompt="t1", history=history)
        assert other["conversation_id"] != first["conversation_id"]
        own = await complete(client, prompt="t1", history=history[1:], agent_id="helper")
        assert (own["conversation_id"], own["exchange"]) == (first["conversation_id"], 2)


async def test_the_http_doors_user_fields_scope_a_resent_history(short_tmp: Path, stub: Any,
                                                                 backend: dict[str, Any]) -> None:
    """Chat `user` and Responses `safety_identifier`, through the official SDK."""
    async with running_http_daemon(short_tmp, **stub_settings(stub), **backend) as http, \
            openai.AsyncOpenAI(base_url=f"{http.base_url}/v1", api_key=http.token, max_retries=0) as api:
        messages: dict[str, list[dict[str, Any]]] = {"alice": list(OPENING), "bob": list(OPENING)}
        ids: dict[str, set[str]] = {"alice": set(), "bob": set()}
        for turn in ("first", "second"):
            for user in ("alice", "bob"):
                raw = await api.chat.completions.with_raw_response.create(
                    model="openai/stub-model", messages=messages[user], user=user)
                ids[user].add(raw.headers["x-ksi-conversation-id"])
                messages[user] += [{"role": "assistant", "content": raw.parse().choices[0].message.content},
                                   {"role": "user", "content": f"{user}'s {turn} turn"}]
        assert len(ids["alice"]) == len(ids["bob"]) == 1 and ids["alice"] != ids["bob"]
        # the Responses door: the same history under another safety identifier is not bob's
        resent: Any = messages["bob"][:-1] + [{"role": "user", "content": "hi"}]
        dave = await api.responses.create(model="openai/stub-model", input=resent, safety_identifier="dave")
        assert dave.conversation is not None and dave.conversation.id not in ids["alice"] | ids["bob"]
        bob = await api.responses.create(model="openai/stub-model", input=resent, user="bob")
        assert bob.conversation is not None and bob.conversation.id in ids["bob"]
