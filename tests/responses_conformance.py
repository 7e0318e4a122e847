"""Checks of what /v1/responses sends against the official `openai` SDK's types (the Response model
and the ResponseStreamEvent union, validated, not merely constructed) and the Open Responses
specification's response object (its required fields; `openresponses-types` is not on the
package registry, so its required list is written out here)."""

from __future__ import annotations

from typing import Any

from openai.types.conversations import Conversation, ConversationItemList
from openai.types.responses import Response, ResponseItem, ResponseStreamEvent
from pydantic import TypeAdapter

STREAM_EVENT: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
RESPONSE_ITEM: TypeAdapter[Any] = TypeAdapter(ResponseItem)

# the Open Responses ResponseResource's required fields
SPEC_REQUIRED = (
    "id", "object", "created_at", "completed_at", "status", "incomplete_details", "model", "previous_response_id",
    "instructions", "output", "error", "tools", "tool_choice", "truncation", "parallel_tool_calls", "text", "top_p",
    "presence_penalty", "frequency_penalty", "top_logprobs", "temperature", "reasoning", "user", "usage",
    "max_output_tokens", "max_tool_calls", "store", "background", "service_tier", "metadata", "safety_identifier",
    "prompt_cache_key",
)
# of those, the ones the specification types without null
SPEC_NOT_NULL = ("id", "object", "created_at", "status", "model", "output", "tools", "tool_choice", "truncation",
                 "parallel_tool_calls", "text", "top_p", "presence_penalty", "frequency_penalty", "top_logprobs",
                 "temperature", "store", "background", "service_tier", "metadata")


def conforming_response(data: dict[str, Any]) -> Response:
    """`data` (a Response object as sent) checked against the specification and the SDK type."""
    missing = [name for name in SPEC_REQUIRED if name not in data]
    assert not missing, f"required fields missing: {missing}"
    null = [name for name in SPEC_NOT_NULL if data[name] is None]
    assert not null, f"fields that must not be null: {null}"
    assert data["id"].startswith("resp_")
    return Response.model_validate(data)


def conforming_event(data: dict[str, Any]) -> Any:
    """One stream event as sent, checked against the SDK's event union (and its Response, if any)."""
    assert isinstance(data.get("sequence_number"), int)
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
