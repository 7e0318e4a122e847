"""Request bodies of the OpenAI-compatible door: validated at the boundary (errors name the field),
and the source of the request schemas in /openapi.json. Nothing a client asks is dropped: a field
is mapped onto completion:async (the sampling/format ones onto its `options`, see
ksi_daemon/providers/options.py), or shapes only KSI's own answer and is honoured here (each says
why it is not passed on), or is refused with `unsupported_parameter` naming it (hosted tools,
n > 1, logprobs, audio parts, files by id, ...). A field this door does not declare goes to the provider by name, as
the socket's `options` do; values an SDK sends by default (`tools: []`, `n: 1`) ask for nothing and
pass."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, field_validator, model_validator

from ksi_common.errors import ErrorCode, KsiError

PDF_DATA_PREFIX = "data:application/pdf;base64,"

Id = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")]
Metadata = dict[str, str]


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class Marked(Body):
    """A content part that may carry the client's own OpenAI prompt-cache breakpoint: kept with its
    message and sent to a model that takes one (see message_breakpoint)."""

    prompt_cache_breakpoint: dict[str, Any] | None = None


class InputText(Marked):
    type: Literal["input_text", "text", "output_text"] = "input_text"
    text: str


class InputImagePart(Marked):
    """A Responses `input_image` part: an https URL or a data URL, given to completion:async as its
    image part (`file_id`, a provider's file store, is refused there by name)."""

    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: Literal["auto", "low", "high"] | None = None

    def event_part(self) -> dict[str, Any]:
        part: dict[str, Any] = {"type": "input_image"}
        for key, value in (("image_url", self.image_url), ("file_id", self.file_id), ("detail", self.detail)):
            if value is not None:
                part[key] = value
        return part


class ImageUrl(Body):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ChatImagePart(Marked):
    """A Chat Completions `image_url` part, the same image in that API's nesting."""

    type: Literal["image_url"]
    image_url: ImageUrl | str

    def event_part(self) -> dict[str, Any]:
        image = self.image_url if isinstance(self.image_url, ImageUrl) else ImageUrl(url=self.image_url)
        part: dict[str, Any] = {"type": "input_image", "image_url": image.url}
        if image.detail is not None:
            part["detail"] = image.detail
        return part


class FileFields(Body):
    """A file part's own fields, the same in both APIs: only a PDF's bytes in `file_data` are taken
    (KSI has no Files API, so `file_id` and `file_url` are refused by name)."""

    file_data: str | None = None
    filename: str | None = None
    file_id: str | None = None
    file_url: str | None = None

    def pdf_part(self, where: str) -> dict[str, Any]:
        """completion:async's `input_file` part (a PDF data URL); its bytes are checked at admission.
        Bare base64 is taken when the filename says PDF, as OpenAI's Chat Completions documents it."""
        for name in ("file_id", "file_url"):
            if getattr(self, name) is not None:
                raise KsiError(ErrorCode.UNSUPPORTED_PARAMETER,
                               f"{where}.{name}: KSI has no Files API; send the PDF's bytes in file_data "
                               f"({PDF_DATA_PREFIX}...)", fields={f"{where}.{name}": "not supported"})
        data = self.file_data
        if not data:
            raise _file_error(where, "required: a PDF as a base64 data URL")
        if not data.startswith("data:"):
            if not self.filename:
                raise _file_error(where, f"bare base64 without a filename: give {PDF_DATA_PREFIX}...")
            data = (PDF_DATA_PREFIX if self.filename.lower().endswith(".pdf") else "data:unknown;base64,") + data
        if not data.startswith(PDF_DATA_PREFIX):
            # a file of another type is well formed; KSI stores and sends PDFs only, as images are refused by type
            media_type = data[len("data:"):].partition(";")[0].partition(",")[0] or None
            raise KsiError(ErrorCode.UNSUPPORTED_MEDIA_TYPE, f"{where}.file_data: only PDFs are taken "
                           f"({PDF_DATA_PREFIX}...)", fields={f"{where}.file_data": "only PDFs"},
                           media_type=media_type)
        part: dict[str, Any] = {"type": "input_file", "file_data": data}
        if self.filename is not None:
            part["filename"] = self.filename
        return part


def _file_error(where: str, why: str) -> KsiError:
    return KsiError(ErrorCode.VALIDATION_ERROR, f"{where}.file_data is {why}", fields={f"{where}.file_data": why})


class InputFilePart(FileFields, Marked):
    """A Responses `input_file` part."""

    type: Literal["input_file"]
    detail: str | None = None  # how OpenAI renders a file; a PDF here goes to the model as it is

    def event_part(self, where: str) -> dict[str, Any]:
        if self.detail not in (None, "auto"):
            raise KsiError(ErrorCode.UNSUPPORTED_PARAMETER, f"{where}.detail: a PDF goes to the model as it is "
                           "(only \"auto\")", fields={f"{where}.detail": "only \"auto\""})
        return self.pdf_part(where)


class ChatFilePart(Marked):
    """A Chat Completions `file` part, the same file nested under `file`."""

    type: Literal["file"]
    file: FileFields

    def event_part(self, where: str) -> dict[str, Any]:
        return self.file.pdf_part(f"{where}.file")


ImagePart = InputImagePart | ChatImagePart
FilePart = InputFilePart | ChatFilePart


class MediaPart(Body):
    """A content part KSI does not send (a sound): refused by name, not as malformed."""

    type: Literal["input_audio", "image", "audio"]


# not discriminated: a text part may leave out its type
Part = InputText | InputImagePart | ChatImagePart | InputFilePart | ChatFilePart | MediaPart


def _refused_part(part: ImagePart | FilePart | MediaPart, where: str, why: str) -> KsiError:
    return KsiError(ErrorCode.UNSUPPORTED_PARAMETER, f"{where} is a {part.type} part: {why}",
                    fields={f"{where}.type": why})


def part_texts(content: str | list[Part] | None, where: str) -> str:
    """The text of content that can only be text (a tool's output, a conversation item): an image,
    file or sound part there is refused (unsupported_parameter)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    for position, part in enumerate(content):
        if not isinstance(part, InputText):
            raise _refused_part(part, f"{where}.{position}", "only text parts are taken here")
    return "".join(part.text for part in content if isinstance(part, InputText))


def message_content(content: str | list[Part] | None, where: str) -> str | list[dict[str, Any]]:
    """A message's content as completion:async takes it: its text, or, when it holds images or PDFs,
    its parts in order (text parts as `input_text`, images as `input_image` with their URL, PDFs as
    `input_file` with their data URL); sound parts are refused by name."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if all(isinstance(part, InputText) for part in content):
        return "".join(part.text for part in content if isinstance(part, InputText))
    parts: list[dict[str, Any]] = []
    for position, part in enumerate(content):
        if isinstance(part, InputText):
            parts.append({"type": "input_text", "text": part.text})
        elif isinstance(part, MediaPart):
            raise _refused_part(part, f"{where}.{position}", "KSI sends text, image and PDF parts only")
        elif isinstance(part, FilePart):
            parts.append(part.event_part(f"{where}.{position}"))
        else:
            parts.append(part.event_part())
    return parts


def message_breakpoint(content: str | list[Part] | None) -> dict[str, Any] | None:
    """The client's own prompt-cache breakpoint on a message's parts, as it came: the message keeps
    its text parts as one, so a breakpoint on any part closes the message (the newest one marked
    gives its value), as the Messages door keeps a block's cache_control."""
    marked = [part for part in content or [] if isinstance(part, Marked) and part.prompt_cache_breakpoint is not None]
    return marked[-1].prompt_cache_breakpoint if marked and not isinstance(content, str) else None


def with_breakpoint(item: dict[str, Any], content: str | list[Part] | None) -> dict[str, Any]:
    """A message item with the client's own prompt-cache breakpoint on its parts, if any (the
    provider adapter sends it to a model that takes one, at the message's end)."""
    marker = message_breakpoint(content)
    return {**item, "prompt_cache_breakpoint": marker} if marker is not None else item


class InputMessage(Body):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[Part]
    id: str | None = None  # an output item's id names the response that made it (see translate.py)
    # how an OpenAI model should read an earlier assistant message of its own; no chat call takes it,
    # and the stored history is the message itself, so it is checked and goes no further
    phase: Literal["commentary", "final_answer"] | None = None

    def text(self, where: str) -> str:
        return part_texts(self.content, where)

    def event_content(self, where: str) -> str | list[dict[str, Any]]:
        return message_content(self.content, where)


class FunctionCallOutput(Body):
    """A function tool's result, answering a call of the response it continues."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[Part]


class ClientToolOutput(Body):
    """The output of a client-run tool that is not a plain function: a custom tool's (text), a
    shell form's (`local_shell_call_output` names its call by `id`; `shell_call_output` holds a list)."""

    type: Literal["custom_tool_call_output", "local_shell_call_output", "shell_call_output"]
    call_id: str | None = None
    id: str | None = None
    output: str | list[Any] | dict[str, Any]

    def answered(self) -> str:
        return self.call_id or (self.id if self.type == "local_shell_call_output" else None) or ""


class ToolItem(Body):
    """An input item of a call (history, see tool_shapes.response_input_item) or of a hosted tool: refused."""

    model_config = ConfigDict(extra="allow")  # a call's fields are kept as the client sent them

    type: Literal["function_call", "custom_tool_call", "local_shell_call", "shell_call",
                  "computer_call", "computer_call_output", "mcp_call", "mcp_approval_response",
                  "reasoning", "item_reference"]
    # a call's own fields (a client-held history resends the calls the model made)
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    id: str | None = None
    namespace: str | None = None
    input: str | None = None  # a custom tool call's
    action: dict[str, Any] | None = None  # a shell call's


class ConversationRef(Body):
    id: Id


class CreateBody(Body):
    """A create body: fields it does not declare are kept (model_extra) and go to the provider."""

    model_config = ConfigDict(extra="allow")

    # function tools in either API's form (flat or nested under `function`), as completion:async takes
    # them; hosted tools are refused by name (see tool_shapes.tool_fields)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


class TextFormatSpec(Body):
    """Responses' `text.format`: the answer's form, given flat where Chat Completions nests it."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_named(self) -> TextFormatSpec:
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError("a json_schema format needs its name and schema")
        return self

    def response_format(self) -> dict[str, Any] | None:
        if self.type == "text":
            return None  # plain text is what every answer is without a format
        if self.type == "json_object":
            return {"type": "json_object"}
        spec: dict[str, Any] = {"name": self.name, "schema": self.schema_, "description": self.description,
                                "strict": self.strict}
        return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}


class TextOptions(Body):
    model_config = ConfigDict(extra="forbid")

    format: TextFormatSpec | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class Reasoning(Body):
    model_config = ConfigDict(extra="forbid")

    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    # the answer holds the reasoning a provider returned whatever is asked here (see docs/codex.md)
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponseCreate(CreateBody):
    """POST /v1/responses."""

    input: str | list[InputMessage | FunctionCallOutput | ClientToolOutput | ToolItem]
    model: str | None = None
    instructions: str | None = None
    previous_response_id: Id | None = None
    conversation: Id | ConversationRef | None = None
    # KSI keeps every exchange, it continues conversations from them: `store: false` changes nothing
    # (said in docs/http.md), so it is accepted rather than refused
    store: bool = True
    stream: bool = False  # how KSI answers (streamed or whole), not a provider option
    # run in the daemon whatever the client does: polled, cancelled and its stream resumed by id
    background: bool = False
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    max_output_tokens: int | None = Field(default=None, gt=0)
    metadata: Metadata | None = None  # stored with the request, never sent
    text: TextOptions | None = None
    reasoning: Reasoning | None = None
    user: str | None = None
    seed: int | None = None
    # "reasoning.encrypted_content" only (see translate.INCLUDABLE); anything else is refused
    include: list[str] | None = None
    # KSI always chooses the history that fits the model's window ("auto"); "disabled" is accepted
    # because the new input alone never is cut: a request too large fails with context_window_exceeded;
    # kept with the exchange like Codex's other options (see options.KEPT_OPTIONS)
    truncation: Literal["auto", "disabled"] | None = None

    @field_validator("input")
    @classmethod
    def _some_input(cls, value: str | list[InputMessage | FunctionCallOutput | ClientToolOutput | ToolItem]
                    ) -> str | list[InputMessage | FunctionCallOutput | ClientToolOutput | ToolItem]:
        if isinstance(value, list) and not value:
            raise ValueError("must hold at least one message")
        return value

    def conversation_id(self) -> str | None:
        return self.conversation.id if isinstance(self.conversation, ConversationRef) else self.conversation


class ChatMessage(Body):
    role: Literal["user", "system", "developer", "assistant", "tool", "function"]
    content: str | list[Part] | None = None
    tool_calls: list[Any] | None = None  # an assistant turn's calls (see tool_shapes.chat_calls_as_items)
    tool_call_id: str | None = None  # the call a tool message answers
    function_call: Any = None  # the legacy form of tool_calls: refused (see translate.split_chat)

    def text(self, where: str) -> str:
        return part_texts(self.content, where)

    def event_content(self, where: str) -> str | list[dict[str, Any]]:
        return message_content(self.content, where)


class StreamOptions(Body):
    include_usage: bool = False


class ChatCompletionCreate(CreateBody):
    """POST /v1/chat/completions; `conversation_id` and `create` are KSI's (the SDK's extra_body)."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False  # how KSI answers (streamed or whole), not a provider option
    stream_options: StreamOptions | None = None  # honoured by KSI's own stream (usage chunk)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    max_tokens: int | None = Field(default=None, gt=0)
    max_completion_tokens: int | None = Field(default=None, gt=0)
    metadata: Metadata | None = None  # stored with the request, never sent
    # OpenAI's stored completions: KSI keeps every exchange anyway (see ResponseCreate.store)
    store: bool | None = None
    conversation_id: Id | None = None
    create: bool = False


class ConversationItem(Body):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[Part]

    def text(self, where: str) -> str:
        return part_texts(self.content, where)


class SummaryText(Body):
    type: Literal["summary_text"] = "summary_text"
    text: str


class ConversationToolItem(Body):
    """A conversation item of a tool turn or of reasoning: a function call, its output, or a
    reasoning item (as a client that keeps its session in a conversation adds them)."""

    type: Literal["function_call", "function_call_output", "reasoning"]
    call_id: str | None = Field(default=None, min_length=1)
    name: str | None = Field(default=None, min_length=1)
    arguments: str | None = None
    output: str | list[Part] | None = None
    summary: list[SummaryText] | None = None
    id: str | None = None

    def event_item(self, where: str) -> dict[str, Any]:
        """The item as conversation:append takes it (its fields checked there)."""
        if self.type == "reasoning":
            return {"type": "reasoning", "summary": "".join(part.text for part in self.summary or [])}
        if self.type == "function_call":
            return {"type": "function_call", "call_id": self.call_id, "name": self.name,
                    "arguments": self.arguments or ""}
        return {"type": "function_call_output", "call_id": self.call_id,
                "output": part_texts(self.output, f"{where}.output")}


AnyConversationItem = ConversationItem | ConversationToolItem


class ConversationCreate(Body):
    """POST /v1/conversations."""

    items: list[AnyConversationItem] | None = Field(default=None, max_length=1000)
    metadata: Metadata | None = None


class ConversationUpdate(Body):
    """POST /v1/conversations/{id}."""

    metadata: Metadata


class ItemsCreate(Body):
    """POST /v1/conversations/{id}/items."""

    items: list[AnyConversationItem] = Field(min_length=1, max_length=1000)


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
