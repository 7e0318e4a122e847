"""Inspection commands that read storage directly and work with the daemon stopped:
`ksi conversations`, `ksi conversation show|export`, `ksi response show`, `ksi logs`
(and `ksi conversation pin|unpin|sent|import|abandon-calls`, which ask the daemon).

They read through the daemon's own read port (`ksi_common.reading`, the backend named by
`KSI_STORAGE`). Standard library, click and ksi_common readers only (no pydantic, no daemon code);
a database driver is imported only when that backend is chosen.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import click

from ksi_cli import completion
from ksi_cli.abandon_calls import abandon_calls
from ksi_cli.import_command import import_conversation
from ksi_cli.options import VAR_DIR_HELP
from ksi_cli.output import EXIT_ERROR, color_enabled, fail, show, table, wants_json
from ksi_cli.pins import pin, unpin
from ksi_cli.sent_command import sent
from ksi_cli.stored import read_stored
from ksi_common import export, logview
from ksi_common.errors import ErrorCode, KsiError
from ksi_common.items import input_items, item_line, output_items
from ksi_common.locate import locate
from ksi_common.transcripts import STATES, Transcripts

T = TypeVar("T")


def _var_dir_option(command: Any) -> Any:
    return click.option("--var-dir", help=VAR_DIR_HELP)(command)


def _json_option(command: Any) -> Any:
    return click.option("--json", "as_json", is_flag=True, help="Print JSON even on a terminal.")(command)


def _read(var_dir: str | None, work: Callable[[Transcripts], Awaitable[T]]) -> T:
    """Run `work` over the transcripts of the configured backend, then release the reader."""
    return read_stored(locate(var_dir), lambda reader: work(Transcripts(reader)))


def _short_time(text: str | None) -> str:
    return (text or "").replace("T", " ")[:19]


@click.command(name="conversations")
@_var_dir_option
@_json_option
@click.option("--status", type=click.Choice(STATES), help="Only active, archived or expired ones.")
@click.option("--tag", help="Only conversations with this tag.")
@click.option("--model", help="Only conversations that used this model (glob allowed).")
@click.option("--agent", "agent_id", help="Only conversations of this agent.")
@click.option("--search", "text", help="Only conversations whose inputs or replies contain this text.")
@click.option("--since", help="Only conversations active since this ISO-8601 time.")
@click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True)
@click.option("--offset", type=click.IntRange(min=0), default=0, show_default=True)
def conversations(var_dir: str | None, as_json: bool, status: str | None, tag: str | None, model: str | None,
                  agent_id: str | None, text: str | None, since: str | None, limit: int, offset: int) -> None:
    """List conversations, most recently active first (reads var/ directly)."""
    location = locate(var_dir)
    try:
        items, total = _read(var_dir, lambda t: t.listing(time.time(), agent_id=agent_id, model=model, status=status,
                                                          tag=tag, text=text, since=since, limit=limit, offset=offset))
    except KsiError as error:
        fail(error, as_json)
        return
    if total == 0:  # say where we looked: an empty listing from the wrong var dir must not pass silently
        click.echo(f"no conversations in {location.describe()}", err=True)
    if wants_json(as_json):
        show({"conversations": items, "total": total, "limit": limit, "offset": offset}, True)
        return
    rows = []
    for item in items:
        # an untitled conversation is told apart by the start of its first input, in quotes
        title = item["title"] or (f"\u201c{item['preview']}\u201d" if item.get("preview") else "")
        if item["state"] != "active":
            title = f"{title} [{item['state']}]".strip()
        turns = str(item["turns"]) + (f" ({item['inherited']} inherited)" if item["inherited"] else "")
        rows.append({"id": item["conversation_id"], "title": title, "turns": turns, "from": item["origin"] or "unknown",
                     "fork of": f"{item['parent_id']}@{item['fork_at']}" if item["parent_id"] else None,
                     "models": ", ".join(item["models"]), "last activity": _short_time(item["last_activity"])})
    shown = f"{offset + 1}-{offset + len(items)} of {total}" if items else f"0 of {total}"
    forks = ["fork of"] if any(item["parent_id"] for item in items) else []
    table(rows, ["id", "title", "turns", *forks, "from", "models", "last activity"], title=f"Conversations ({shown})",
          whole=("id", "fork of"))


@click.group(name="conversation")
def conversation() -> None:
    """Read one conversation from var/ (the daemon may be stopped)."""


@conversation.command(name="show")
@_var_dir_option
@_json_option
@click.option("--no-inherited", is_flag=True, help="Leave out the exchanges shared with the fork chain.")
@click.argument("conversation_id", shell_complete=completion.conversations)
def conversation_show(conversation_id: str, var_dir: str | None, as_json: bool, no_inherited: bool) -> None:
    """Show CONVERSATION_ID: its facts and every exchange."""
    try:
        transcript = _read(var_dir, lambda t: t.transcript(conversation_id, not no_inherited))
    except KsiError as error:
        fail(error, as_json)
        return
    if wants_json(as_json):
        show({**transcript, "total_exchanges": len(transcript["exchanges"]), "offset": 0}, True)
        return
    from rich.console import Console

    from ksi_cli.transcript_view import print_transcript

    print_transcript(transcript, Console(color_system="auto" if color_enabled() else None, highlight=False))


@conversation.command(name="export")
@_var_dir_option
@click.option("--format", "fmt", type=click.Choice(export.FORMATS), default="markdown", show_default=True)
@click.option("--no-inherited", is_flag=True, help="Leave out the exchanges shared with the fork chain.")
@click.option("--output", "-o", type=click.Path(dir_okay=False, writable=True), help="Write to this file.")
@click.argument("conversation_id", shell_complete=completion.conversations)
def conversation_export(conversation_id: str, var_dir: str | None, fmt: str, no_inherited: bool,
                        output: str | None) -> None:
    """Export CONVERSATION_ID as markdown, json or jsonl (the daemon's conversation:export format)."""
    try:
        text = export.render(_read(var_dir, lambda t: t.transcript(conversation_id, not no_inherited)), fmt)
    except KsiError as error:
        fail(error, False)
        return
    if output:
        with open(output, "w", encoding="utf-8") as handle:
            handle.write(text)
    else:
        click.echo(text, nl=False)


conversation.add_command(pin)
conversation.add_command(unpin)
conversation.add_command(sent)
conversation.add_command(import_conversation)
conversation.add_command(abandon_calls)


@click.group(name="response")
def response() -> None:
    """Read response files from var/logs/responses."""


@response.command(name="show")
@_var_dir_option
@_json_option
@click.argument("response_id")
def response_show(response_id: str, var_dir: str | None, as_json: bool) -> None:
    """Show RESPONSE_ID (or its HTTP form, resp_ID): the request's raw inputs and its outcome."""
    response_id = response_id.removeprefix("resp_")
    try:
        record = _read(var_dir, lambda t: t.response(response_id))
        if record is None:
            raise KsiError(ErrorCode.RESPONSE_NOT_FOUND, f"no response {response_id} is stored; `ksi conversation "
                           "show ID` lists the responses of a conversation", response_id=response_id)
    except KsiError as error:
        fail(error, as_json)
        return
    data = {"response_id": record.response_id, "inputs": record.inputs, "outcome": record.outcome}
    if wants_json(as_json):
        show(data, True)
        return
    click.secho(f"response {record.response_id}", bold=True)
    for line in record.inputs:
        click.secho(f"[{line.get('type')}] {_short_time(line.get('ts'))}", fg="cyan")
        click.echo(" ".join(item_line(item) for item in input_items([line])))
        for ref in line.get("files") or []:
            click.echo(f"  file: {ref.get('path')} ({ref.get('size')} bytes)")
    outcome = record.outcome
    if outcome is None:
        click.secho("(no outcome recorded: the request was interrupted or the file is torn)", fg="yellow")
        return
    if outcome.get("type") == "error":
        click.secho(f"[error {outcome.get('code')}] {outcome.get('message')}", fg="red")
    else:
        click.secho(f"[assistant] {outcome.get('model')} {_short_time(outcome.get('ts'))}", fg="green")
        for item in output_items(outcome):
            click.echo(item_line(item))
    facts = {k: outcome.get(k) for k in ("usage", "cost", "finish_reason", "duration_ms", "attempts")
             if outcome.get(k) not in (None, [], {})}
    if facts:
        click.secho(json.dumps(facts, ensure_ascii=False, default=str), dim=True)


@click.command(name="logs")
@_var_dir_option
@_json_option
@click.option("--follow", "-f", is_flag=True, help="Keep printing new lines as they are written.")
@click.option("--level", type=click.Choice(list(logview.LEVELS), case_sensitive=False), help="Minimum level.")
@click.option("--grep", help="Only lines containing this text (case-insensitive).")
@click.option("--lines", "-n", "tail", type=click.IntRange(min=0), default=200, show_default=True,
              help="How many of the last matching lines to print first (0: all).")
def logs(var_dir: str | None, as_json: bool, follow: bool, level: str | None, grep: str | None, tail: int) -> None:
    """Print the daemon's log (var/logs/daemon/daemon.log), readable on a terminal."""
    path = locate(var_dir).layout.daemon_log
    raw = wants_json(as_json)

    def emit(record: dict[str, Any]) -> None:
        if raw:
            click.echo(json.dumps(record, ensure_ascii=False, default=str))
            return
        line = logview.render(record)
        colour = {"error": "red", "critical": "red", "warning": "yellow", "debug": "blue"}.get(
            str(record.get("level") or "").lower())
        click.secho(line, fg=colour)

    if not path.exists() and not follow:
        click.secho(f"no log at {path}", fg="yellow", err=True)
        sys.exit(EXIT_ERROR)
    # `-n 0` prints nothing (then follows, with --follow), as `tail -n 0` does
    for record in logview.read(path, level, grep, tail) if tail else []:
        emit(record)
    if not follow:
        return
    try:
        for line in logview.follow(path):
            record = logview.parse_line(line)
            if logview.keep(record, line, level, grep):
                emit(record)
                sys.stdout.flush()
    except KeyboardInterrupt:
        return


COMMANDS = [conversations, conversation, response, logs]
