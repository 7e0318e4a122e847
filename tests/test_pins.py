"""Pins: chosen exchanges stay verbatim in every turn's history, within their share of the
budget; kept across restarts, forks, exports and imports, on every storage backend."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ksi_common.errors import KsiError
from tests.conftest import complete, connected, running_daemon
from tests.stored import stored_meta
from tests.test_compaction import FACT, FILLER, SMALL, answering, good, settings, settled, turn_calls

pytestmark = pytest.mark.backends


def users(body: dict[str, Any]) -> list[str]:
    return [str(m["content"]) for m in body["messages"] if m["role"] == "user"]


async def test_a_pinned_exchange_is_sent_verbatim_in_every_turn(short_tmp: Path, stub: Any,
                                                                backend: dict[str, Any]) -> None:
    stub.answer = answering(good)
    config = settings(stub, summariser="off", **backend)
    async with running_daemon(short_tmp, **config) as daemon, connected(daemon) as client:
        await complete(client, model=SMALL, prompt=FACT, conversation_id="pinned", create=True)
        pinned = await client.request("conversation:pin", {"conversation_id": "pinned", "n": 1})
        assert pinned["pins"] == [1] and 0 < pinned["tokens"] <= pinned["allowed"]
        for _turn in range(20):
            result = await complete(client, model=SMALL, prompt=FILLER, conversation_id="pinned")
        assert result["history"]["exchanges_omitted"] > 0  # others are left out, the pinned one is not
        assert all(users(body)[0] == FACT for body in turn_calls(stub)[1:])
        sent = await client.request("conversation:sent", {"conversation_id": "pinned", "n": 21})
        assert sent["history"][0] == 1 and sent["messages"][1]["content"] == FACT

        # a fork shares the pins of its prefix; an export carries them into an import
        await client.request("conversation:fork", {"conversation_id": "pinned", "at": 15, "new_id": "branch"})
        await complete(client, model=SMALL, prompt="on the branch", conversation_id="branch")
        assert users(turn_calls(stub)[-1])[0] == FACT
        exported = await client.request("conversation:export", {"conversation_id": "pinned", "format": "json"})
        imported = await client.request("conversation:import", {"data": exported["content"], "new_id": "copy"})
        assert imported["conversation"]["pins"] == [1]
        await complete(client, model=SMALL, prompt="on the copy", conversation_id="copy")
        assert users(turn_calls(stub)[-1])[0] == FACT

        await client.request("conversation:unpin", {"conversation_id": "pinned", "n": [1]})
        await complete(client, model=SMALL, prompt=FILLER, conversation_id="pinned")
        assert FACT not in users(turn_calls(stub)[-1])

        await client.request("conversation:pin", {"conversation_id": "pinned", "n": [1]})
    # kept across a restart
    async with running_daemon(short_tmp, **config) as daemon, connected(daemon) as client:
        await complete(client, model=SMALL, prompt=FILLER, conversation_id="pinned")
        assert users(turn_calls(stub)[-1])[0] == FACT
        shown = await client.request("conversation:show", {"conversation_id": "pinned"})
        assert shown["conversation"]["pins"] == [1]


async def test_pins_past_their_share_or_of_no_exchange_are_refused_and_change_nothing(
        short_tmp: Path, stub: Any, backend: dict[str, Any]) -> None:
    stub.answer = answering(good)
    async with running_daemon(short_tmp, **settings(stub, summariser="off", **backend)) as daemon, \
            connected(daemon) as client:
        for turn in range(1, 11):
            await complete(client, model=SMALL, prompt=FACT if turn == 1 else FILLER, conversation_id="full",
                           create=True)
            await settled(daemon)
        await client.request("conversation:pin", {"conversation_id": "full", "n": [1]})
        before = await stored_meta(daemon, "full")
        with pytest.raises(KsiError) as caught:
            await client.request("conversation:pin", {"conversation_id": "full", "n": list(range(2, 11))})
        assert caught.value.code == "pins_over_budget"
        assert caught.value.details["tokens"] > caught.value.details["allowed"]
        with pytest.raises(KsiError) as caught:
            await client.request("conversation:pin", {"conversation_id": "full", "n": [11]})
        assert caught.value.code == "validation_error"
        with pytest.raises(KsiError) as caught:
            await client.request("conversation:pin", {"conversation_id": "full", "n": []})
        assert caught.value.code == "validation_error"
        assert await stored_meta(daemon, "full") == before
        assert (await stored_meta(daemon, "full") or {})["pins"] == [1]


async def test_a_pin_costs_nothing_while_the_history_holds_everything(short_tmp: Path, stub: Any,
                                                                      backend: dict[str, Any]) -> None:
    """A pinned exchange the history shows anyway is not paid twice: a pinned conversation leaves
    out an exchange at the same turn as an unpinned one."""
    stub.answer = answering(good)
    async with running_daemon(short_tmp, **settings(stub, summariser="off", **backend)) as daemon, \
            connected(daemon) as client:
        first_omission: dict[str, int] = {}
        for name in ("plain", "pinned"):
            await complete(client, model=SMALL, prompt=FACT, conversation_id=name, create=True)
            await complete(client, model=SMALL, prompt=FILLER, conversation_id=name)
            if name == "pinned":  # not the oldest: a history that has to drop something drops 1 first
                await client.request("conversation:pin", {"conversation_id": name, "n": 2})
            for turn in range(3, 30):
                result = await complete(client, model=SMALL, prompt=FILLER, conversation_id=name)
                if result["history"]["exchanges_omitted"]:
                    first_omission[name] = turn
                    break
    assert first_omission["pinned"] == first_omission["plain"], first_omission


async def test_a_pin_a_summary_covers_counts_in_the_history_and_the_note(short_tmp: Path, stub: Any,
                                                                        backend: dict[str, Any]) -> None:
    stub.answer = answering(good)
    async with running_daemon(short_tmp, **settings(stub, **backend)) as daemon, connected(daemon) as client:
        await complete(client, model=SMALL, prompt=FACT, conversation_id="both", create=True)
        await client.request("conversation:pin", {"conversation_id": "both", "n": 1})
        upto = 0
        for turn in range(2, 40):
            result = await complete(client, model=SMALL, prompt=FILLER, conversation_id="both")
            await settled(daemon)
            upto = result["history"].get("summary_upto") or 0
            if upto >= 2:
                break
        assert upto >= 2, "a summary stands in for exchanges 1..upto"
        sent = await client.request("conversation:sent", {"conversation_id": "both", "n": turn})
    shown = sent["history"]  # the numbers of the exchanges sent
    assert shown[0] == 1  # the pin, verbatim, though the summary covers it
    after_summary = (turn - 1) - upto  # the exchanges before this turn the summary does not cover
    left_out = after_summary - len([n for n in shown if n > upto])
    assert result["history"]["exchanges_omitted"] == left_out
    assert result["history"]["exchanges_total"] == after_summary + 1  # the pin counted too
