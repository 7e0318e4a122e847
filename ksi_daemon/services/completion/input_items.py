"""What completion:async takes as `input` (items) and as `tools` / `tool_choice`: their shapes,
checked where they enter, and the forms the rest of the daemon keeps (see ksi_common.items)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from ksi_common.errors import ErrorCode, KsiError
from ksi_common.items import Item, message
from ksi_daemon.events import NonBlank, Text

TOOL_NAME = r"^[a-zA-Z0-9_-]{1,64}$"
CALL_ID_LENGTH = 256
MAX_TOOLS = 128


class _Shape(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class InputText(_Shape):
    type: Literal["input_text"]
    text: Text


class InputImage(BaseModel):
    """An image part; its fields are the images module's to read (a URL, a data URL, a path)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["input_image"]


class InputFile(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["input_file"]


Part = Annotated[InputText | InputImage | InputFile, Field(discriminator="type")]


class MessageItem(_Shape):
    type: Literal["message"] = "message"
    role: Literal["user", "system"] = Field(description="user or system; history is never sent by clients")
    content: Annotated[str, Field(min_length=1)] | Annotated[list[Part], Field(min_length=1)]
    id: str | None = None  # SDKs echo item ids; not kept


class FunctionCallOutputItem(_Shape):
    type: Literal["function_call_output"]
    call_id: Annotated[NonBlank, Field(max_length=CALL_ID_LENGTH)]
    output: Text = Field(description="the tool's result, as text (JSON text for structured results)")
    id: str | None = None
    status: str | None = None


def _item_kind(value: Any) -> str:
    if isinstance(value, dict):
        return str(value.get("type") or "message")  # a Responses message may leave its type out
    return str(getattr(value, "type", "message"))


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(_item_kind),
]


def items_of(inputs: list[MessageItem | FunctionCallOutputItem]) -> list[Item]:
    """The request's input items in the stored form (text parts of a message joined; image and
    file parts are resolved by `resolve_parts`)."""
    out: list[Item] = []
    for position, item in enumerate(inputs):
        if isinstance(item, FunctionCallOutputItem):
            out.append({"type": "function_call_output", "call_id": item.call_id, "output": item.output})
        else:
            out.append(message(item.role, resolve_parts(item.content, f"input.{position}.content")))
    return out


def resolve_parts(content: str | list[Any], where: str) -> str:
    """A message's content as the exchange keeps it. Text parts are joined; image and file parts
    need stored bytes, which this version does not keep yet, so they are refused by name."""
    if isinstance(content, str):
        return content
    refused = {f"{where}.{n}": "image and file parts are not supported yet"
               for n, part in enumerate(content) if not isinstance(part, InputText)}
    if refused:
        raise KsiError(ErrorCode.UNSUPPORTED_PARAMETER,
                       f"{', '.join(refused)}: image and file parts are not supported yet; send text",
                       fields=refused)
    return "\n".join(part.text for part in content)


class FunctionTool(_Shape):
    """A function the model may call, in the Responses form; the chat-completions form
    (`{"type": "function", "function": {...}}`) is taken too and normalised to this."""

    type: Literal["function"] = "function"
    name: Annotated[str, Field(pattern=TOOL_NAME)]
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _flatten(cls, value: Any) -> Any:
        if isinstance(value, dict) and value.get("type", "function") != "function":
            raise KsiError(ErrorCode.UNSUPPORTED_PARAMETER,
                           f"tools of type {value.get('type')!r} are not supported: only function tools",
                           fields={"tools": f"type {value.get('type')!r} is not a function tool"})
        if isinstance(value, dict) and isinstance(value.get("function"), dict):
            return {"type": "function", **value["function"]}
        return value

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, value: dict[str, Any]) -> dict[str, Any]:
        if value.get("type") != "object":
            raise ValueError('must be a JSON schema of an object ({"type": "object", ...})')
        if not isinstance(value.get("properties", {}), dict):
            raise ValueError("properties must be an object")
        return value

    def stored(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


class NamedFunction(_Shape):
    type: Literal["function"]
    name: Annotated[str, Field(pattern=TOOL_NAME)]

    @model_validator(mode="before")
    @classmethod
    def _flatten(cls, value: Any) -> Any:
        if isinstance(value, dict) and isinstance(value.get("function"), dict):
            return {"type": value.get("type"), **value["function"]}
        return value


ToolChoice = Literal["auto", "none", "required"] | NamedFunction


def checked_tools(tools: list[FunctionTool]) -> list[FunctionTool]:
    seen: set[str] = set()
    for tool in tools:
        if tool.name in seen:
            raise ValueError(f"two tools are named {tool.name!r}")
        seen.add(tool.name)
    return tools


def checked_choice(choice: ToolChoice | None, tools: list[FunctionTool]) -> None:
    """`tool_choice` must name one of the tools; "required" needs some."""
    why = None
    if isinstance(choice, NamedFunction) and choice.name not in {tool.name for tool in tools}:
        why = f"names {choice.name!r}, which is not among the tools"
    elif choice == "required" and not tools:
        why = '"required" needs tools'
    if why is not None:
        raise KsiError(ErrorCode.VALIDATION_ERROR, f"tool_choice {why}", fields={"tool_choice": why})
