"""Tool calls through the OpenAI door, in both APIs' shapes.

Requests: the tool fields (`tools`, `tool_choice`, `parallel_tool_calls`) go to completion:async
as they are (it takes both the Responses flat form and the Chat Completions nested form); a tool
KSI cannot run a loop for (a hosted tool: web search, file search, computer use, ...) is refused
by name. A tool's result comes back as a `function_call_output` item: a Responses input item, or
a chat `role: tool` message answering the last assistant message's `tool_calls`.

Replies: the result's output items become a chat message's `tool_calls` or the Responses output
items (`message`, `function_call`, `reasoning`), and `completion:chunk` tool-call deltas become
chat `delta.tool_calls` entries or the Responses streaming events the official SDK accumulates.
Which engine behaviour a tool option gets (passed on, refused with `unsupported_parameter`) is the
completion service's; the door only translates."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson

from ksi_common.errors import ErrorCode, KsiError
from ksi_common.items import Item, function_calls, message
from ksi_common.items import output_items as stored_items
from ksi_daemon.providers.tool_kinds import function_form, provider_names
from ksi_daemon.transports.http.openai.image_refs import as_history
from ksi_daemon.transports.http.openai.schemas import (
    ChatMessage,
    ClientToolOutput,
    CreateBody,
    FunctionCallOutput,
    InputMessage,
    ToolItem,
    part_texts,
    with_breakpoint,
)
from ksi_daemon.transports.http.openai.shapes import item_reference as shapes_item_reference
from ksi_daemon.transports.http.openai.shapes import message_item, output_text

NO_CALL_CHOICES = (None, "auto", "none")  # what an SDK sends by default: with no tools it asks for nothing
HOSTED = ("KSI passes on the tools a client runs (function, custom, namespace, local_shell, shell): the client "
          "runs each call and sends its output back; a model's drop_hosted_tools setting may leave it out instead")


def _refuse(name: str, why: str) -> KsiError:
    return KsiError(ErrorCode.UNSUPPORTED_PARAMETER, f"{name} is not supported: {why}", fields={name: why})


CLIENT_TOOLS = frozenset({"function", "custom", "namespace", "local_shell", "shell"})
# hosted tools a provider may offer itself: a web search, passed as the chat API's web_search_options
SEARCH_TOOLS = frozenset({"web_search", "web_search_preview"})
SEARCH_FIELDS = frozenset({"type", "search_context_size", "user_location"})
CHOOSABLE = frozenset({"function", "custom"})  # a tool_choice may name one tool of these types


def tool_fields(body: CreateBody, dropped: frozenset[str] = frozenset(), searched: bool = False) -> dict[str, Any]:
    """The completion:async tool fields of a request body. Values that ask for nothing (`tools: []`,
    `tool_choice: "auto"` without tools) are left out, so a client's defaults reach a model without
    tool support as no tools at all. Tools the client runs pass as they are; a hosted tool is
    refused by name unless its type is among `dropped` (the model's drop_hosted_tools setting),
    which leaves it out of the call, or is a web search and `searched` (the caller passes it on as
    search_options gives it)."""
    choice = body.tool_choice
    apart = dropped | SEARCH_TOOLS if searched else dropped
    tools = [tool for tool in body.tools or [] if tool.get("type", "function") not in apart]
    if not tools:
        return {} if choice in NO_CALL_CHOICES else {"tool_choice": choice}
    for position, tool in enumerate(body.tools or []):
        kind = tool.get("type", "function")
        if isinstance(kind, str) and kind not in CLIENT_TOOLS and kind not in apart:
            raise _refuse(f"tools.{position}.type", f"a {kind} tool is hosted by OpenAI; {HOSTED}")
    if isinstance(choice, dict) and isinstance(choice.get("type"), str) and choice["type"] not in CHOOSABLE:
        raise _refuse("tool_choice.type", f"a {choice['type']} tool choice: KSI takes \"auto\", \"none\", "
                                          f"\"required\" or one named function or custom tool; {HOSTED}")
    fields: dict[str, Any] = {"tools": tools}
    if choice is not None:
        fields["tool_choice"] = choice
    if body.parallel_tool_calls is not None:
        fields["parallel_tool_calls"] = body.parallel_tool_calls
    return fields


def search_options(body: CreateBody, dropped: frozenset[str] = frozenset()) -> dict[str, Any]:
    """A web search tool of the request (not dropped) as the `web_search_options` option a provider
    that searches itself takes (admission refuses it for a model not known to: see abilities)."""
    found = [(position, tool) for position, tool in enumerate(body.tools or [])
             if tool.get("type") in SEARCH_TOOLS and tool["type"] not in dropped]
    if not found:
        return {}
    position, tool = found[0]
    unknown = sorted(set(tool) - SEARCH_FIELDS)
    if unknown or len(found) > 1:
        name = f"tools.{position}.{unknown[0]}" if unknown else f"tools.{found[1][0]}"
        raise _refuse(name, "a web search is passed to the provider with search_context_size and user_location "
                            "only, once; a model's drop_hosted_tools setting may leave it out instead")
    searched: dict[str, Any] = {}
    if tool.get("search_context_size") is not None:
        searched["search_context_size"] = tool["search_context_size"]
    location = tool.get("user_location")
    if isinstance(location, dict):
        place = {key: value for key, value in location.items() if key != "type" and value is not None}
        searched["user_location"] = {"type": "approximate", "approximate": place}
    return {"web_search_options": searched}


def search_field(body: CreateBody) -> dict[str, str]:
    """The body's field a refused web_search_options names: its web search tool's type."""
    position = next((n for n, tool in enumerate(body.tools or []) if tool.get("type") in SEARCH_TOOLS), None)
    return {"web_search_options": f"tools.{position}.type"} if position is not None else {}


def tool_names(fields: dict[str, Any]) -> dict[tuple[str | None, str], str]:
    """The function names a provider is given for the tool fields of a request (see tool_kinds)."""
    tools = [tool for tool in fields.get("tools") or [] if isinstance(tool, dict) and "function" not in tool]
    # read before completion:async checks the tools: a malformed one is refused there, by name
    return provider_names(tools) if tools else {}


def call_output(call_id: str, output: str) -> Item:
    return {"type": "function_call_output", "call_id": call_id, "output": output}


def client_output(item: ClientToolOutput, where: str) -> Item:
    """A custom tool's or a shell form's output as the function_call_output item KSI keeps (the
    provider is shown its text), with the client's type and, when not text, its output as sent."""
    output = item.output
    kept: Item = {"type": "function_call_output", "call_id": item.answered(), "client_type": item.type}
    if not kept["call_id"]:
        raise KsiError(ErrorCode.VALIDATION_ERROR, f"{where}.call_id is missing: an output answers a call",
                       fields={f"{where}.call_id": "the id of the call this output answers"})
    if isinstance(output, str):
        return {**kept, "output": output}
    parts = output if isinstance(output, list) else []
    if parts and all(isinstance(part, dict) and isinstance(part.get("text"), str) for part in parts):
        return {**kept, "output": "".join(str(part["text"]) for part in parts), "client_output": output}
    return {**kept, "output": orjson.dumps(output).decode(), "client_output": output}


def response_input_item(position: int, item: FunctionCallOutput | ClientToolOutput | ToolItem) -> Item:
    """A Responses input item that is not a message: a call's output is new input; a call is
    history (it comes from `previous_response_id` or `conversation`); other kinds are refused."""
    where = f"input.{position}"
    if isinstance(item, FunctionCallOutput):
        return call_output(item.call_id, part_texts(item.output, f"{where}.output"))
    if isinstance(item, ClientToolOutput):
        return client_output(item, where)
    if item.type in CALL_ITEMS:
        raise KsiError(ErrorCode.VALIDATION_ERROR,
                       f"{where} is a {item.type} item: the history comes from previous_response_id or "
                       "conversation, the input is only what is new (the calls' outputs)",
                       fields={f"{where}.type": "a call is history, not new input"})
    why = {"reasoning": "reasoning items are kept by KSI with the response that made them, not taken as input"}
    raise _refuse(f"{where}.type", why.get(item.type, f"a {item.type} item belongs to a hosted tool; {HOSTED}"))


CALL_ITEMS = frozenset({"function_call", "custom_tool_call", "local_shell_call", "shell_call"})


def is_output_item(item: InputMessage | FunctionCallOutput | ClientToolOutput | ToolItem) -> bool:
    """An item only a model gives (an assistant message, a call): what ends a client's history."""
    if isinstance(item, InputMessage):
        return item.role == "assistant"
    return isinstance(item, ToolItem) and (item.type in CALL_ITEMS or item.type in ("reasoning", "item_reference"))


def history_item(position: int, item: InputMessage | FunctionCallOutput | ClientToolOutput | ToolItem,
                 names: dict[tuple[str | None, str], str] | None = None) -> Item | None:
    """An item of a client-held Responses history as completion:async's `history` takes it (None:
    a reasoning item, kept by KSI with the response that made it and never matched); `names`: the
    function names the request's tools are given (see tool_kinds.provider_names)."""
    where = f"input.{position}"
    if isinstance(item, InputMessage):
        return as_history(with_breakpoint(message(item.role if item.role != "developer" else "system",
                                                  item.event_content(f"{where}.content")), item.content))
    if isinstance(item, FunctionCallOutput):
        return call_output(item.call_id, part_texts(item.output, f"{where}.output"))
    if isinstance(item, ClientToolOutput):
        return client_output(item, where)
    if item.type == "function_call" and item.namespace is None:
        return {"type": "function_call", "call_id": item.call_id or "", "name": item.name or "",
                "arguments": item.arguments or ""}
    if item.type in CALL_ITEMS:
        return function_form(item.model_dump(exclude_none=True), names)
    if item.type == "reasoning":
        return None
    if item.type == "item_reference":  # the stored item it names, found by the completion service
        return shapes_item_reference(item.id or "", f"{where}.id")
    return response_input_item(position, item)  # refused: a hosted tool's item


def appended_item(position: int, item: InputMessage | FunctionCallOutput | ClientToolOutput | ToolItem,
                  names: dict[tuple[str | None, str], str] | None = None) -> Item:
    """An item before the new input of a request continuing a stored point (previous_response_id or
    conversation) as completion:async's `appended` takes it: every item keeps its place, so an
    error names the client's own position."""
    if isinstance(item, ToolItem) and item.type == "reasoning":
        return {"type": "reasoning", "summary": ""}
    found = history_item(position, item, names)
    assert found is not None  # only a reasoning item has no history form
    return found


@dataclass(slots=True)
class ChatCalls:
    """The tool calls of the last assistant message of a chat request, and the tool messages that
    answer them: each answers one of them, and every call is answered before the next message of
    another role (as OpenAI requires), so a history is refused before any of it is written."""

    made: set[str] | None = None  # None: no assistant message yet (the new input of a stored conversation)
    answered: set[str] = field(default_factory=set)

    def called(self, calls: list[Item]) -> None:
        self.made, self.answered = {call["call_id"] for call in calls}, set()

    def answer(self, message: ChatMessage, position: int) -> Item:
        """A `role: tool` message as a function_call_output item (with no assistant message before
        it, the engine checks its call id against the conversation's newest exchange)."""
        where = f"messages.{position}.tool_call_id"
        if not message.tool_call_id:
            raise KsiError(ErrorCode.VALIDATION_ERROR, f"{where} is missing: a tool message answers a call",
                           fields={where: "the id of the tool call this message answers"})
        if self.made is not None and message.tool_call_id not in self.made:
            raise KsiError(ErrorCode.VALIDATION_ERROR,
                           f"{where} {message.tool_call_id!r} answers no tool call of the assistant message before it",
                           fields={where: "not a call of the assistant message before it"})
        self.answered.add(message.tool_call_id)
        return call_output(message.tool_call_id, message.text(f"messages.{position}.content"))

    def check_answered(self, position: int) -> None:
        """Before message `position`, of another role: every call has its tool message."""
        missing = sorted((self.made or set()) - self.answered)
        if missing:
            raise KsiError(ErrorCode.VALIDATION_ERROR,
                           f"messages.{position} comes before tool messages answering the calls {missing} of the "
                           "assistant message before it",
                           fields={f"messages.{position}": f"the calls {missing} have no tool message"})


# -- Chat Completions -------------------------------------------------------------------------------

def chat_tool_calls(output: list[Item]) -> list[dict[str, Any]]:
    """The calls among output items, as a chat message's `tool_calls`: a custom tool's in the chat
    API's custom form, every other as a function call."""
    return [_chat_call(call) for call in function_calls(output)]


def _chat_call(call: Item) -> dict[str, Any]:
    client = call.get("client_item")
    if isinstance(client, dict) and client.get("type") == "custom_tool_call":
        return {"id": call["call_id"], "type": "custom",
                "custom": {"name": client.get("name"), "input": client.get("input")}}
    return {"id": call["call_id"], "type": "function",
            "function": {"name": call["name"], "arguments": call.get("arguments") or ""}}


def chat_calls_as_items(tool_calls: list[Any], where: str) -> list[Item]:
    """An assistant message's `tool_calls` as function_call items (a client-held history); a custom
    tool's call in the function form KSI keeps it in (see tool_kinds.function_form)."""
    calls = []
    for position, call in enumerate(tool_calls):
        custom = call.get("custom") if isinstance(call, dict) and call.get("type") == "custom" else None
        if isinstance(custom, dict) and isinstance(call.get("id"), str) and isinstance(custom.get("name"), str):
            calls.append(function_form({"type": "custom_tool_call", "call_id": call["id"], "name": custom["name"],
                                        "input": str(custom.get("input") or "")}))
            continue
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(call.get("id"), str) \
                or not isinstance(function.get("name"), str):
            raise KsiError(ErrorCode.VALIDATION_ERROR, f"{where}.{position} needs an id and a function name",
                           fields={f"{where}.{position}": "a function call: id, function.name, function.arguments"})
        calls.append({"type": "function_call", "call_id": call["id"], "name": function["name"],
                      "arguments": str(function.get("arguments") or "")})
    return calls


def with_tool_calls(completion: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
    """A chat completion whose message carries the calls the result made, if it made some (with
    `content: null` when there is no text beside them, as OpenAI gives it)."""
    calls = chat_tool_calls(result.get("output") or [])
    if calls:
        message = completion["choices"][0]["message"]
        message.update(content=message["content"] or None, tool_calls=calls)
    return completion


@dataclass(slots=True)
class ChatCallDeltas:
    """`completion:chunk` tool-call deltas as chat `delta.tool_calls` entries: a call's id, type
    and name are sent once (the SDK's accumulator concatenates strings it sees twice), its
    arguments in pieces."""

    named: set[int] = field(default_factory=set)

    def delta(self, tool_call: dict[str, Any]) -> dict[str, Any]:
        index = int(tool_call.get("index") or 0)
        entry: dict[str, Any] = {"index": index}
        function: dict[str, Any] = {}
        if index not in self.named and tool_call.get("call_id"):
            self.named.add(index)
            entry.update(id=tool_call["call_id"], type="function")
            function["name"] = str(tool_call.get("name") or "")
        function["arguments"] = str(tool_call.get("arguments") or "")
        entry["function"] = function
        return {"tool_calls": [entry]}

    def unsent(self, output: list[Item]) -> dict[str, Any] | None:
        """The calls of the result no delta announced (a reply that came whole), as one delta."""
        entries = []
        for index, call in enumerate(chat_tool_calls(output)):
            if index not in self.named:
                self.named.add(index)
                entries.append({"index": index, **call})
        return {"tool_calls": entries} if entries else None


# -- Responses -------------------------------------------------------------------------------------

def output_items(response_id: str, output: list[Item], encrypted: bool = False) -> list[dict[str, Any]]:
    """A result's (or a record's) output items as Responses output items, in order; `encrypted`:
    reasoning items carry `encrypted_content` (include: ["reasoning.encrypted_content"])."""
    shaped = []
    calls = 0
    for item in output:
        kind = item.get("type")
        if kind == "function_call":
            shaped.append(function_call_item(response_id, calls, item))
            calls += 1
        elif kind == "reasoning":
            shaped.append(reasoning_item(response_id, item, encrypted))
        elif kind == "message":
            shaped.append(message_item(response_id, str(item.get("content") or "")))
    return shaped


def function_call_item(response_id: str, index: int, call: Item, status: str = "completed") -> dict[str, Any]:
    """A call as a Responses output item: in the client's form when it has one (a custom tool's
    call with its input, a shell call with its action, a namespace's function call), else a
    function call."""
    shown = {"id": f"fc_{response_id}_{index}", "call_id": str(call.get("call_id") or "")}
    client = call.get("client_item")
    if isinstance(client, dict):
        return {**client, **shown, "status": status}
    return {"type": "function_call", **shown, "name": str(call.get("name") or ""),
            "arguments": str(call.get("arguments") or ""), "status": status}


def reasoning_item(response_id: str, item: Item, encrypted: bool = False) -> dict[str, Any]:
    """A reasoning item: the provider's reasoning text as its summary; asked for, `encrypted_content`
    is the reasoning as KSI keeps it (text and signed thinking blocks), base64 JSON. It is not
    encrypted: KSI keeps the reasoning itself and never needs it back (a resent one is ignored)."""
    shaped: dict[str, Any] = {"type": "reasoning", "id": f"rs_{response_id}",
                              "summary": [{"type": "summary_text", "text": str(item.get("summary") or "")}]}
    if encrypted:
        kept = {key: item[key] for key in ("summary", "thinking_blocks") if key in item}
        shaped["encrypted_content"] = base64.b64encode(orjson.dumps(kept)).decode()
    return shaped


def with_output(shaped: dict[str, Any], response_id: str, output: list[Item] | None,
                encrypted: bool = False) -> dict[str, Any]:
    """A Response object whose `output` holds the reply's items, when they are more than its text."""
    if not output or all(item.get("type") == "message" for item in output):
        return shaped  # plain text: the one message already there
    return {**shaped, "output": output_items(response_id, output, encrypted)}


def stored_output(shown: dict[str, Any]) -> list[Item]:
    """The output items of a stored response (the data of response:show)."""
    return stored_items(shown.get("outcome")) if shown.get("status") == "completed" else []


def request_echo(body: CreateBody, dropped: frozenset[str] = frozenset()) -> dict[str, Any]:
    """What a Response object says about the request's tools (the fields the SDK reads back)."""
    fields = tool_fields(body, dropped, searched=True)
    echo: dict[str, Any] = {}
    if fields.get("tools"):
        echo["tools"] = [_echoed_tool(tool) for tool in fields["tools"]]
    if "tool_choice" in fields:
        echo["tool_choice"] = fields["tool_choice"]
    if "parallel_tool_calls" in fields:
        echo["parallel_tool_calls"] = bool(fields["parallel_tool_calls"])
    return echo


def _echoed_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A function tool as a Response object lists it: flat, every field of the form present (a
    chat-form tool nests them under `function`); a tool of another kind as the client sent it."""
    if tool.get("type", "function") != "function":
        return tool
    spec = tool["function"] if isinstance(tool.get("function"), dict) else tool
    return {"type": "function", "name": spec.get("name"), "description": spec.get("description"),
            "parameters": spec.get("parameters"), "strict": spec.get("strict")}


Event = tuple[str, dict[str, Any]]


@dataclass(slots=True)
class ResponseItemEvents:
    """A streamed response's output items as Responses events, in the order the official SDK
    accumulates them: an item is added when its first delta arrives (the text message, or each
    function call by its index), its deltas follow, and the end closes every open item in order
    before `response.completed` holds them all."""

    response_id: str
    encrypted: bool = False  # reasoning items carry encrypted_content
    # ("message", 0), ("call", index) or ("reasoning", 0), by output index
    opened: list[tuple[str, int]] = field(default_factory=list)
    text: str = ""
    calls: dict[int, dict[str, Any]] = field(default_factory=dict)  # call index -> call_id, name, arguments
    summary_streamed: bool = False  # the reasoning item came first, its summary in pieces

    def text_delta(self, delta: str) -> Iterator[Event]:
        if ("message", 0) not in self.opened:
            yield from self._open_message()
        self.text += delta
        yield "response.output_text.delta", {**self._where(), "delta": delta, "logprobs": []}

    def reasoning_delta(self, delta: str) -> Iterator[Event]:
        """A piece of the reasoning summary, streamed while it comes first (as a reasoning model
        thinks before it answers); after the answer began, the summary comes whole with the result."""
        if delta and not self.opened:
            self.opened.append(("reasoning", 0))
            self.summary_streamed = True
            item = {"type": "reasoning", "id": f"rs_{self.response_id}", "summary": []}
            yield "response.output_item.added", {"output_index": 0, "item": item}
            yield "response.reasoning_summary_part.added", {**self._thought(),
                                                            "part": {"type": "summary_text", "text": ""}}
        if delta and self.summary_streamed and len(self.opened) == 1:
            yield "response.reasoning_summary_text.delta", {**self._thought(), "delta": delta}

    def call_delta(self, tool_call: dict[str, Any]) -> Iterator[Event]:
        index = int(tool_call.get("index") or 0)
        call = self.calls.get(index)
        if call is None:
            call = self.calls[index] = {"call_id": str(tool_call.get("call_id") or ""),
                                        "name": str(tool_call.get("name") or ""), "arguments": ""}
            self.opened.append(("call", index))
            yield "response.output_item.added", {
                "output_index": len(self.opened) - 1,
                "item": function_call_item(self.response_id, index, call, status="in_progress")}
        delta = str(tool_call.get("arguments") or "")
        if delta:
            call["arguments"] += delta
            yield "response.function_call_arguments.delta", {
                "item_id": f"fc_{self.response_id}_{index}", "output_index": self._position("call", index),
                "delta": delta}

    def done(self, result: dict[str, Any]) -> tuple[list[Event], list[dict[str, Any]]]:
        """The closing events, and the response's output items in their announced order. What the
        result holds that no delta announced (a reply that came whole) is announced here first."""
        output = list(result.get("output") or [])
        events: list[Event] = []
        text = str(result.get("content") or "")
        calls = function_calls(output)
        for index, call in enumerate(calls):
            if index in self.calls:
                continue
            if isinstance(call.get("client_item"), dict):  # a call in the client's form comes whole
                self.calls[index] = call
                self.opened.append(("call", index))
                events.append(("response.output_item.added", {
                    "output_index": len(self.opened) - 1,
                    "item": function_call_item(self.response_id, index, call, status="in_progress")}))
                continue
            events += self.call_delta({"index": index, "call_id": call.get("call_id"), "name": call.get("name"),
                                       "arguments": call.get("arguments")})
        summaries = [item for item in output if item.get("type") == "reasoning"]
        if summaries and ("reasoning", 0) not in self.opened:  # a summary that came whole: announced last
            self.opened.append(("reasoning", 0))
            reasoned = reasoning_item(self.response_id, summaries[0], self.encrypted)
            events.append(("response.output_item.added", {"output_index": len(self.opened) - 1, "item": reasoned}))
        if ("message", 0) not in self.opened and (text or not calls):
            events += self._open_message()  # an empty answer still is one message, as before tools
            if text:
                events.append(("response.output_text.delta", {**self._where(), "delta": text, "logprobs": []}))
        items = []
        for position, (kind, index) in enumerate(self.opened):
            if kind == "message":
                where = self._where()
                events.append(("response.output_text.done", {**where, "text": text, "logprobs": []}))
                events.append(("response.content_part.done", {**where, "part": output_text(text)}))
                item = message_item(self.response_id, text)
            elif kind == "reasoning":
                item = reasoning_item(self.response_id, summaries[0] if summaries else {}, self.encrypted)
                if self.summary_streamed:  # its summary part is open
                    part = item["summary"][0]
                    events.append(("response.reasoning_summary_text.done",
                                   {**self._thought(), "text": part["text"]}))
                    events.append(("response.reasoning_summary_part.done", {**self._thought(), "part": part}))
            else:
                call = calls[index] if index < len(calls) else self.calls[index]
                item = function_call_item(self.response_id, index, call)
                events += _call_done(item, position)
            events.append(("response.output_item.done", {"output_index": position, "item": item}))
            items.append(item)
        return events, items

    def _thought(self) -> dict[str, Any]:
        return {"item_id": f"rs_{self.response_id}", "output_index": 0, "summary_index": 0}

    def _open_message(self) -> Iterator[Event]:
        self.opened.append(("message", 0))
        yield "response.output_item.added", {"output_index": len(self.opened) - 1,
                                             "item": message_item(self.response_id, "", status="in_progress")}
        yield "response.content_part.added", {**self._where(), "part": output_text("")}

    def _position(self, kind: str, index: int) -> int:
        return self.opened.index((kind, index))

    def _where(self) -> dict[str, Any]:
        return {"item_id": f"msg_{self.response_id}", "output_index": self._position("message", 0),
                "content_index": 0}


def _call_done(item: dict[str, Any], position: int) -> list[Event]:
    """The event that closes a call's arguments (a function's) or input (a custom tool's)."""
    if item["type"] == "function_call":
        return [("response.function_call_arguments.done", {
            "item_id": item["id"], "output_index": position, "name": item["name"], "arguments": item["arguments"]})]
    if item["type"] == "custom_tool_call":
        return [("response.custom_tool_call_input.done", {
            "item_id": item["id"], "output_index": position, "input": item["input"]})]
    return []


# -- new input and imported history ----------------------------------------------------------------

def new_input(items: list[Item]) -> dict[str, Any]:
    """The new input as completion:async takes it: `messages` when it is only messages (as before
    tools), `input` items when it holds the outputs of calls."""
    if any(item["type"] == "function_call_output" or not isinstance(item["content"], str) or "cache_control" in item
           or "prompt_cache_breakpoint" in item for item in items):
        return {"input": items}  # a call's output, images or a cache marker are only taken as items
    return {"messages": [{"role": item["role"], "content": item["content"]} for item in items]}
