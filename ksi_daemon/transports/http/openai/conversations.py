"""/v1/conversations: a Conversations API id is the KSI conversation id, so the same conversation
continues from the CLI, an agent or the MCP server."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ksi_common.errors import ErrorCode, KsiError
from ksi_common.events import (
    CONVERSATION_APPEND,
    CONVERSATION_DELETE,
    CONVERSATION_IMPORT,
    CONVERSATION_SHOW,
    CONVERSATION_UPDATE,
)
from ksi_daemon.transports.http.door import call
from ksi_daemon.transports.http.openai import shapes
from ksi_daemon.transports.http.openai.lists import list_page
from ksi_daemon.transports.http.openai.schemas import (
    AnyConversationItem,
    ConversationCreate,
    ConversationItem,
    ConversationToolItem,
    ConversationUpdate,
    ItemsCreate,
)
from ksi_daemon.transports.http.openai.translate import Door, renamed


@dataclass(slots=True)
class Items:
    document: dict[str, Any]  # a conversation export: system items, then the exchanges the items make
    pending: list[str]  # the user messages after the last reply: they wait for the next response
    reply_to_held: str | None = None  # an assistant item first: the reply to the messages already waiting


def items_document(items: list[ConversationItem], *, may_answer_held: bool = False) -> Items:
    """Items as a conversation export (system items first, then user messages each followed by the
    assistant reply) and the user messages after the last reply, which wait, as the conversation's
    pending input, for the next response. With `may_answer_held`, an assistant item before any user
    item answers the messages the conversation already holds (a client that keeps its own session
    adds the user's item, asks elsewhere, then adds the answer)."""
    system: list[str] = []
    exchanges: list[dict[str, Any]] = []
    pending: list[str] = []
    reply_to_held = None
    for position, item in enumerate(items):
        text = item.text(f"items.{position}.content")
        if item.role in ("system", "developer"):
            if exchanges or pending:
                raise KsiError(ErrorCode.VALIDATION_ERROR, "system items must come before the first user item",
                               fields={f"items.{position}.role": "system items come first"})
            system.append(text)
        elif item.role == "user":
            pending.append(text)
        elif not pending and may_answer_held and position == 0:
            reply_to_held = text
        elif not pending:
            raise KsiError(ErrorCode.VALIDATION_ERROR, "an assistant item must follow a user item",
                           fields={f"items.{position}.role": "no user item before it"})
        else:
            exchanges.append({"inputs": [{"type": "user", "content": t} for t in pending], "reply": {"content": text}})
            pending = []
    for position, text in enumerate(pending, start=len(items) - len(pending)):
        if not text.strip():
            raise KsiError(ErrorCode.VALIDATION_ERROR, f"items.{position}.content is empty",
                           fields={f"items.{position}.content": "must not be empty"})
    document = {"format": "ksi.conversation", "v": 1,
                "conversation": {"system": "\n\n".join(system) if system else None}, "exchanges": exchanges}
    return Items(document, pending, reply_to_held)


def has_tool_items(items: list[AnyConversationItem]) -> bool:
    return any(isinstance(item, ConversationToolItem) for item in items)


def event_items(items: list[AnyConversationItem]) -> list[dict[str, Any]]:
    """Items of any type as conversation:append's `items` (a developer message is a system one)."""
    found = []
    for position, item in enumerate(items):
        if isinstance(item, ConversationToolItem):
            found.append(item.event_item(f"items.{position}"))
        else:
            role = "system" if item.role == "developer" else item.role
            found.append({"type": "message", "role": role, "content": item.text(f"items.{position}.content")})
    return found


class Conversations:
    def __init__(self, door: Door) -> None:
        self.door = door

    async def _add_any(self, conversation_id: str, items: list[AnyConversationItem]) -> list[dict[str, Any]]:
        """Items with tool turns among them: those the conversation holds already (a session adding
        a run's items its responses stored) are not added again; the added ones are listed."""
        appended = await call(self.door.handle_request, CONVERSATION_APPEND,
                              {"conversation_id": conversation_id, "items": event_items(items)})
        shown = await call(self.door.handle_request, CONVERSATION_SHOW, {"conversation_id": conversation_id})
        added = [e for e in shown["exchanges"] if e.get("n") in appended["exchanges"]]
        listed = shapes.conversation_items(conversation_id, added)
        waiting = 0  # the items after the last output item: they wait for the next response
        for item in reversed(items):
            if isinstance(item, ConversationItem) and item.role == "assistant" or \
                    isinstance(item, ConversationToolItem) and item.type != "function_call_output":
                break
            waiting += 1
        pending = shapes.pending_items(shown["conversation"])
        return listed + (pending[max(len(pending) - waiting, 0):] if waiting else [])

    async def _summary(self, conversation_id: str) -> dict[str, Any]:
        shown = await call(self.door.handle_request, CONVERSATION_SHOW,
                           {"conversation_id": conversation_id, "limit": 1})
        return shown["conversation"]

    async def create(self, request: Request) -> Response:
        body: ConversationCreate = await self.door.body(request, ConversationCreate)
        if body.items and has_tool_items(body.items):
            return await self._create_with_tool_items(body)
        made = items_document(body.items or [])  # type: ignore[arg-type]
        # one event: its exchanges, the items waiting for a reply and the metadata in one write
        imported = await call(self.door.handle_request, CONVERSATION_IMPORT,
                              {"data": made.document, "format": "json", "origin": "http", "pending": made.pending,
                               "metadata": body.metadata or None})
        return JSONResponse(shapes.conversation_object(await self._summary(imported["conversation_id"])))

    async def _create_with_tool_items(self, body: ConversationCreate) -> Response:
        """A conversation made with tool items: made empty, then given them; refused items leave
        none behind (it is deleted)."""
        assert body.items is not None
        system = [item for item in body.items if isinstance(item, ConversationItem)
                  and item.role in ("system", "developer")]
        opening = items_document(system)  # system items first, as without tool items
        imported = await call(self.door.handle_request, CONVERSATION_IMPORT,
                              {"data": opening.document, "format": "json", "origin": "http",
                               "metadata": body.metadata or None})
        conversation_id = imported["conversation_id"]
        try:
            await self._add_any(conversation_id, body.items[len(system):])
        except KsiError:
            await call(self.door.handle_request, CONVERSATION_DELETE, {"conversation_id": conversation_id})
            raise
        return JSONResponse(shapes.conversation_object(await self._summary(conversation_id)))

    async def retrieve(self, request: Request) -> Response:
        return JSONResponse(shapes.conversation_object(await self._summary(request.path_params["id"])))

    async def update(self, request: Request) -> Response:
        body: ConversationUpdate = await self.door.body(request, ConversationUpdate)
        conversation_id = request.path_params["id"]
        metadata = dict(body.metadata)
        data: dict[str, Any] = {"conversation_id": conversation_id, "metadata": metadata}
        if shapes.PINS_KEY in metadata:  # one event: refused pins leave the metadata as it was
            data["pins"] = sorted(shapes.pins_field(metadata.pop(shapes.PINS_KEY)))
        reply = await call(self.door.handle_request, CONVERSATION_UPDATE, data)
        return JSONResponse(shapes.conversation_object(reply["conversation"]))

    async def delete(self, request: Request) -> Response:
        reply = await call(self.door.handle_request, CONVERSATION_DELETE, {"conversation_id": request.path_params["id"]})
        return JSONResponse({"id": reply["conversation_id"], "object": "conversation.deleted", "deleted": True})

    async def list_items(self, request: Request) -> Response:
        conversation_id = request.path_params["id"]
        shown = await call(self.door.handle_request, CONVERSATION_SHOW, {"conversation_id": conversation_id})
        items = [*shapes.conversation_items(conversation_id, shown["exchanges"]),
                 *shapes.pending_items(shown["conversation"])]
        return JSONResponse(list_page(items, request))

    async def add_items(self, request: Request) -> Response:
        """New items are exchanges a client already has (user messages each followed by the reply),
        then user messages that wait for the next response."""
        body: ItemsCreate = await self.door.body(request, ItemsCreate)
        if has_tool_items(body.items):
            listed = await self._add_any(request.path_params["id"], body.items)
            return JSONResponse({"object": "list", "data": listed, "first_id": listed[0]["id"] if listed else None,
                                 "last_id": listed[-1]["id"] if listed else None, "has_more": False})
        made = items_document(body.items, may_answer_held=True)  # type: ignore[arg-type]
        document, pending = made.document, made.pending
        if document["conversation"]["system"] is not None:
            position = next(i for i, item in enumerate(body.items) if item.role in ("system", "developer"))
            raise KsiError(ErrorCode.VALIDATION_ERROR, "system items can only start a conversation",
                           fields={f"items.{position}.role": "no system items in an existing conversation"})
        conversation_id = request.path_params["id"]
        exchanges = [{"inputs": [line["content"] for line in exchange["inputs"]],
                      "reply": exchange["reply"]["content"]} for exchange in document["exchanges"]]
        try:  # one event: the exchanges and the items waiting for a reply are added whole, or not at all
            appended = await call(self.door.handle_request, CONVERSATION_APPEND,
                                  {"conversation_id": conversation_id, "exchanges": exchanges,
                                   "reply_to_pending": made.reply_to_held, "pending": pending})
        except KsiError as error:
            raise renamed(error, {"reply_to_pending": "items.0", "pending": "items"}) from None
        numbers: list[int] = appended["exchanges"]
        shown = await call(self.door.handle_request, CONVERSATION_SHOW, {"conversation_id": conversation_id})
        added = [e for e in shown["exchanges"] if e.get("n") in numbers]
        items = shapes.conversation_items(conversation_id, added)
        if made.reply_to_held is not None:  # its inputs were listed already, as the waiting messages
            items = items[len(added[0].get("inputs") or []):]
        waiting = shapes.pending_items(shown["conversation"])
        items += waiting[len(waiting) - len(pending):] if pending else []
        return JSONResponse({"object": "list", "data": items, "first_id": items[0]["id"], "last_id": items[-1]["id"],
                             "has_more": False})
