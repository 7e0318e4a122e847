"""`ksi conversation sent`: what the model was sent for one exchange (the daemon's
`conversation:sent`; the daemon must be running), with the prompt-cache breakpoints each message
carried and where the request first differed from the previous one."""

from __future__ import annotations

from typing import Any

import click

from ksi_cli import completion
from ksi_cli.options import json_option, location_options
from ksi_cli.output import dumps, wants_json
from ksi_cli.send import request_or_exit
from ksi_common.events import CONVERSATION_SENT
from ksi_common.locate import locate

DIFFERS = "---- differs from the previous request from here ----"


def _comparison(sent: dict[str, Any]) -> str:
    previous, index = sent.get("compared_with"), sent.get("first_difference")
    if previous is None:
        return "the first request: nothing to compare with"
    if index is None:
        return f"the same messages as #{previous}"
    if sent.get("extends_previous"):
        return f"extends the request of #{previous} (new from message {index + 1})"
    return f"differs from the request of #{previous} from message {index + 1}"


def _breakpoint(mark: dict[str, Any]) -> str:
    who = "the client's" if mark.get("by") == "client" else "KSI's"
    part = " (summary)" if mark.get("part") == "summary" else ""
    return f"  ^ cache breakpoint{part}: {mark.get('ttl') or 'explicit'}, {who}"


def sent_lines(sent: dict[str, Any]) -> list[str]:
    """`conversation:sent` as plain lines: a header, then each message, its breakpoints under it."""
    marks = sent.get("breakpoints")
    lines = [f"exchange #{sent['n']} of {sent['conversation_id']}, to {sent.get('model')}",
             "cache breakpoints: " + ("not recorded" if marks is None else str(len(marks)) if marks else "none"),
             _comparison(sent)]
    difference = sent.get("first_difference")
    for index, message in enumerate(sent.get("messages") or []):
        if index == difference:
            lines.append(DIFFERS)
        where = f"from #{message['n']}" if message.get("part") == "history" else message.get("part")
        lines.append(f"[{index + 1}] {message.get('role')} ({where})")
        lines.extend(f"    {line}" for line in str(message.get("content") or "").splitlines())
        lines.extend(f"    -> call {c.get('name')}({c.get('arguments')})" for c in message.get("tool_calls") or [])
        lines.extend(_breakpoint(mark) for mark in message.get("cache_breakpoints") or [])
    if difference is not None and difference >= len(sent.get("messages") or []):
        lines.append("---- the previous request went on from here ----")
    return lines


@click.command(name="sent")
@location_options
@json_option
@click.argument("conversation_id", shell_complete=completion.conversations)
@click.argument("n", type=click.IntRange(min=1))
def sent(conversation_id: str, n: int, as_json: bool, var_dir: str | None, socket_path: str | None) -> None:
    """Show what the model was sent for exchange N of CONVERSATION_ID, its cache breakpoints and
    where it first differed from the exchange before."""
    reply = request_or_exit(locate(var_dir, socket_path), CONVERSATION_SENT,
                            {"conversation_id": conversation_id, "n": n}, as_json)
    click.echo(dumps(reply) if wants_json(as_json) else "\n".join(sent_lines(reply)))
