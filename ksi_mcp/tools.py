"""The tool handlers: each checks its arguments, calls KSI's events and shapes the reply."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ksi_common.errors import ErrorCode, KsiError
from ksi_mcp.caller import Caller
from ksi_mcp.schemas import checked_arguments

WAIT_SLICE = 300.0  # seconds per completion:wait; a longer answer is waited for again
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
        self._handlers: dict[str, Callable[[dict[str, Any]], Awaitable[Reply]]] = {
            "chat": self.chat, "consensus": self.consensus, "conversations": self.conversations,
            "conversation": self.conversation, "fork": self.fork, "agent_message": self.agent_message,
        }

    async def call(self, name: str, arguments: dict[str, Any] | None) -> Reply:
        """Run tool `name`; bad input or a failed event raises `KsiError` with KSI's code."""
        args = checked_arguments(name, arguments)
        return await self._handlers[name](args)

    # -- turns ------------------------------------------------------------------
    async def chat(self, args: dict[str, Any]) -> Reply:
        data: dict[str, Any] = {"prompt": args["prompt"]}
        for key in ("model", "system"):
            if key in args:
                data[key] = args[key]
        if "continuation_id" in args:
            data["conversation_id"] = args["continuation_id"]
        if "files" in args:
            data["files"] = [self._path(f) for f in args["files"]]
        return self._turn(await self._answer(await self.caller.request("completion:async", data)))

    async def consensus(self, args: dict[str, Any]) -> Reply:
        if ("consortium" in args) == ("models" in args):
            raise KsiError(ErrorCode.VALIDATION_ERROR, "consensus: give either consortium or models",
                           fields={"consortium": "give this or models", "models": "give this or consortium"})
        data: dict[str, Any] = {"prompt": args["prompt"]}
        if "consortium" in args:
            data["model"] = f"consortium/{args['consortium'].removeprefix('consortium/')}"  # either spelling
        elif not args["models"]:
            raise KsiError(ErrorCode.VALIDATION_ERROR, "consensus: models must name at least one model",
                           fields={"models": "must not be empty"})
        else:
            data["consortium"] = {"members": args["models"], "arbiter": args["models"][0]}
        if "continuation_id" in args:
            data["conversation_id"] = args["continuation_id"]
        result = await self._answer(await self.caller.request("completion:async", data))
        run = result.get("consortium") or {}
        reply = self._turn(result, {"confidence": run.get("confidence"), "dissent": run.get("dissent") or "",
                                    "run_id": run.get("run_id")})
        lines = [reply.text, f"confidence: {run.get('confidence')}"]
        if run.get("dissent"):
            lines.append(f"dissent: {run['dissent']}")
        return Reply("\n".join(lines), reply.data)

    async def agent_message(self, args: dict[str, Any]) -> Reply:
        ack = await self.caller.request("agent:send_message", {"agent_id": args["agent_id"], "message": args["message"]})
        return self._turn(await self._answer(ack), {"agent_id": args["agent_id"]})

    async def _answer(self, ack: dict[str, Any]) -> dict[str, Any]:
        """Wait for the request `ack` acknowledged; a cancelled tool call cancels it in KSI too."""
        request_id = ack["request_id"]
        try:
            while True:
                result = await self.caller.request("completion:wait", {"request_id": request_id, "timeout": WAIT_SLICE})
                if "content" in result:
                    return result
        except asyncio.CancelledError:
            # sent from a task of its own: this one may be cancelled again at every await
            task = asyncio.get_running_loop().create_task(
                self.caller.request("completion:cancel", {"request_id": request_id}))
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
        found = await self.caller.request("conversation:list", query)
        items = [{"continuation_id": c["conversation_id"], "title": c.get("title"), "models": c.get("models") or [],
                  "turns": c.get("exchanges", 0), "last_activity": c.get("last_activity"), "state": c.get("state")}
                 for c in found.get("conversations", [])]
        lines = [f"{i['continuation_id']} | {i['title'] or '(untitled)'} | {', '.join(i['models']) or '-'} | "
                 f"{i['turns']} turns | {i['last_activity']}" + ("" if i["state"] == "active" else f" | {i['state']}")
                 for i in items]
        total = found.get("total", len(items))
        head = f"{len(items)} of {total} conversations (id | title | models | turns | last activity)"
        return Reply(cut("\n".join([head, *lines]), self.output_limit, None), {"conversations": items, "total": total})

    async def conversation(self, args: dict[str, Any]) -> Reply:
        conversation_id = args["continuation_id"]
        for key in ("pin", "unpin"):
            if args.get(key):
                await self.caller.request(f"conversation:{key}", {"conversation_id": conversation_id, "n": args[key]})
        export = await self.caller.request("conversation:export", {"conversation_id": conversation_id,
                                                                   "format": args.get("format", "markdown")})
        text = cut(export["content"], self.output_limit, conversation_id)
        return Reply(text, {"continuation_id": conversation_id, "format": export["format"],
                            "exchanges": export["exchanges"], "cut": len(text) < len(export["content"])})

    async def fork(self, args: dict[str, Any]) -> Reply:
        forked = await self.caller.request("conversation:fork", {"conversation_id": args["continuation_id"],
                                                                 "at": args["at"]})
        data = {"continuation_id": forked["conversation_id"], "parent_id": forked["parent_id"],
                "fork_at": forked["fork_at"]}
        return Reply(f"forked {data['parent_id']} at exchange {data['fork_at']}; continue with continuation_id: "
                     f"{data['continuation_id']}", data)


def error_text(code: str, message: str, details: dict[str, Any]) -> str:
    """A tool error as the client's model reads it: KSI's code first, then the message."""
    text = f"{code}: {message}"
    if details:
        text += "\n" + json.dumps(details, ensure_ascii=False, default=str)
    return text
