"""Request bodies of the OpenAI-compatible door: validated at the boundary (errors name the field),
and the source of the request schemas in /openapi.json. Fields OpenAI defines that KSI does not
use (tools, reasoning, ...) are accepted and ignored, so SDK defaults never fail a request."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, field_validator

from ksi_common.errors import ErrorCode, KsiError

Id = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")]
Metadata = dict[str, str]


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class InputText(Body):
    type: Literal["input_text", "text", "output_text"] = "input_text"
    text: str


class InputMessage(Body):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ConversationRef(Body):
    id: Id


class ResponseCreate(Body):
    """POST /v1/responses."""

    input: str | list[InputMessage]
    model: str | None = None
    instructions: str | None = None
    previous_response_id: Id | None = None
    conversation: Id | ConversationRef | None = None
    store: bool = True
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    max_output_tokens: int | None = Field(default=None, gt=0)
    metadata: Metadata | None = None

    @field_validator("input")
    @classmethod
    def _some_input(cls, value: str | list[InputMessage]) -> str | list[InputMessage]:
        if isinstance(value, list) and not value:
            raise ValueError("must hold at least one message")
        return value

    def conversation_id(self) -> str | None:
        return self.conversation.id if isinstance(self.conversation, ConversationRef) else self.conversation


class ChatMessage(Body):
    role: Literal["user", "system", "developer", "assistant", "tool"]
    content: str | list[InputText] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(Body):
    include_usage: bool = False


class ChatCompletionCreate(Body):
    """POST /v1/chat/completions; `conversation_id` and `create` are KSI's (the SDK's extra_body)."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    max_tokens: int | None = Field(default=None, gt=0)
    max_completion_tokens: int | None = Field(default=None, gt=0)
    metadata: Metadata | None = None
    conversation_id: Id | None = None
    create: bool = False


class ConversationItem(Body):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ConversationCreate(Body):
    """POST /v1/conversations."""

    items: list[ConversationItem] | None = Field(default=None, max_length=1000)
    metadata: Metadata | None = None


class ConversationUpdate(Body):
    """POST /v1/conversations/{id}."""

    metadata: Metadata


class ItemsCreate(Body):
    """POST /v1/conversations/{id}/items."""

    items: list[ConversationItem] = Field(min_length=1, max_length=1000)


def parse(model: type[Body], body: Any) -> Any:
    """`body` as `model`, or `validation_error` whose `param` names the first wrong field."""
    if not isinstance(body, dict):
        raise KsiError(ErrorCode.INVALID_REQUEST, "the body must be a JSON object", fields={"body": "not an object"})
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        found: dict[str, str] = {}
        for error in exc.errors(include_url=False):
            # union members show up as extra path parts (`input.str`, `conversation.ConversationRef`):
            # keep the field's own path
            parts = [str(p) for p in error["loc"] if not (isinstance(p, str) and _is_type_tag(p))]
            found.setdefault(".".join(parts) or "body", error["msg"])
        # the deepest path first: with a union, the member that got furthest names the real mistake
        fields = dict(sorted(found.items(), key=lambda item: -item[0].count(".")))
        raise KsiError(ErrorCode.VALIDATION_ERROR,
                       "invalid request: " + "; ".join(f"{k}: {v}" for k, v in fields.items()),
                       fields=fields) from None


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after", "constrained-str"}


def _is_type_tag(part: str) -> bool:
    return part in _TYPE_TAGS or "[" in part or part[:1].isupper()
