"""Compaction on the Responses door, KSI's way: a `compaction` item is a readable checkpoint of a
stored conversation, never an encrypted digest of it. It names the conversation and the response
it was taken after, shows the summaries KSI checked and stored for that conversation and its pinned
exchanges, and carries verbatim the items a client held that KSI had not stored yet. Sent back
as input, it stands for exactly that context: the request continues after that response, the
carried items first. KSI fits the history to each model's window itself (its chunk summaries
stand in for what is left out), so compacting calls no model and stores nothing.

Three ways in: POST /v1/responses/compact; an input ending with a `compaction_trigger` item
(answered by exactly one `compaction` item, the trigger never stored); and `context_management`
on create, whose `compact_threshold` adds a compaction item to a response whose input crossed it."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ksi_common.errors import ErrorCode, KsiError
from ksi_common.events import CONVERSATION_SHOW, RESPONSE_SHOW
from ksi_common.ids import random_hex
from ksi_daemon.transports.http.door import call, read_json
from ksi_daemon.transports.http.openai.response_object import (
    Asked,
    ksi_id,
    public_id,
    response_object,
    response_usage,
)
from ksi_daemon.transports.http.openai.response_stream import sse
from ksi_daemon.transports.http.openai.shapes import output_item_response
from ksi_daemon.transports.http.openai.translate import Door

FORMAT = "ksi-compaction/1"
TRIGGER = "compaction_trigger"
COMPACTION = "compaction"
NO_USAGE = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}  # no model is called
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass(slots=True)
class Checkpoint:
    """What a compaction item stands for: a stored conversation up to a response (None: nothing of
    it was stored yet), then the items the client held after it."""

    response_id: str | None
    carried: list[Any] = field(default_factory=list)


@dataclass(slots=True)
class Unfolded:
    """A create request's fields with compaction items replayed, and what it asked of compaction."""

    fields: dict[str, Any]
    trigger: bool = False  # the input ended with compaction_trigger: answer with a compaction item
    threshold: int | None = None  # context_management's compact_threshold


def _invalid(where: str, why: str) -> KsiError:
    return KsiError(ErrorCode.VALIDATION_ERROR, f"invalid request: {where}: {why}", fields={where: why})


def read_checkpoint(item: Any, where: str) -> Checkpoint:
    """The checkpoint a compaction item carries; one KSI did not write is refused, naming it."""
    content = item.get("encrypted_content") if isinstance(item, dict) else None
    try:
        data = orjson.loads(content) if isinstance(content, str) else None
    except orjson.JSONDecodeError:
        data = None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise _invalid(f"{where}.encrypted_content", f"not a compaction item of this server (format {FORMAT})")
    response_id = data.get("response_id")
    carried = data.get("carried")
    if response_id is not None and not isinstance(response_id, str) or not isinstance(carried, list):
        raise _invalid(f"{where}.encrypted_content", "its response_id or carried items are damaged")
    return Checkpoint(ksi_id(response_id) if response_id else None, carried)


def _threshold(fields: dict[str, Any]) -> int | None:
    rules = fields.pop("context_management", None)
    if rules is None:
        return None
    if not isinstance(rules, list):
        raise _invalid("context_management", "a list of {type: compaction, compact_threshold}")
    threshold = None
    for position, rule in enumerate(rules):
        where = f"context_management.{position}"
        if not isinstance(rule, dict) or rule.get("type") != COMPACTION:
            raise KsiError(ErrorCode.UNSUPPORTED_PARAMETER, f"{where}.type: only compaction is supported",
                           fields={f"{where}.type": "only compaction"})
        value = rule.get("compact_threshold")
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise _invalid(f"{where}.compact_threshold", "a number of tokens, 1 or more")
        threshold = value if value is not None else threshold
    return threshold


def unfold(fields: Any) -> Unfolded:
    """Replay the newest compaction item of the input: the request continues after its response,
    its carried items and then the items that follow it as new input (the items before it are
    what it stands for). A trailing compaction_trigger is taken off and reported."""
    if not isinstance(fields, dict):
        return Unfolded(fields)  # refused by the body's validation, as any other body
    threshold = _threshold(fields)
    items = fields.get("input")
    if not isinstance(items, list):
        return Unfolded(fields, threshold=threshold)
    trigger = bool(items) and isinstance(items[-1], dict) and items[-1].get("type") == TRIGGER
    if trigger:
        items = items[:-1]
    marks = [p for p, item in enumerate(items) if isinstance(item, dict) and item.get("type") == COMPACTION]
    if not marks:
        return Unfolded({**fields, "input": items}, trigger, threshold)
    if fields.get("previous_response_id") is not None:
        raise _invalid(f"input.{marks[-1]}", "a compaction item stands for the context: send it or "
                                             "previous_response_id, not both")
    checkpoint = read_checkpoint(items[marks[-1]], f"input.{marks[-1]}")
    unfolded = {**fields, "input": [*checkpoint.carried, *items[marks[-1] + 1:]]}
    if checkpoint.response_id is not None:
        unfolded["previous_response_id"] = checkpoint.response_id
    return Unfolded(unfolded, trigger, threshold)


def checkpoint_of(fields: dict[str, Any]) -> Checkpoint:
    """What a compaction of these request fields stands for: after `previous_response_id`, or
    after the newest input item that carries an id this door gave; the rest is carried."""
    items = fields.get("input")
    items = [] if items is None else [{"type": "message", "role": "user", "content": items}] \
        if isinstance(items, str) else list(items)
    previous = fields.get("previous_response_id")
    if isinstance(previous, str):
        return Checkpoint(ksi_id(previous), items)
    for position in range(len(items) - 1, -1, -1):
        item = items[position]
        item_id = item.get("id") if isinstance(item, dict) else None
        found = output_item_response(item_id) if isinstance(item_id, str) else None
        if found is not None:
            return Checkpoint(found, items[position + 1:])
    return Checkpoint(None, items)


class Compaction:
    """The door's compaction: checkpoints shown as compaction items, and the answers that carry them."""

    def __init__(self, door: Door) -> None:
        self.door = door

    async def item(self, checkpoint: Checkpoint) -> dict[str, Any]:
        """The compaction item of `checkpoint`, with the stored summaries and pins it stands for;
        an unknown response is previous_response_not_found."""
        content: dict[str, Any] = {"format": FORMAT, "response_id": None, "conversation_id": None,
                                   "exchanges": 0, "summaries": [], "pinned": [], "carried": checkpoint.carried}
        if checkpoint.response_id is not None:
            try:
                shown = await call(self.door.handle_request, RESPONSE_SHOW, {"response_id": checkpoint.response_id})
            except KsiError as error:
                if error.code != ErrorCode.RESPONSE_NOT_FOUND:
                    raise
                raise KsiError(ErrorCode.PREVIOUS_RESPONSE_NOT_FOUND,
                               f"response {public_id(checkpoint.response_id)} is not found: nothing to compact",
                               fields={"previous_response_id": "not found"}) from None
            content.update(response_id=public_id(shown["response_id"]), conversation_id=shown["conversation_id"],
                           exchanges=shown["exchange"] or 0)
            if shown["conversation_id"]:
                content.update(await self._kept(shown["conversation_id"], shown["exchange"] or 0))
        return {"type": COMPACTION, "id": f"cmp_{random_hex(24)}", "created_by": "ksi",
                "encrypted_content": orjson.dumps(content).decode()}

    async def _kept(self, conversation_id: str, upto: int) -> dict[str, Any]:
        """The checked summaries and the pins of a conversation, as far as `upto` reaches."""
        shown = await call(self.door.handle_request, CONVERSATION_SHOW,
                           {"conversation_id": conversation_id, "limit": 1})
        summaries = [{"first": s.get("first", 1), "upto": s["upto"], "kind": s.get("kind", "summary"),
                      "text": s["text"]} for s in shown.get("summaries") or [] if int(s.get("upto") or 0) <= upto]
        pins = [n for n in (shown.get("conversation") or {}).get("pins") or [] if n <= upto]
        return {"summaries": summaries, "pinned": pins}

    async def compact(self, request: Request) -> Response:
        """POST /v1/responses/compact: the context given (previous_response_id, or the items this
        door returned, then any the client added) as one compaction item."""
        fields = await read_json(request, self.door.settings.line_limit)
        if not isinstance(fields, dict):
            raise KsiError(ErrorCode.INVALID_REQUEST, "the body must be a JSON object", fields={"body": "not an object"})
        if not isinstance(fields.get("model"), str) or not fields["model"]:
            raise _invalid("model", "a model name is required")
        unfolded = unfold(fields)
        item = await self.item(checkpoint_of(unfolded.fields))
        return JSONResponse({"id": item["id"].replace("cmp_", "resp_", 1), "object": "response.compaction",
                             "created_at": int(time.time()), "output": [item], "usage": response_usage(NO_USAGE)})

    async def triggered(self, unfolded: Unfolded) -> dict[str, Any]:
        """The Response that answers a compaction_trigger: exactly one compaction item, no model called."""
        fields = unfolded.fields
        item = await self.item(checkpoint_of(fields))
        model = fields.get("model") if isinstance(fields.get("model"), str) else self.door.settings.default_model
        previous = fields.get("previous_response_id")
        asked = Asked(instructions=fields.get("instructions") if isinstance(fields.get("instructions"), str) else None,
                      previous_response_id=ksi_id(previous) if isinstance(previous, str) else None,
                      store=fields.get("store") is not False)
        shaped = response_object(item["id"].removeprefix("cmp_"), asked, model=str(model), status="completed",
                                 created_at=int(time.time()), usage=NO_USAGE)
        return {**shaped, "output": [item]}

    async def trigger_events(self, unfolded: Unfolded) -> AsyncIterator[dict[str, Any]]:
        """A compaction_trigger's answer as the events of a stream."""
        final = await self.triggered(unfolded)
        opening = {**final, "status": "in_progress", "output": [], "completed_at": None}
        item = final["output"][0]
        for number, event in enumerate((
                {"type": "response.created", "response": opening},
                {"type": "response.in_progress", "response": opening},
                {"type": "response.output_item.added", "output_index": 0, "item": item},
                {"type": "response.output_item.done", "output_index": 0, "item": item},
                {"type": "response.completed", "response": final})):
            yield {**event, "sequence_number": number}

    async def answer_trigger(self, unfolded: Unfolded) -> Response:
        if unfolded.fields.get("stream") is True:
            return StreamingResponse((sse(event) async for event in self.trigger_events(unfolded)),
                                     media_type="text/event-stream", headers=SSE_HEADERS)
        return JSONResponse(await self.triggered(unfolded))

    async def due(self, response_id: str, tokens: int, threshold: int | None) -> bool:
        """The input of response `response_id` crossed `threshold` tokens: it reached it and the
        exchange before it did not. KSI keeps every later turn within the model's window itself,
        so a conversation is compacted once per crossing, not again at every turn above it."""
        if threshold is None or tokens < threshold:
            return False
        shown = await call(self.door.handle_request, RESPONSE_SHOW, {"response_id": response_id})
        previous = shown.get("previous_response_id")
        if not previous:
            return True
        before = await call(self.door.handle_request, RESPONSE_SHOW, {"response_id": previous})
        usage = (before.get("outcome") or {}).get("usage") or {}
        return int(usage.get("prompt_tokens") or 0) < threshold

    async def crossed(self, events: AsyncGenerator[dict[str, Any], None], threshold: int | None
                      ) -> AsyncGenerator[dict[str, Any], None]:
        """`events` of one response; when its input crossed `threshold` tokens (see due), a
        compaction item taken after it closes its output (context_management)."""
        async with contextlib.aclosing(events):  # a client that leaves ends the stream inside at once
            async for event in events:
                if threshold is None or event["type"] != "response.completed":
                    yield event
                    continue
                async for shown in self._with_item(event, threshold):
                    yield shown

    async def _with_item(self, event: dict[str, Any], threshold: int) -> AsyncIterator[dict[str, Any]]:
        """The closing event of a response, with a compaction item before it when it crossed `threshold`."""
        response = event["response"]
        tokens = (response.get("usage") or {}).get("input_tokens") or 0
        if not await self.due(ksi_id(response["id"]), tokens, threshold):
            yield event
            return
        item = await self.item(Checkpoint(ksi_id(response["id"])))
        index, number = len(response["output"]), event["sequence_number"]
        yield {"type": "response.output_item.added", "sequence_number": number, "output_index": index, "item": item}
        yield {"type": "response.output_item.done", "sequence_number": number + 1, "output_index": index, "item": item}
        yield {**event, "sequence_number": number + 2, "response": {**response, "output": [*response["output"], item]}}
