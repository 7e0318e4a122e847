"""The history window's start moves in steps: between two moves every request a conversation sends
extends the previous one, message for message, so a provider's prompt cache keeps holding it; the
budget holds on every turn."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from ksi_daemon.services.conversations.history import MESSAGE_OVERHEAD
from tests.conftest import complete, connected, running_daemon
from tests.test_completion_budget import RESERVE, SMALL, WINDOW, small_window, tokens

pytestmark = pytest.mark.backends

TURNS = 18


def counted(messages: list[dict[str, Any]]) -> int:
    """The prompt's tokens as the daemon counts them, so the stub refuses what would overflow."""
    return sum(tokens(str(message.get("content") or "")) + MESSAGE_OVERHEAD for message in messages)


def extends(previous: list[dict[str, Any]], current: list[dict[str, Any]]) -> bool:
    """Whether `current` begins with every message of `previous`, byte for byte."""
    encode = orjson.dumps
    return len(current) > len(previous) and all(
        encode(a, option=orjson.OPT_SORT_KEYS) == encode(b, option=orjson.OPT_SORT_KEYS)
        for a, b in zip(previous, current, strict=False))


async def converse(root: Path, stub: Any, backend: dict[str, Any], step: int) -> list[dict[str, Any]]:
    """TURNS turns of one conversation in a window holding a few exchanges; the history each sent."""
    stub.prompt_tokens = counted
    stub.window = WINDOW - RESERVE
    sent = []
    async with running_daemon(root, **small_window(stub, history_step=step), **backend) as daemon, \
            connected(daemon) as client:
        for turn in range(TURNS):
            result = await complete(client, model=SMALL, prompt=f"note {turn}: the tide turned at the pier",
                                    conversation_id="steps", create=turn == 0)
            sent.append(result["history"])
    assert stub.overflows == 0  # no request over the window, by the daemon's own count
    assert all(history["prompt_tokens_estimate"] <= WINDOW - RESERVE for history in sent)
    return sent


async def test_between_steps_each_request_extends_the_previous(short_tmp: Path, stub: Any,
                                                               backend: dict[str, Any]) -> None:
    step = 4
    sent = await converse(short_tmp, stub, backend, step)
    omitted = [history["exchanges_omitted"] for history in sent]
    assert max(omitted) >= 2 * step  # the window moved more than once
    assert all(left_out % step == 0 for left_out in omitted)  # its start is on a step's boundary
    requests = [request["messages"] for request in stub.requests]
    moves = 0
    for number in range(1, TURNS):
        if omitted[number] == omitted[number - 1]:
            assert extends(requests[number - 1], requests[number]), f"turn {number} rewrote the prefix"
        else:
            assert omitted[number] > omitted[number - 1]
            assert not extends(requests[number - 1], requests[number])
            moves += 1
    assert 2 <= moves <= TURNS // step


async def test_a_step_of_one_moves_the_window_every_turn(short_tmp: Path, stub: Any,
                                                         backend: dict[str, Any]) -> None:
    sent = await converse(short_tmp, stub, backend, 1)
    requests = [request["messages"] for request in stub.requests]
    full = [number for number in range(1, TURNS) if sent[number]["exchanges_omitted"]]
    assert len(full) > TURNS // 2
    # once the window is full, every turn drops the oldest exchange: no request extends the one before
    assert not any(extends(requests[number - 1], requests[number]) for number in full[1:])
