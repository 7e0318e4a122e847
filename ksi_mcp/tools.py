"""The tool handlers: each checks its arguments, calls KSI's events and shapes the reply."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ksi_common.errors import ErrorCode, KsiError
from ksi_common.events import (
    AGENT_SEND_MESSAGE,
    COMPLETION_ASYNC,
    COMPLETION_CANCEL,
    COMPLETION_CHUNK,
    CONVERSATION_EXPORT,
    CONVERSATION_FORK,
    CONVERSATION_LIST,
)
from ksi_common.submitting import wait_for_result
from ksi_mcp.caller import Caller
from ksi_mcp.schemas import checked_arguments

# A waiting call reports progress at least this often, so a client that resets its timeout on
# progress waits for slow and reasoning models; new text is reported at most every PROGRESS_GAP.
PROGRESS_EVERY = 2.0
PROGRESS_GAP = 0.5
PROGRESS_TEXT = 4000  # characters of the answer so far in a progress message (its end)
# About 20,000 tokens: under the 25,000 most MCP clients accept from one tool call.
OUTPUT_LIMIT = 80_000
LIST_LIMIT = 20


def conversation_uri(conversation_id: str) -> str:
    return f"ksi://conversations/{conversation_id}"


def cut(text: str, limit: int, conversation_id: str | None) -> str:
    """`text` within `limit` characters, saying what was cut and where the whole of it is."""
    if len(text) <= limit:
        return text
    where = f"read the resource {conversation_uri(conversation_id)}" if conversation_id else "narrow the request"
    note = f"\n\n[cut: {len(text) - limit} more characters; for the rest {where}]"
    return text[:max(0, limit - len(note))] + note


# Reports a waiting call's progress: (a count that grows with every report, the answer so far).
Progress = Callable[[float, str], Awaitable[None]]


class AnswerStream:
    """The text of one answer as its `completion:chunk` events arrive. Chunks may come before the
    acknowledgment names the request, so until then every request's chunks are kept."""

    def __init__(self) -> None:
        self.request_id: str | None = None
        self.changed = asyncio.Event()
        self._chunks: dict[str, list[str]] = {}

    def on_chunk(self, _name: str, data: dict[str, Any]) -> None:
        request_id = data.get("request_id")
        if not isinstance(request_id, str) or self.request_id not in (None, request_id):
            return
        self._chunks.setdefault(request_id, []).append(str(data.get("text") or ""))
        if request_id == self.request_id:
            self.changed.set()

    def follow(self, request_id: str) -> None:
        self.request_id = request_id
        self._chunks = {request_id: self._chunks.get(request_id, [])}
        if self._chunks[request_id]:
            self.changed.set()

    def text(self, limit: int) -> str:
        """The answer so far, its last `limit` characters when longer."""
        whole = "".join(self._chunks.get(self.request_id or "", []))
        return whole if len(whole) <= limit else "…" + whole[len(whole) - limit + 1:]


@dataclass(frozen=True, slots=True)
class Reply:
    text: str  # what the client's model reads
    data: dict[str, Any]  # the same, structured


class Tools:
    def __init__(self, caller: Caller, *, base_dir: Path | None = None, output_limit: int = OUTPUT_LIMIT) -> None:
        self.caller = caller
        self.base_dir = base_dir  # relative `files` are taken from here (the client's directory for stdio)
        self.output_limit = output_limit
        self._cancels: set[asyncio.Task[Any]] = set()
        self._turns: dict[str, Callable[[dict[str, Any], Progress | None], Awaitable[Reply]]] = {
            "chat": self.chat, "consensus": self.consensus, "agent_message": self.agent_message,
        }
        self._lookups: dict[str, Callable[[dict[str, Any]], Awaitable[Reply]]] = {
            "conversations": self.conversations, "conversation": self.conversation, "fork": self.fork,
        }

    async def call(self, name: str, arguments: dict[str, Any] | None, progress: Progress | None = None) -> Reply:
        """Run tool `name`; bad input or a failed event raises `KsiError` with KSI's code. A turn
        reports to `progress` (when given) while it waits for the answer."""
        args = checked_arguments(name, arguments)
        if name in self._turns:
            return await self._turns[name](args, progress)
        return await self._lookups[name](args)

    # -- turns ------------------------------------------------------------------
    async def chat(self, args: dict[str, Any], progress: Progress | None = None) -> Reply:
        data: dict[str, Any] = {"prompt": args["prompt"], "origin": "mcp"}
        for key in ("model", "system"):
            if key in args:
                data[key] = args[key]
        if "continuation_id" in args:
            data["conversation_id"] = args["continuation_id"]
        if "files" in args:
            data["files"] = [self._path(f) for f in args["files"]]
        return self._turn(await self._run(COMPLETION_ASYNC, data, progress))

    async def consensus(self, args: dict[str, Any], progress: Progress | None = None) -> Reply:
        if ("consortium" in args) == ("models" in args):
            raise KsiError(ErrorCode.VALIDATION_ERROR, "consensus: give either consortium or models",
                           fields={"consortium": "give this or models", "models": "give this or consortium"})
        data: dict[str, Any] = {"prompt": args["prompt"], "origin": "mcp"}
        if "consortium" in args:
            data["model"] = f"consortium/{args['consortium'].removeprefix('consortium/')}"  # either spelling
        elif not args["models"]:
            raise KsiError(ErrorCode.VALIDATION_ERROR, "consensus: models must name at least one model",
                           fields={"models": "must not be empty"})
        else:
            data["consortium"] = {"members": args["models"], "arbiter": args["models"][0]}
        if "continuation_id" in args:
            data["conversation_id"] = args["continuation_id"]
        result = await self._run(COMPLETION_ASYNC, data, progress)
        run = result.get("consortium") or {}
        reply = self._turn(result, {"confidence": run.get("confidence"), "dissent": run.get("dissent") or "",
                                    "run_id": run.get("run_id")})
        lines = [reply.text, f"confidence: {run.get('confidence')}"]
        if run.get("dissent"):
            lines.append(f"dissent: {run['dissent']}")
        return Reply("\n".join(lines), reply.data)

    async def agent_message(self, args: dict[str, Any], progress: Progress | None = None) -> Reply:
        result = await self._run(AGENT_SEND_MESSAGE, {"agent_id": args["agent_id"], "message": args["message"]},
                                 progress)
        return self._turn(result, {"agent_id": args["agent_id"]})

    async def _run(self, event: str, data: dict[str, Any], progress: Progress | None) -> dict[str, Any]:
        """Send a turn's `event` and wait for its answer; with `progress`, the answer is streamed
        and reported while it arrives (and while nothing arrives, a reasoning model's silence)."""
        if progress is None:
            return await self._answer(await self.caller.request(event, data))
        stream = AnswerStream()
        stop_watching = await self.caller.watch((COMPLETION_CHUNK,), stream.on_chunk)
        try:
            ack = await self.caller.request(event, {**data, "stream": True})
            stream.follow(ack["request_id"])
            reporting = asyncio.get_running_loop().create_task(self._report(stream, progress))
            try:
                return await self._answer(ack)
            finally:
                reporting.cancel()
                await asyncio.gather(reporting, return_exceptions=True)  # a client gone stops only the reports
        finally:
            await stop_watching()

    async def _report(self, stream: AnswerStream, progress: Progress) -> None:
        sent = 0
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(PROGRESS_EVERY):
                    await stream.changed.wait()
            stream.changed.clear()
            sent += 1
            await progress(sent, stream.text(PROGRESS_TEXT))
            await asyncio.sleep(PROGRESS_GAP)

    async def _answer(self, ack: dict[str, Any]) -> dict[str, Any]:
        """Wait for the request `ack` acknowledged; a cancelled tool call cancels it in KSI too."""
        request_id = ack["request_id"]
        try:
            return await wait_for_result(self.caller, request_id)
        except asyncio.CancelledError:
            # sent from a task of its own: this one may be cancelled again at every await
            task = asyncio.get_running_loop().create_task(
                self.caller.request(COMPLETION_CANCEL, {"request_id": request_id}))
            self._cancels.add(task)
            task.add_done_callback(self._cancel_sent)
            raise

    def _cancel_sent(self, task: asyncio.Task[Any]) -> None:
        self._cancels.discard(task)
        if not task.cancelled():
            task.exception()  # a daemon gone meanwhile has nothing left to cancel

    def _turn(self, result: dict[str, Any], extra: dict[str, Any] | None = None) -> Reply:
        conversation_id = result["conversation_id"]
        history = result.get("history") or {}
        left_out = {"exchanges": history.get("exchanges_omitted", 0), "files": history.get("files_omitted", 0)}
        data = {"answer": result["content"], "continuation_id": conversation_id, "model": result.get("model"),
                "response_id": result.get("response_id"), "turns_left": result.get("turns_left"),
                "left_out": left_out, **(extra or {})}
        facts = [f"continuation_id: {conversation_id}", f"model: {data['model']}"]
        if data["turns_left"] is not None:
            facts.append(f"turns left: {data['turns_left']}")
        if left_out["exchanges"]:
            facts.append(f"{left_out['exchanges']} earlier exchanges left out of the history sent")
        if left_out["files"]:
            facts.append(f"{left_out['files']} files left out")
        footer = "[" + " | ".join(facts) + "]"
        answer = cut(result["content"], self.output_limit - len(footer) - 2, conversation_id)
        return Reply(f"{answer}\n\n{footer}", data)

    def _path(self, path: str) -> str:
        if self.base_dir is None or Path(path).is_absolute():
            return path
        return str(self.base_dir / path)

    # -- conversations ----------------------------------------------------------
    async def conversations(self, args: dict[str, Any]) -> Reply:
        query: dict[str, Any] = {"limit": args.get("limit", LIST_LIMIT)}
        if "query" in args:
            query["text"] = args["query"]
        if "status" in args:
            query["status"] = args["status"]
        found = await self.caller.request(CONVERSATION_LIST, query)
        items = [{"continuation_id": c["conversation_id"], "title": c.get("title"), "preview": c.get("preview"),
                  "origin": c.get("origin"), "models": c.get("models") or [],
                  "turns": c.get("turns", c.get("exchanges", 0)), "inherited": c.get("inherited", 0),
                  "fork_of": c.get("parent_id"), "last_activity": c.get("last_activity"), "state": c.get("state")}
                 for c in found.get("conversations", [])]
        lines = [f"{i['continuation_id']} | {_named(i)} | {', '.join(i['models']) or '-'} | {i['turns']} turns"
                 + (f", {i['inherited']} inherited from {i['fork_of']}" if i["fork_of"] else "")
                 + f" | from {i['origin'] or 'unknown'} | {i['last_activity']}"
                 + ("" if i["state"] == "active" else f" | {i['state']}") for i in items]
        total = found.get("total", len(items))
        head = f"{len(items)} of {total} conversations (id | title or first input | models | turns | from | last activity)"
        room, kept = self.output_limit - len(head) - 100, 0
        while kept < len(lines) and room >= len(lines[kept]) + 1:  # whole lines only: a cut id is useless
            room -= len(lines[kept]) + 1
            kept += 1
        if kept < len(lines):
            lines[kept:] = [f"[{len(lines) - kept} more left out: ask for fewer or narrow the query]"]
        return Reply("\n".join([head, *lines]), {"conversations": items, "total": total})

    async def conversation(self, args: dict[str, Any]) -> Reply:
        conversation_id = args["continuation_id"]
        for key in ("pin", "unpin"):
            if args.get(key):
                await self.caller.request(f"conversation:{key}", {"conversation_id": conversation_id, "n": args[key]})
        export = await self.caller.request(CONVERSATION_EXPORT, {"conversation_id": conversation_id,
                                                                   "format": args.get("format", "markdown")})
        text = cut(export["content"], self.output_limit, conversation_id)
        return Reply(text, {"continuation_id": conversation_id, "format": export["format"],
                            "exchanges": export["exchanges"], "cut": len(text) < len(export["content"])})

    async def fork(self, args: dict[str, Any]) -> Reply:
        forked = await self.caller.request(CONVERSATION_FORK, {"conversation_id": args["continuation_id"],
                                                                 "at": args["at"], "origin": "mcp"})
        data = {"continuation_id": forked["conversation_id"], "parent_id": forked["parent_id"],
                "fork_at": forked["fork_at"]}
        return Reply(f"forked {data['parent_id']} at exchange {data['fork_at']}; continue with continuation_id: "
                     f"{data['continuation_id']}", data)


def _named(item: dict[str, Any]) -> str:
    """A conversation's title, else the start of its first input in quotes."""
    if item["title"]:
        return str(item["title"])
    return f"\u201c{item['preview']}\u201d" if item["preview"] else "(untitled)"


def error_text(code: str, message: str, details: dict[str, Any]) -> str:
    """A tool error as the client's model reads it: KSI's code first, then the message."""
    text = f"{code}: {message}"
    if details:
        text += "\n" + json.dumps(details, ensure_ascii=False, default=str)
    return text
