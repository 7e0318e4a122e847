"""The Response object of /v1/responses: every field the Responses API and the Open Responses
specification require, filled from what the request asked and what KSI answered, and response ids
in the form clients recognise (`resp_` and the KSI response id). Pure functions; no I/O."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ksi_common.errors import ErrorCode
from ksi_common.timefmt import parse_ts
from ksi_daemon.transports.http.openai.shapes import message_item

RESPONSE_PREFIX = "resp_"  # clients (LangChain's use_previous_response_id) recognise Responses ids by it

# what a sampling field was when the request left it unset: the provider's documented default
SAMPLING_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}

# the SDK types name the error codes a response may carry; KSI's own code leads the message
_ERROR_CODES = {ErrorCode.RATE_LIMITED: "rate_limit_exceeded", ErrorCode.OVERLOADED: "rate_limit_exceeded",
                ErrorCode.CONTEXT_WINDOW_EXCEEDED: "invalid_prompt", ErrorCode.VALIDATION_ERROR: "invalid_prompt",
                ErrorCode.UNSUPPORTED_PARAMETER: "invalid_prompt"}

# a KSI request's status (completion:chunks) as a Response status
_STATUSES = {"queued": "queued", "running": "in_progress", "done": "completed", "failed": "failed",
             "cancelled": "cancelled"}


def public_id(response_id: str) -> str:
    """A KSI response id as this door shows it."""
    return response_id if response_id.startswith(RESPONSE_PREFIX) else RESPONSE_PREFIX + response_id


def ksi_id(value: str) -> str:
    """The KSI response id of an id a client sent, in either form."""
    return value.removeprefix(RESPONSE_PREFIX)


def _epoch(ts: Any) -> int | None:
    if isinstance(ts, str):
        try:
            return int(parse_ts(ts))
        except ValueError:
            return None
    return int(ts) if isinstance(ts, int | float) else None


@dataclass(slots=True)
class Asked:
    """What a request asked that its Response object reports back."""

    options: dict[str, Any] = field(default_factory=dict)  # completion:async options (top_p, user, ...)
    temperature: float | None = None
    max_output_tokens: int | None = None
    instructions: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    previous_response_id: str | None = None
    background: bool = False
    store: bool = True
    truncation: str = "auto"  # KSI always fits the history to the model's window
    reasoning_summary: str | None = None
    # `include: ["reasoning.encrypted_content"]`: reasoning items carry the string a client sends back
    encrypted_reasoning: bool = False

    @classmethod
    def of_request(cls, request: dict[str, Any], background: bool) -> Asked:
        """From the request fields completion:chunks reports."""
        return cls(options=dict(request.get("options") or {}), temperature=request.get("temperature"),
                   max_output_tokens=request.get("max_tokens"), instructions=request.get("instructions"),
                   metadata=dict(request.get("metadata") or {}), background=background)

    def sampling(self, name: str) -> float:
        value = self.temperature if name == "temperature" else self.options.get(name)
        return float(value) if isinstance(value, int | float) else SAMPLING_DEFAULTS[name]

    def text(self) -> dict[str, Any]:
        """`text.format` as Responses gives it (flat), from the chat `response_format` sent."""
        verbosity = {"verbosity": self.options["verbosity"]} if self.options.get("verbosity") else {}
        fmt = self.options.get("response_format")
        if not isinstance(fmt, dict) or fmt.get("type") not in ("json_object", "json_schema"):
            return {"format": {"type": "text"}, **verbosity}
        if fmt["type"] == "json_object":
            return {"format": {"type": "json_object"}, **verbosity}
        spec = dict(fmt.get("json_schema") or {})
        return {"format": {"type": "json_schema", "name": spec.get("name"), "schema": spec.get("schema") or {},
                           "description": spec.get("description"), "strict": bool(spec.get("strict"))}, **verbosity}


def response_usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if not usage:
        return None
    tokens_in = int(usage.get("prompt_tokens") or 0)
    tokens_out = int(usage.get("completion_tokens") or 0)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    reasoning = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
    return {
        "input_tokens": tokens_in, "input_tokens_details": {"cached_tokens": int(cached), "cache_write_tokens": 0},
        "output_tokens": tokens_out, "output_tokens_details": {"reasoning_tokens": int(reasoning)},
        "total_tokens": int(usage.get("total_tokens") or tokens_in + tokens_out),
    }


def response_error(code: str, message: str) -> dict[str, Any]:
    """A KSI error as a Response's `error`: a code of the API's list, KSI's own code leading the message."""
    return {"code": _ERROR_CODES.get(code, "server_error"), "message": f"{code}: {message}"}


def response_object(
    response_id: str, asked: Asked, *, model: str, status: str, created_at: int, text: str | None = None,
    usage: dict[str, Any] | None = None, conversation_id: str | None = None, error: dict[str, Any] | None = None,
    completed_at: int | None = None, finish_reason: str | None = None,
) -> dict[str, Any]:
    """A Response object. `output` holds the assistant message once there is text (a partial one,
    `in_progress`, while the response runs); an answer cut by its token limit is `incomplete`."""
    options = asked.options
    incomplete = None
    if status == "completed" and finish_reason == "length":
        status, incomplete = "incomplete", {"reason": "max_output_tokens"}
    output = []
    if text is not None:
        item_status = status if status in ("in_progress", "incomplete") else "completed"
        output = [message_item(response_id, text, item_status)]
    effort = options.get("reasoning_effort")
    return {
        "id": public_id(response_id), "object": "response", "created_at": created_at, "status": status,
        "completed_at": (completed_at or int(time.time())) if status in ("completed", "incomplete") else None,
        "model": model, "output": output, "usage": response_usage(usage), "error": error,
        "incomplete_details": incomplete, "instructions": asked.instructions,
        "metadata": {str(k): str(v) for k, v in asked.metadata.items()},
        "previous_response_id": public_id(asked.previous_response_id) if asked.previous_response_id else None,
        "conversation": {"id": conversation_id} if conversation_id else None,
        "temperature": asked.sampling("temperature"), "top_p": asked.sampling("top_p"),
        "presence_penalty": asked.sampling("presence_penalty"),
        "frequency_penalty": asked.sampling("frequency_penalty"),
        "top_logprobs": 0,  # logprobs are refused: none are returned
        "max_output_tokens": asked.max_output_tokens, "max_tool_calls": options.get("max_tool_calls"),
        "parallel_tool_calls": False, "tool_choice": "auto", "tools": [],
        "reasoning": {"effort": effort, "summary": asked.reasoning_summary}
        if effort or asked.reasoning_summary else None,
        "text": asked.text(), "truncation": asked.truncation, "store": asked.store, "background": asked.background,
        "service_tier": options.get("service_tier") or "default", "user": options.get("user"), "safety_identifier": options.get("safety_identifier"),
        "prompt_cache_key": options.get("prompt_cache_key"),
    }


def from_record(shown: dict[str, Any]) -> dict[str, Any]:
    """A stored response (the data of response:show) as a Response object."""
    outcome = shown.get("outcome") or {}
    inputs = shown.get("inputs") or []
    first = inputs[0] if inputs else outcome
    metadata = next((line["metadata"] for line in inputs if isinstance(line.get("metadata"), dict)), {})
    completed = shown["status"] == "completed"
    status = "completed" if completed else "cancelled" if outcome.get("code") == ErrorCode.CANCELLED else "failed"
    error = None
    if status == "failed":
        error = response_error(outcome.get("code") or "incomplete",
                               outcome.get("message") or "the response has no outcome")
    asked = Asked(instructions=outcome.get("instructions"), metadata=metadata,
                  previous_response_id=shown.get("previous_response_id"))
    created = _epoch(first.get("ts")) or int(time.time())
    return response_object(
        shown["response_id"], asked, model=str(outcome.get("model") or ""), status=status, created_at=created,
        text=str(outcome.get("content") or "") if completed else None, usage=outcome.get("usage"),
        conversation_id=shown.get("conversation_id"), error=error, completed_at=_epoch(outcome.get("ts")),
        finish_reason=outcome.get("finish_reason"),
    )


def from_chunks(view: dict[str, Any]) -> dict[str, Any]:
    """A background response as completion:chunks reports it (read from its start), as a Response object."""
    status = _STATUSES.get(view["status"], "in_progress")
    result, error = view.get("result") or {}, view.get("error")
    text = None
    if status == "completed":
        text = str(result.get("content") or "")
    elif status == "in_progress" and view["chunks"]:
        text = "".join(view["chunks"])
    shown_error = None
    if status == "failed" and error is not None:
        shown_error = response_error(error.get("code") or ErrorCode.INTERNAL_ERROR, error.get("message") or "")
    return response_object(
        view["response_id"], Asked.of_request(view["request"], background=True), model=view["model"],
        status=status, created_at=int(view["created"]), text=text, usage=result.get("usage"),
        conversation_id=view["conversation_id"], error=shown_error,
        completed_at=int(view["ended"]) if view.get("ended") else None, finish_reason=result.get("finish_reason"),
    )
