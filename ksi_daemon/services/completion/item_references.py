"""`item_reference` items of a client-held history or of items after a stored point: each stands
for the stored item it names, found in the response that holds it. A reference is resolved only
within the request's scope (see conversations.scope): an item of a conversation stored for
someone else is as unknown as an item never stored, so neither its existence nor its content is
shown. Every reference is resolved before anything is matched or written."""

from __future__ import annotations

from typing import Any

from ksi_common import items
from ksi_common.errors import ErrorCode, KsiError
from ksi_daemon.services.conversations.memory import ConversationCache
from ksi_daemon.services.conversations.responses import locate
from ksi_daemon.services.conversations.scope import Scope, stored_scope
from ksi_daemon.storage.ports import ResponseStore

REFERENCE = "item_reference"


def _unknown(reference: dict[str, Any], where: str) -> KsiError:
    item_id = str(reference.get("id") or "")
    return KsiError(ErrorCode.ITEM_NOT_FOUND, f"{where}: no stored item {item_id!r} this request may refer to",
                    fields={where: "no such item"}, item_id=item_id)


def _chosen(found: list[items.Item], kind: str, number: int | None, side: str) -> items.Item | None:
    """The item an id's number names, as the door numbers ids: an input item by its place among
    the inputs; a function call by its place among the calls (a response's output as created);
    another output item by its place in the output (a conversation's items), or the first of its
    kind when the id has no number."""
    def of_kind(item: items.Item | None) -> items.Item | None:
        return item if item is not None and item.get("type", "message") == kind else None

    if number is None:
        return next((item for item in found if of_kind(item)), None)
    if side == "input" or kind != "function_call":
        return of_kind(found[number]) if number < len(found) else None
    calls = items.function_calls(found)
    return calls[number] if number < len(calls) else None


class ItemReferences:
    """Resolves item references to the stored items they name."""

    def __init__(self, cache: ConversationCache, responses: ResponseStore) -> None:
        self.cache = cache
        self.responses = responses

    async def resolved(self, raw: list[Any], name: str, scope: Scope) -> list[Any]:
        """`raw` with each reference replaced by its stored item; `item_not_found` for the first
        that names none the request may see."""
        if not any(isinstance(item, dict) and item.get("type") == REFERENCE for item in raw):
            return raw
        out = []
        for position, item in enumerate(raw):
            if isinstance(item, dict) and item.get("type") == REFERENCE:
                item = await self._item(item, f"{name}.{position}", scope)
            out.append(item)
        return out

    async def check_scope(self, response_id: str, scope: Scope) -> None:
        """A response named by an item's id is one of `scope`'s: else item_not_found (a stored
        response of another scope is not shown to exist); one in no conversation is left to the
        continuation, which says previous_response_not_found."""
        try:
            found = await locate(self.cache, self.responses, response_id, ErrorCode.PREVIOUS_RESPONSE_NOT_FOUND)
        except KsiError:
            return
        if found.memory is not None and stored_scope(found.memory.meta) != scope:
            raise KsiError(ErrorCode.ITEM_NOT_FOUND, f"input: no stored item of response {response_id} this "
                           "request may refer to", fields={"input": "no such item"}, response_id=response_id)

    async def _item(self, reference: dict[str, Any], where: str, scope: Scope) -> items.Item:
        response_id = reference.get("response_id")
        if not isinstance(response_id, str):  # the door reads its ids into this form; a bare id is not it
            why = "an item_reference names its response_id (and side, kind, number)"
            raise KsiError(ErrorCode.VALIDATION_ERROR, f"{where}: {why}", fields={f"{where}.type": why})
        try:
            found = await locate(self.cache, self.responses, response_id, ErrorCode.ITEM_NOT_FOUND)
        except KsiError:
            raise _unknown(reference, where) from None
        if found.memory is None or stored_scope(found.memory.meta) != scope:
            raise _unknown(reference, where)  # failed, deleted, or another's: not to be shown
        record = found.record
        side = (items.input_items(list(record.inputs)) if reference.get("side") == "input"
                else items.output_items(record.outcome))
        number = reference.get("number")
        item = _chosen(side, str(reference.get("kind") or "message"), number if isinstance(number, int) else None,
                       str(reference.get("side")))
        if item is None:
            raise _unknown(reference, where)
        if item.get("type") == "reasoning":
            return {"type": "reasoning", "summary": str(item.get("summary") or "")}
        return dict(item)
