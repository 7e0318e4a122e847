"""What completion:async takes as `input` (items) and as `tools` / `tool_choice`: their shapes,
checked where they enter, and the forms the rest of the daemon keeps (see ksi_common.items)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, field_validator, model_validator

from ksi_common.errors import ErrorCode, KsiError
from ksi_common.items import Item, message, with_client_form
from ksi_daemon.events import NonBlank, Text
from ksi_daemon.services.completion.documents import is_pdf_part
from ksi_daemon.services.conversations.client_items import TOOL_NAME

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


class CacheControl(_Shape):
    """A client's prompt-cache breakpoint (Anthropic's form): the prefix up to its message is cached."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class MessageItem(_Shape):
    type: Literal["message"] = "message"
    role: Literal["user", "system"] = Field(description="user or system; history is never sent by clients")
    content: Annotated[str, Field(min_length=1)] | Annotated[list[Part], Field(min_length=1)]
    cache_control: CacheControl | None = Field(
        default=None, description="a prompt-cache breakpoint at the message's end, kept with it and sent to "
                                  "providers that take one (Anthropic's)")
    prompt_cache_breakpoint: dict[str, Any] | None = Field(
        default=None, description="OpenAI's explicit prompt-cache breakpoint at the message's end, as the client "
                                  "gave it: kept with it and sent to models that take one")
    id: str | None = None  # SDKs echo item ids; not kept


class FunctionCallOutputItem(_Shape):
    type: Literal["function_call_output"]
    call_id: Annotated[NonBlank, Field(max_length=CALL_ID_LENGTH)]
    output: Text = Field(description="the tool's result, as text (JSON text for structured results)")
    id: str | None = None
    status: str | None = None
    client_type: Literal["function_call_output", "custom_tool_call_output", "local_shell_call_output",
                         "shell_call_output"] | None = Field(
        default=None, description="the type of the output item the client sent, kept with it")
    client_output: list[Any] | dict[str, Any] | None = Field(
        default=None, description="the client's output when it was not text (a shell call's list), kept with it")


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
            out.append(with_client_form({"type": "function_call_output", "call_id": item.call_id,
                                         "output": item.output}, item.model_dump(exclude_none=True)))
        else:
            kept = message(item.role, resolve_parts(item.content, f"input.{position}.content"))
            if item.cache_control is not None:
                kept["cache_control"] = item.cache_control.model_dump(exclude_none=True)
            if item.prompt_cache_breakpoint is not None:
                kept["prompt_cache_breakpoint"] = item.prompt_cache_breakpoint
            out.append(kept)
    return out


def resolve_parts(content: str | list[Any], where: str) -> str:
    """A message's text as the exchange keeps it: its text parts joined. Its image parts and PDF
    parts are read and stored at admission (`media_parts`), kept with the message's line by
    reference; other file parts are refused by name (send a file's path in `files`)."""
    if isinstance(content, str):
        return content
    refused = {f"{where}.{n}": "only a PDF as a base64 data URL in file_data; give other files' paths in files"
               for n, part in enumerate(content) if isinstance(part, InputFile) and not is_pdf_part(part.model_dump())}
    if refused:
        raise KsiError(ErrorCode.UNSUPPORTED_PARAMETER,
                       f"{', '.join(refused)}: file parts other than a PDF (file_data: "
                       "data:application/pdf;base64,...) are not supported; give the file's path in files",
                       fields=refused)
    return "\n".join(part.text for part in content if isinstance(part, InputText))


def media_parts(inputs: list[MessageItem | FunctionCallOutputItem]) -> list[tuple[str, dict[str, Any]]]:
    """The image and PDF parts of the input's messages, each with the field that names it."""
    return [(f"input.{position}.content.{n}", part.model_dump())
            for position, item in enumerate(inputs) if isinstance(item, MessageItem) and isinstance(item.content, list)
            for n, part in enumerate(item.content) if isinstance(part, InputImage | InputFile)]


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

    def names(self) -> list[str]:
        return [self.name]

    def stored(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


class CustomTool(_Shape):
    """A tool taking free text (Codex's apply_patch), with or without a grammar; the client runs it."""

    type: Literal["custom"]
    name: Annotated[str, Field(pattern=TOOL_NAME)]
    description: str | None = None
    format: dict[str, Any] | None = None  # {"type": "text"} or {"type": "grammar", "syntax", "definition"}

    @model_validator(mode="before")
    @classmethod
    def _flatten(cls, value: Any) -> Any:
        if isinstance(value, dict) and isinstance(value.get("custom"), dict):  # the chat-completions form
            return {"type": "custom", **value["custom"]}
        return value

    def names(self) -> list[str]:
        return [self.name]

    def stored(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


class NamespaceTool(_Shape):
    """A group of function and custom tools the client runs, under one name; each keeps its own name."""

    type: Literal["namespace"]
    name: Annotated[str, Field(pattern=TOOL_NAME)]
    description: str | None = None
    tools: list[Annotated[FunctionTool | CustomTool, Field(discriminator="type")]] = Field(min_length=1, max_length=MAX_TOOLS)

    @model_validator(mode="before")
    @classmethod
    def _typed(cls, value: Any) -> Any:
        if isinstance(value, dict) and isinstance(value.get("tools"), list):
            inner = [{"type": "function", **tool} if isinstance(tool, dict) and "type" not in tool else tool
                     for tool in value["tools"]]
            return {**value, "tools": inner}
        return value

    def names(self) -> list[str]:
        return [tool.name for tool in self.tools]

    def stored(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


class ShellTool(_Shape):
    """Codex's shell forms, run by the client: `local_shell` (one command as argv) and `shell`
    (several commands); a provider is given a function of the same name."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)  # an environment the client describes
    type: Literal["local_shell", "shell"]

    @property
    def name(self) -> str:
        return self.type

    def names(self) -> list[str]:
        return [self.type]

    def stored(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


CLIENT_TOOL_TYPES = frozenset({"function", "custom", "namespace", "local_shell", "shell"})
ClientTool = FunctionTool | CustomTool | NamespaceTool | ShellTool
_TOOL_MODELS: dict[str, type[BaseModel]] = {"function": FunctionTool, "custom": CustomTool,
                                            "namespace": NamespaceTool, "local_shell": ShellTool, "shell": ShellTool}


def client_tools(value: Any) -> Any:
    """Each tool as the model of its type, errors naming `tools.N.field` (a tagged union would put
    its tag in the path); a type no client runs is refused by name (unsupported_parameter)."""
    if not isinstance(value, list):
        return value
    parsed = []
    for position, tool in enumerate(value):
        kind = tool.get("type", "function") if isinstance(tool, dict) else getattr(tool, "type", "function")
        model = _TOOL_MODELS.get(str(kind))
        if model is None:
            raise KsiError(ErrorCode.UNSUPPORTED_PARAMETER,
                           f"tools of type {kind!r} are not supported: the client runs every tool KSI passes on "
                           f"({', '.join(sorted(CLIENT_TOOL_TYPES))})",
                           fields={f"tools.{position}.type": f"type {kind!r} is not a tool the client runs"})
        try:
            parsed.append(model.model_validate(tool))
        except ValidationError as exc:
            fields = {".".join(str(p) for p in ("tools", position, *error["loc"])): error["msg"]
                      for error in exc.errors(include_url=False)}
            raise KsiError(ErrorCode.VALIDATION_ERROR, "invalid data: " + "; ".join(f"{k}: {v}" for k, v in fields.items()),
                           fields=fields) from None
    return parsed


class NamedFunction(_Shape):
    type: Literal["function", "custom"]
    name: Annotated[str, Field(pattern=TOOL_NAME)]

    @model_validator(mode="before")
    @classmethod
    def _flatten(cls, value: Any) -> Any:
        if isinstance(value, dict) and isinstance(value.get("function"), dict):
            return {"type": value.get("type"), **value["function"]}
        if isinstance(value, dict) and isinstance(value.get("custom"), dict):
            return {"type": value.get("type"), **value["custom"]}
        return value


ToolChoice = Literal["auto", "none", "required"] | NamedFunction


def checked_tools(tools: list[Any]) -> list[Any]:
    """No two tools share a name at the top level, nor two namespaces, nor two tools of one
    namespace: a call names the tool it runs (tools of two namespaces may share a name: see
    tool_kinds.provider_names)."""
    scopes: list[list[str]] = [[tool.name for tool in tools],
                               *([inner.name for inner in tool.tools] for tool in tools if isinstance(tool, NamespaceTool))]
    for names in scopes:
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(f"two tools are named {twice[0]!r}")
    return tools


def checked_choice(choice: ToolChoice | None, tools: list[Any]) -> None:
    """`tool_choice` must name one of the tools; "required" needs some."""
    why = None
    if isinstance(choice, NamedFunction) and choice.name not in {name for tool in tools for name in tool.names()}:
        why = f"names {choice.name!r}, which is not among the tools"
    elif choice == "required" and not tools:
        why = '"required" needs tools'
    if why is not None:
        raise KsiError(ErrorCode.VALIDATION_ERROR, f"tool_choice {why}", fields={"tool_choice": why})
