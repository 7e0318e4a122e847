"""`max_tool_calls`: how many tool calls one response may make.

On OpenAI it counts the calls of the tools OpenAI runs itself, within one response. KSI runs no
tool: every call of a response goes back to the client, which runs it and answers in the next
request. So here it bounds the calls one response returns: when the model asks for more, the
first `max_tool_calls` are kept (stored, streamed and returned) and the others are dropped, and
the exchange says how many went (`tool_calls_dropped`). With none kept the answer is the model's
text alone. A chat provider has no such option, so the limit is kept by KSI, never sent.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ksi_common.errors import ErrorCode, KsiError
from ksi_common.items import message
from ksi_daemon.providers.base import ChunkSink, ProviderReply, ReasoningPiece

OPTION = "max_tool_calls"
DROPPED = "tool_calls_dropped"  # in the outcome line and the result: the calls the limit dropped


def call_limit(options: Mapping[str, Any]) -> int | None:
    """The request's limit on calls per response (None: no limit); a limit that is no whole
    number of 0 or more is refused (validation_error, naming the option)."""
    value = options.get(OPTION)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise KsiError(ErrorCode.VALIDATION_ERROR, f"{OPTION} must be a whole number of 0 or more",
                       fields={f"options.{OPTION}": "a whole number of 0 or more"})
    return value


def capped_sink(sink: ChunkSink | None, limit: int | None) -> ChunkSink | None:
    """`sink` passing on text, reasoning and the pieces of the first `limit` calls only (a piece
    names its call by the provider's index, counted from 0)."""
    if sink is None or limit is None:
        return sink
    forward: ChunkSink = sink

    def capped(piece: str | dict[str, Any] | ReasoningPiece) -> None:
        if not isinstance(piece, dict) or int(piece.get("index", 0)) < limit:
            forward(piece)

    return capped


def capped_reply(reply: ProviderReply, limit: int | None) -> ProviderReply:
    """`reply` with its first `limit` calls, and the number dropped noted in its extra."""
    if limit is None:
        return reply
    calls = [item for item in reply.output if item.get("type") == "function_call"]
    if len(calls) <= limit:
        return reply
    dropped = {id(item) for item in calls[limit:]}
    output = [item for item in reply.output if id(item) not in dropped]
    finish_reason = reply.finish_reason
    if limit == 0:
        finish_reason = "stop"
        if not any(item.get("type") == "message" for item in output):
            output.append(message("assistant", reply.content))
    return dataclasses.replace(reply, output=output, finish_reason=finish_reason,
                               extra={**reply.extra, DROPPED: len(calls) - limit})
