"""The OpenAPI document of the OpenAI-compatible door: request schemas come from the same models
that validate the requests; reply schemas state the fields every reply carries."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic.json_schema import models_json_schema

from ksi_common import __version__
from ksi_daemon.transports.http.openai.schemas import (
    ChatCompletionCreate,
    ConversationCreate,
    ConversationUpdate,
    ItemsCreate,
    ResponseCreate,
)

_ERROR = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": "string"},
                       "details": {"type": "object"}},
    }},
}
_TEXT = {"type": "object", "required": ["type", "text"],
         "properties": {"type": {"type": "string"}, "text": {"type": "string"}}}
_MESSAGE = {"type": "object", "required": ["type", "id", "role", "content"],
            "properties": {"type": {"const": "message"}, "id": {"type": "string"}, "status": {"type": "string"},
                           "role": {"enum": ["user", "system", "assistant"]},
                           "content": {"type": "array", "items": _TEXT}}}
_FUNCTION_CALL = {"type": "object", "required": ["type", "id", "call_id", "name", "arguments"],
                  "properties": {"type": {"const": "function_call"}, "id": {"type": "string"},
                                 "call_id": {"type": "string"}, "name": {"type": "string"},
                                 "arguments": {"type": "string"}, "status": {"type": "string"}}}
_REASONING = {"type": "object", "required": ["type", "id", "summary"],
              "properties": {"type": {"const": "reasoning"}, "id": {"type": "string"},
                             "summary": {"type": "array", "items": _TEXT}}}
_CALL_OUTPUT = {"type": "object", "required": ["type", "id", "call_id", "output"],
                "properties": {"type": {"const": "function_call_output"}, "id": {"type": "string"},
                               "call_id": {"type": "string"}, "output": {"type": "string"},
                               "status": {"type": "string"}}}
_COMPACTION = {"type": "object", "required": ["type", "id", "encrypted_content"],
               "properties": {"type": {"const": "compaction"}, "id": {"type": "string"},
                              "encrypted_content": {"type": "string", "description": "readable JSON: the "
                                                    "conversation and response it stands for, KSI's summaries "
                                                    "and pins, the items carried after them"},
                              "created_by": {"type": ["string", "null"]}}}
_COMPACT_BODY = {"type": "object", "required": ["model"],
                 "properties": {"model": {"type": "string", "minLength": 1},
                                "input": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]},
                                "previous_response_id": {"type": "string"}, "instructions": {"type": "string"},
                                "prompt_cache_key": {"type": "string"}}}
_COMPACTED = {"type": "object", "required": ["id", "object", "created_at", "output", "usage"],
              "properties": {"id": {"type": "string"}, "object": {"const": "response.compaction"},
                             "created_at": {"type": "integer"}, "output": {"type": "array", "items": _COMPACTION},
                             "usage": {"type": "object"}}}
_RESPONSE = {
    "type": "object", "required": ["id", "object", "created_at", "status", "model", "output"],
    "properties": {
        "id": {"type": "string"}, "object": {"const": "response"}, "created_at": {"type": "integer"},
        "status": {"enum": ["completed", "incomplete", "failed", "cancelled", "in_progress", "queued"]},
        "model": {"type": "string"}, "background": {"type": "boolean"},
        "output": {"type": "array", "items": {"anyOf": [_MESSAGE, _FUNCTION_CALL, _REASONING, _COMPACTION]}},
        "usage": {"type": ["object", "null"]}, "error": {"type": ["object", "null"]},
        "previous_response_id": {"type": ["string", "null"]}, "instructions": {"type": ["string", "null"]},
        "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
        "conversation": {"type": ["object", "null"], "properties": {"id": {"type": "string"}}},
    },
}
_CONVERSATION = {"type": "object", "required": ["id", "object", "created_at", "metadata"],
                 "properties": {"id": {"type": "string"}, "object": {"const": "conversation"},
                                "created_at": {"type": "integer"},
                                "metadata": {"type": "object", "additionalProperties": {"type": "string"}}}}
_DELETED = {"type": "object", "required": ["id", "object", "deleted"],
            "properties": {"id": {"type": "string"}, "object": {"type": "string"}, "deleted": {"type": "boolean"}}}


def _list(items: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "required": ["object", "data", "has_more"],
            "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": items},
                           "first_id": {"type": ["string", "null"]}, "last_id": {"type": ["string", "null"]},
                           "has_more": {"type": "boolean"}}}


_MODELS = {"type": "object", "required": ["object", "data"],
           "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": {
               "type": "object", "required": ["id", "object", "created", "owned_by"],
               "properties": {"id": {"type": "string"}, "object": {"const": "model"},
                              "created": {"type": "integer"}, "owned_by": {"type": "string"}}}}}}
_CHAT = {"type": "object", "required": ["id", "object", "created", "model", "choices", "conversation_id"],
         "properties": {"id": {"type": "string"}, "object": {"const": "chat.completion"},
                        "created": {"type": "integer"}, "model": {"type": "string"},
                        "conversation_id": {"type": "string"}, "response_id": {"type": "string"},
                        "choices": {"type": "array", "items": {"type": "object"}}, "usage": {"type": "object"}}}

_STATUS_TEXT = {400: "invalid request, body or field (the field is named in `param`)", 401: "missing or wrong token",
                404: "no such response, conversation, agent or model", 409: "conflict with the current state",
                413: "body over the size limit", 429: "overloaded or rate limited; see Retry-After",
                500: "internal error", 502: "the provider failed", 503: "unavailable or shutting down",
                504: "the provider did not answer in time"}


def _json(schema: dict[str, Any], description: str = "OK") -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(*statuses: int) -> dict[str, Any]:
    replies: dict[str, Any] = {}
    for status in (400, 401, *statuses):
        reply = _json({"$ref": "#/components/schemas/Error"}, _STATUS_TEXT[status])
        if status == 429:
            reply["headers"] = {"Retry-After": {"schema": {"type": "string"}, "description": "seconds"}}
        replies[str(status)] = reply
    return replies


_ID = [{"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}]
_PAGE = [{"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 100}},
         {"name": "order", "in": "query", "schema": {"enum": ["asc", "desc"]}},
         {"name": "after", "in": "query", "schema": {"type": "string"}}]
_RESUME = [{"name": "stream", "in": "query", "schema": {"type": "boolean"}},
           {"name": "starting_after", "in": "query", "schema": {"type": "integer", "minimum": 0}}]
_COMPLETION_ERRORS = (404, 409, 413, 429, 500, 502, 503, 504)


Body = Callable[[type], dict[str, Any]]  # a request body of a pydantic model, by its schema's ref
_STREAM = {"text/event-stream": {"schema": {"type": "string"}}}
_RESPONSE_REF = {"$ref": "#/components/schemas/Response"}
_CONVERSATION_REF = {"$ref": "#/components/schemas/Conversation"}


def openapi_document() -> dict[str, Any]:
    """The document served at /openapi.json."""
    models = [(m, "validation") for m in (ResponseCreate, ChatCompletionCreate, ConversationCreate, ConversationUpdate,
                                          ItemsCreate)]
    refs, definitions = models_json_schema(models, ref_template="#/components/schemas/{model}")
    schemas: dict[str, Any] = dict(definitions.get("$defs", {}))
    schemas.update({"Error": _ERROR, "Response": _RESPONSE, "Conversation": _CONVERSATION})

    def body(model: type) -> dict[str, Any]:
        return {"required": True, "content": {"application/json": {"schema": refs[(model, "validation")]}}}

    paths = {**_responses_paths(body), **_chat_paths(body), **_conversations_paths(body)}
    return {
        "openapi": "3.1.0",
        "info": {"title": "KSI OpenAI-compatible API", "version": __version__,
                 "description": "Responses, Conversations and Chat Completions over KSI conversations. "
                                "Every request needs `Authorization: Bearer <token>` (`ksi http token`)."},
        "components": {"schemas": schemas,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}],
        "paths": paths,
    }


def _responses_paths(body: Body) -> dict[str, Any]:
    return {
    "/v1/models": {"get": {"operationId": "listModels", "responses": {"200": _json(_MODELS), **_errors()}}},
    "/v1/responses": {"post": {
        "operationId": "createResponse", "requestBody": body(ResponseCreate),
        "responses": {"200": {"description": "the response; server-sent events with stream: true",
                              "content": {"application/json": {"schema": _RESPONSE_REF}, **_STREAM}},
                      **_errors(*_COMPLETION_ERRORS)}}},
    "/v1/responses/compact": {"post": {
        "operationId": "compactResponse", "requestBody": {"required": True, "content": {
            "application/json": {"schema": _COMPACT_BODY}}},
        "description": "The context (previous_response_id, or the items this door returned) as one compaction "
                       "item; no model is called and nothing is stored.",
        "responses": {"200": _json(_COMPACTED), **_errors(404, 413)}}},
    "/v1/responses/{id}": {
        "parameters": _ID,
        "get": {"operationId": "getResponse", "parameters": _RESUME,
                "description": "With stream=true, a background response's events after starting_after.",
                "responses": {"200": {"description": "the response; server-sent events with stream=true",
                                      "content": {"application/json": {"schema": _RESPONSE_REF}, **_STREAM}},
                              **_errors(404)}},
        "delete": {"operationId": "deleteResponse", "description":
                   "Refused (409): a response stays while its conversation does; delete the conversation.",
                   "responses": {"200": _json(_DELETED), **_errors(404, 409)}},
    },
    "/v1/responses/{id}/cancel": {"post": {
        "operationId": "cancelResponse", "parameters": _ID,
        "description": "Cancel a background response that is queued or running (409 once it ended).",
        "responses": {"200": _json(_RESPONSE_REF), **_errors(404, 409)}}},
    "/v1/responses/{id}/input_items": {"get": {
        "operationId": "listInputItems", "parameters": _ID + _PAGE,
        "responses": {"200": _json(_list({"anyOf": [_MESSAGE, _CALL_OUTPUT]})), **_errors(404)}}},
    }


def _chat_paths(body: Body) -> dict[str, Any]:
    return {
    "/v1/chat/completions": {"post": {
        "operationId": "createChatCompletion", "requestBody": body(ChatCompletionCreate),
        "parameters": [{"name": "X-KSI-Conversation-Id", "in": "header", "schema": {"type": "string"}}],
        "responses": {"200": {"description": "the completion; server-sent events with stream: true",
                              "content": {"application/json": {"schema": _CHAT}, **_STREAM}},
                      **_errors(*_COMPLETION_ERRORS)}}},
    }


def _conversations_paths(body: Body) -> dict[str, Any]:
    return {
    "/v1/conversations": {"post": {
        "operationId": "createConversation", "requestBody": body(ConversationCreate),
        "responses": {"200": _json(_CONVERSATION_REF), **_errors(413, 429)}}},
    "/v1/conversations/{id}": {
        "parameters": _ID,
        "get": {"operationId": "getConversation", "responses": {"200": _json(_CONVERSATION_REF), **_errors(404)}},
        "post": {"operationId": "updateConversation", "requestBody": body(ConversationUpdate),
                 "responses": {"200": _json(_CONVERSATION_REF), **_errors(404, 413)}},
        "delete": {"operationId": "deleteConversation", "responses": {"200": _json(_DELETED), **_errors(404)}},
    },
    "/v1/conversations/{id}/items": {
        "parameters": _ID,
        "get": {"operationId": "listConversationItems", "parameters": _PAGE,
                "responses": {"200": _json(_list(_MESSAGE)), **_errors(404)}},
        "post": {"operationId": "createConversationItems", "requestBody": body(ItemsCreate),
                 "description": "Items are exchanges (user messages each followed by the assistant reply); user "
                                "messages with no reply after them wait for the next response.",
                 "responses": {"200": _json(_list(_MESSAGE)), **_errors(404, 409, 413)}}},
    }
