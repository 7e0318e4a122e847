"""Items a client sends after a stored point (`previous_response_id` or `conversation_id`): as the
Responses API takes them, they follow that point's context, before the new input.

A client that runs tools step by step with a fixed `previous_response_id` resends, at each step,
the turns it made since (its user message, the call the model made) and the call's output. KSI
keeps one readable conversation: the leading turns the conversation already holds right after the
point are continued, not stored twice, and only the others are added as exchanges, in place when
they follow the conversation's newest exchange, else in a copy-free fork there. Output items that
open the list and repeat the point's own outputs (a client resending the call it answers) are that
point's. Everything is checked before anything is written."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from ksi_common import items
from ksi_common.errors import ErrorCode, KsiError
from ksi_common.events import CONVERSATION_APPEND, CONVERSATION_FORK
from ksi_daemon.context import EventContext
from ksi_daemon.router import Router
from ksi_daemon.services.completion.client_history import split_history
from ksi_daemon.services.completion.models import CompletionAsync
from ksi_daemon.services.conversations.client_items import OUTPUT_KINDS, normalised
from ksi_daemon.services.conversations.memory import ConversationCache, ConversationMemory, Exchange
from ksi_daemon.services.conversations.responses import locate
from ksi_daemon.storage.ports import ResponseStore

FIELD = "appended"
Turn = tuple[list[items.Item], list[items.Item]]


@dataclass(frozen=True, slots=True)
class Point:
    """Where the appended items go: after exchange `n` of `memory` (0: before its first)."""

    memory: ConversationMemory
    n: int


def _canonical(found: list[items.Item]) -> list[items.Item]:
    return [c for c in map(items.canonical_item, found) if c is not None]


def _same(stored: Exchange, inputs: list[items.Item], outputs: list[items.Item]) -> bool:
    return _canonical(stored.input) == _canonical(inputs) and _canonical(stored.output) == _canonical(outputs)


def _is_output(item: Any) -> bool:
    if not isinstance(item, dict):
        return False
    kind = item.get("type") or "message"
    return kind in OUTPUT_KINDS or (kind == "message" and item.get("role") == "assistant")


def check_answers(last: list[items.Item], new_input: list[items.Item]) -> None:
    """The new input answers every call of the last added exchange and nothing else (refused
    before the exchanges are written, so a wrong output leaves nothing behind)."""
    made = {str(call["call_id"]) for call in items.function_calls(last)}
    answered = set(items.call_ids_answered(new_input))
    if made == answered:
        return
    unknown, missing = sorted(answered - made), sorted(made - answered)
    why = (f"function_call_output for {', '.join(unknown)} answers no call of the items before it" if unknown
           else f"the calls {', '.join(missing)} of the items before it have no function_call_output")
    raise KsiError(ErrorCode.VALIDATION_ERROR, f"input: {why}", fields={"input": why},
                   call_ids=unknown or missing)


class AppendedTurns:
    """Places a request's appended items after its point and names the conversation it runs in."""

    def __init__(self, cache: ConversationCache, responses: ResponseStore, router: Router,
                 count_live: Callable[[str], int]) -> None:
        self.cache = cache
        self.responses = responses
        self.router = router
        self.count_live = count_live  # requests queued or running on a conversation

    async def resolve(self, data: CompletionAsync, context: EventContext,
                      before_write: Callable[[CompletionAsync], Awaitable[None]]) -> CompletionAsync:
        """`data` without its appended items, continuing where they end (written first when new)."""
        point = await self._point(data)
        raw = await self._without_repeated_outputs(point, list(data.appended or []))
        data = data.model_copy(update={"appended": None})
        turns = split_history(raw, data.instructions, FIELD).exchanges if raw else []
        held = await self._held(point, turns)
        rest = turns[held:]
        at = point.n + held
        if not rest:
            return await self._continuing(data, point, at)
        check_answers(rest[-1][1], data.input_items())
        await before_write(data)
        target = point.memory.conversation_id
        if at != point.memory.total or self.count_live(target):
            fork: dict[str, Any] = {"conversation_id": target, "at": at}
            if data.origin is not None:
                fork["origin"] = data.origin
            target = str((await self.router.request(CONVERSATION_FORK, fork, context.child()))["conversation_id"])
        await self.router.request(CONVERSATION_APPEND, {
            "conversation_id": target, "exchanges": [{"input": inputs, "output": outputs} for inputs, outputs in rest],
        }, context.child())
        return data.model_copy(update={"conversation_id": target, "previous_response_id": None})

    async def _point(self, data: CompletionAsync) -> Point:
        if data.previous_response_id is not None:
            found = await locate(self.cache, self.responses, data.previous_response_id,
                                 ErrorCode.PREVIOUS_RESPONSE_NOT_FOUND)
            if found.memory is None or found.n is None:
                raise KsiError(ErrorCode.PREVIOUS_RESPONSE_NOT_FOUND,
                               f"response {data.previous_response_id} is in no conversation's history",
                               response_id=data.previous_response_id)
            return Point(found.memory, found.n)
        assert data.conversation_id is not None  # the payload's validator asks for one of them
        memory = await self.cache.get(data.conversation_id)
        if memory is None or memory.retired:
            raise KsiError(ErrorCode.CONVERSATION_NOT_FOUND, f"conversation {data.conversation_id} does not exist",
                           conversation_id=data.conversation_id)
        await self.cache.load_newest(memory)
        return Point(memory, memory.total)

    async def _stored(self, memory: ConversationMemory, n: int) -> Exchange | None:
        entry = memory.entry(n)
        if entry is None and memory.base < n <= memory.total:
            await self.cache.load_all(memory)
            entry = memory.entry(n)
        return (await self.cache.texts(memory, [entry]))[0] if entry is not None else None

    async def _without_repeated_outputs(self, point: Point, raw: list[Any]) -> list[Any]:
        """`raw` without the output items opening it when they are the point's own outputs; others
        are refused (an exchange KSI stores begins with its input)."""
        leading = 0
        while leading < len(raw) and _is_output(raw[leading]):
            leading += 1
        if not leading:
            return raw
        outputs = [normalised(item, f"{FIELD}.{position}") for position, item in enumerate(raw[:leading])]
        stored = await self._stored(point.memory, point.n) if point.n else None
        if stored is None or _canonical(stored.output) != _canonical(outputs):
            why = "output items before any input must be the outputs of the response they follow"
            raise KsiError(ErrorCode.VALIDATION_ERROR, f"{FIELD}.0: {why}", fields={f"{FIELD}.0": why})
        return raw[leading:]

    async def _held(self, point: Point, turns: list[Turn]) -> int:
        """How many of `turns` the conversation holds right after the point, in order."""
        held = 0
        for inputs, outputs in turns:
            n = point.n + held + 1
            stored = await self._stored(point.memory, n) if n <= point.memory.total else None
            if stored is None or not _same(stored, inputs, outputs):
                break
            held += 1
        return held

    async def _continuing(self, data: CompletionAsync, point: Point, at: int) -> CompletionAsync:
        """`data` continuing after exchange `at`, which the conversation holds."""
        if data.previous_response_id is None or at == point.n:
            return data
        entry = point.memory.entry(at)
        if entry is None:
            await self.cache.load_all(point.memory)
            entry = point.memory.entry(at)
        assert entry is not None  # matched above, so stored
        return data.model_copy(update={"previous_response_id": entry.response_id})
