"""Checks of what /v1/responses sends against the official `openai` SDK's types (the Response model
and the ResponseStreamEvent union, validated, not merely constructed) and the Open Responses
specification's types (`openresponses-types`: its ResponseResource and one model per streaming
event, generated from the specification's published OpenAPI document)."""

from __future__ import annotations

import enum
from typing import Any

import openresponses_types as spec
from openai.types.conversations import Conversation, ConversationItemList
from openai.types.responses import Response, ResponseItem, ResponseStreamEvent
from pydantic import BaseModel, TypeAdapter

STREAM_EVENT: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
RESPONSE_ITEM: TypeAdapter[Any] = TypeAdapter(ResponseItem)


def _spec_events() -> dict[str, type[BaseModel]]:
    """The specification's streaming event models by the `type` each one fixes."""
    events: dict[str, type[BaseModel]] = {}
    for name in dir(spec):
        model = getattr(spec, name)
        if name.endswith("StreamingEvent") and isinstance(model, type) and issubclass(model, BaseModel):
            kind = model.model_fields["type"].annotation
            assert isinstance(kind, type) and issubclass(kind, enum.Enum)
            events.update({member.value: model for member in kind})
    return events


SPEC_EVENTS = _spec_events()


def conforming_response(data: dict[str, Any]) -> Response:
    """`data` (a Response object as sent) checked against the specification and the SDK type."""
    assert data["id"].startswith("resp_")
    spec.ResponseResource.model_validate(_spec_view(data))
    return Response.model_validate(data)


def _spec_view(data: dict[str, Any]) -> dict[str, Any]:
    """`data` as the specification's types read it. Their generated `text.format` of type
    json_schema takes only null as `schema`, where the openai SDK's requires the schema object
    (which the door echoes, as OpenAI does): that one field is checked by the SDK's type alone."""
    text_format = (data.get("text") or {}).get("format") or {}
    if text_format.get("type") != "json_schema":
        return data
    assert isinstance(text_format.get("schema"), dict)
    return {**data, "text": {**data["text"], "format": {**text_format, "schema": None}}}


def conforming_event(data: dict[str, Any]) -> Any:
    """One stream event as sent, checked against the SDK's event union (and its Response, if any)."""
    assert isinstance(data.get("sequence_number"), int)
    assert data["type"] in SPEC_EVENTS, f"{data['type']} is not an Open Responses streaming event"
    SPEC_EVENTS[data["type"]].model_validate(data)
    if "response" in data:
        conforming_response(data["response"])
    return STREAM_EVENT.validate_python(data)


def conforming_events(events: list[Any]) -> list[dict[str, Any]]:
    """SDK stream events (as the SDK built them from what was sent) checked one by one; their data."""
    sent = [event.to_dict() for event in events]
    for data in sent:
        conforming_event(data)
    return sent


def conforming_conversation(data: dict[str, Any]) -> Conversation:
    return Conversation.model_validate(data)


def conforming_conversation_items(data: dict[str, Any]) -> ConversationItemList:
    """A page of conversation items as sent (`GET`/`POST .../items`), checked against the SDK type."""
    return ConversationItemList.model_validate(data)


def conforming_input_items(data: dict[str, Any]) -> list[Any]:
    """A page of a response's input items as sent, each checked against the SDK's item union."""
    assert data["object"] == "list"
    return [RESPONSE_ITEM.validate_python(item) for item in data["data"]]


def conforming_ws_error(data: dict[str, Any]) -> dict[str, Any]:
    """A WebSocket `error` frame as sent, checked against the specification's WebSocketErrorEvent."""
    spec.WebSocketErrorEvent.model_validate(data)
    assert isinstance(data["error"]["code"], str) and data["status"] >= 400
    return data


def conforming_compacted(data: dict[str, Any]) -> dict[str, Any]:
    """A POST /v1/responses/compact answer as sent, checked against the specification's CompactResource."""
    spec.CompactResource.model_validate(data)
    return data


def conforming_ws_request(frame: dict[str, Any]) -> dict[str, Any]:
    """A client's `response.create` frame checked against the specification's
    WebSocketResponseCreateEvent (so the scenarios speak as a conforming client does)."""
    spec.WebSocketResponseCreateEvent.model_validate(frame)
    return frame
