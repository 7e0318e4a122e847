"""`ksi ask`: one question to a model, answered in a conversation that can be continued.

On one blocking connection it subscribes to `completion:chunk`, sends `completion:async`
with `stream` on, then `completion:wait`, and writes each chunk as it arrives (a spinner on
the terminal until the first). It records the conversation of the last successful ask in
`var/state/client.json` so `ksi ask --continue` picks it up explicitly (never guessed from
the files under `var/logs`). Standard library and click only: no pydantic, no litellm, no
daemon code, no asyncio.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import click

from ksi_cli import completion
from ksi_cli.event_args import EventArgsError, json_value
from ksi_cli.options import VAR_DIR_HELP
from ksi_cli.output import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_UNREACHABLE, dumps, report_error
from ksi_cli.params import Seconds
from ksi_common import oneshot
from ksi_common.errors import ErrorCode, KsiError
from ksi_common.events import COMPLETION_ASYNC, COMPLETION_CANCEL, COMPLETION_CHUNK, MONITOR_SUBSCRIBE
from ksi_common.limits import MAX_TIMEOUT
from ksi_common.locate import Location, locate
from ksi_common.privacy import private_dir
from ksi_common.submitting import follow_blocking

LAST_ASK = "last_ask"
TOP_LEVEL_OPTIONS = ("temperature", "max_tokens", "timeout")  # fields of completion:async; the rest are options


# -- the explicit record of the last ask -----------------------------------------------------
def read_client_state(location: Location) -> dict[str, Any]:
    """The client state file of this var dir, or {} when there is none (or it is unreadable)."""
    try:
        value = json.loads(location.layout.client_state_file().read_text(encoding="utf-8"))
    except (FileNotFoundError, ValueError, OSError):
        return {}
    return value if isinstance(value, dict) else {}


def last_conversation(location: Location) -> str | None:
    last = read_client_state(location).get(LAST_ASK)
    if isinstance(last, dict) and isinstance(last.get("conversation_id"), str):
        return last["conversation_id"]
    return None


def record_last_ask(location: Location, result: dict[str, Any]) -> None:
    """Remember the conversation of a successful ask; other keys of the file are kept."""
    import tempfile  # here: it costs `ksi ask` start-up (random, hashlib) before the question is sent

    path = location.layout.client_state_file()
    state = read_client_state(location)
    state["v"] = 1
    state[LAST_ASK] = {
        "conversation_id": result.get("conversation_id"),
        "response_id": result.get("response_id"),
        "model": result.get("model"),
        "ts": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    private_dir(path.parent)
    fd, tmp = tempfile.mkstemp(prefix=".client.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(state, handle, indent=2, ensure_ascii=False)
            handle.write("\n")
        os.replace(tmp, path)  # atomic: a reader sees the old record or the new one
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# -- the question --------------------------------------------------------------------------
def question_text(words: tuple[str, ...]) -> str:
    """The words, after piped standard input when there is some (`cat f | ksi ask "summarise"`)."""
    text = " ".join(words)
    if text == "-":
        return sys.stdin.read()
    if not sys.stdin.isatty():
        piped = sys.stdin.read()
        if piped.strip():
            return f"{piped.rstrip()}\n\n{text}" if text.strip() else piped
    return text


def request_data(text: str, model: str | None, conversation_id: str | None, system: str | None,
                 agent: str | None, files: tuple[str, ...], options: tuple[tuple[str, str], ...],
                 stream: bool) -> dict[str, Any]:
    data: dict[str, Any] = {"prompt": text, "stream": stream, "origin": "cli"}
    for key, value in (("model", model), ("conversation_id", conversation_id), ("system", system),
                       ("agent_id", agent)):
        if value is not None:
            data[key] = value
    if files:
        data["files"] = [str(Path(name).absolute()) for name in files]
    provider_options: dict[str, Any] = {}
    for key, raw in options:
        value = json_value(raw)
        if key in TOP_LEVEL_OPTIONS:
            data[key] = value
        else:
            provider_options[key] = value
    if provider_options:
        data["options"] = provider_options
    return data


# -- output ----------------------------------------------------------------------------------
def summary(result: dict[str, Any]) -> str:
    """The line after the answer: model, tokens, cost, ids (the provider's token counts when it sent them)."""
    usage = result.get("usage") or {}
    parts = [str(result.get("model"))]
    if usage:
        parts.append(f"{usage.get('prompt_tokens', '?')} in / {usage.get('completion_tokens', '?')} out tokens")
    if result.get("cost"):
        parts.append(f"${result['cost']:.6f}")
    line = f"conversation {result.get('conversation_id')}  response {result.get('response_id')}  ({', '.join(parts)})"
    if result.get("run_id"):
        line += f"  run {result['run_id']}"
    return line


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _pending_error(result: dict[str, Any], request_id: str, timeout: float,
                   conversation_id: str | None) -> KsiError:
    return KsiError(ErrorCode.TIMEOUT, f"no answer within {timeout:g}s; request {request_id} is still "
                                       f"{result.get('status', 'pending')}",
                    request_id=request_id, conversation_id=conversation_id, status=result.get("status"))


def converse(location: Location, data: dict[str, Any], timeout: float, show_chunks: bool,
             request_ids: list[str]) -> dict[str, Any]:
    """Send the question and return the result, writing chunks as they come when `show_chunks`."""
    streamed: list[str] = []
    spinner = None
    if show_chunks and sys.stderr.isatty():
        from ksi_cli.spinner import Spinner  # a thread: only on a terminal

        spinner = Spinner(label="thinking").start()
    try:
        with oneshot.Connection(location.socket, timeout=timeout + 10) as connection:
            if data["stream"]:
                connection.request(MONITOR_SUBSCRIBE, {"patterns": [COMPLETION_CHUNK]})
            ack = connection.request(COMPLETION_ASYNC, data)
            request_id = ack["request_id"]
            request_ids.append(request_id)
            result: dict[str, Any] = {}
            for event, payload in follow_blocking(connection, request_id, timeout, once=True):
                if event != COMPLETION_CHUNK:  # the result, or the status when the wait ended first
                    result = payload
                elif show_chunks and payload.get("text"):
                    if spinner is not None:
                        spinner.stop()
                    streamed.append(payload["text"])
                    _write(payload["text"])
    finally:
        if spinner is not None:
            spinner.stop()
    if "content" not in result:  # still queued or running when the wait ended
        if streamed:
            _write("\n")
        raise _pending_error(result, request_id, timeout, ack.get("conversation_id"))
    if show_chunks:
        # chunks still in flight when the answer came are not waited for: the answer completes the text
        content, shown = result["content"], "".join(streamed)
        _write((content[len(shown):] if content.startswith(shown) else ("\n" if shown else "") + content) + "\n")
    return result


def _cancel(location: Location, request_id: str) -> None:
    try:
        oneshot.request(location.socket, COMPLETION_CANCEL, {"request_id": request_id}, timeout=5.0)
    except KsiError:
        pass  # already finished, or the daemon is gone: nothing left to stop


# -- the command -----------------------------------------------------------------------------
@click.command()
@click.argument("question", nargs=-1)
@click.option("--model", "-m", help="Model to answer (default: the conversation's last, else KSI_DEFAULT_MODEL).")
@click.option("--continue", "-c", "continue_last", is_flag=True,
              help="Continue the conversation of the last `ksi ask` on this var dir.")
@click.option("--cid", "--conversation", "conversation_id", shell_complete=completion.conversations, help="Continue this conversation id.")
@click.option("--system", "-s", help="System prompt; replaces the conversation's from now on.")
@click.option("--agent", "-a", shell_complete=completion.agents, help="Ask as this agent (its profile's system prompt and model).")
@click.option("--files", "-f", multiple=True, help="Attach a file (repeatable; within KSI_ALLOWED_FILE_ROOTS).")
@click.option("--option", "-o", "options", type=(str, str), multiple=True, metavar="KEY VALUE",
              help="A model option, e.g. -o temperature 0.2 -o seed 7 (values read as JSON).")
@click.option("--no-stream", is_flag=True, help="Print the answer whole when it is complete.")
@click.option("--timeout", type=Seconds(MAX_TIMEOUT), default=300.0, show_default=True,
              help="Seconds to wait for the answer.")
@click.option("--json", "as_json", is_flag=True, help="Print the whole result as JSON.")
@click.option("--var-dir", help=VAR_DIR_HELP)
@click.option("--socket", "socket_path", help="Unix socket of the daemon.")
def ask(question: tuple[str, ...], model: str | None, continue_last: bool, conversation_id: str | None,
        system: str | None, agent: str | None, files: tuple[str, ...], options: tuple[tuple[str, str], ...],
        no_stream: bool, timeout: float, as_json: bool, var_dir: str | None, socket_path: str | None) -> None:
    """Ask QUESTION and stream the answer; -c continues the last conversation, --cid ID a named one.

    Piped standard input comes before QUESTION (`cat f | ksi ask "summarise"`); `-` reads
    the whole question from it. The answer is plain text (JSON with --json); a line with the
    model, tokens, cost and ids goes to standard error.
    """
    text = question_text(question)
    if not text.strip():
        raise click.UsageError("the question is empty")
    if conversation_id is not None and continue_last:
        raise click.UsageError("give either --cid ID or --continue, not both")
    if timeout <= 0:
        raise click.UsageError("--timeout must be positive")
    location = locate(var_dir, socket_path)
    if continue_last:
        conversation_id = last_conversation(location)
        if conversation_id is None:
            raise click.UsageError(
                f"--continue: no earlier `ksi ask` is recorded for {location.var_dir} "
                f"(in {location.layout.client_state_file()}); ask once without --continue first")
    try:
        data = request_data(text, model, conversation_id, system, agent, files, options, not as_json and not no_stream)
    except EventArgsError as exc:
        raise click.UsageError(f"-o: {exc}") from None

    request_ids: list[str] = []
    try:
        result = converse(location, data, timeout, show_chunks=not as_json, request_ids=request_ids)
    except KeyboardInterrupt:
        if request_ids:
            _cancel(location, request_ids[-1])
            click.echo(f"\ncancelled request {request_ids[-1]}", err=True)
        sys.exit(EXIT_INTERRUPTED)
    except KsiError as error:
        report_error(error, as_json, location)
        if error.code == ErrorCode.TIMEOUT and request_ids:
            click.echo(f"Wait for it with: ksi send --wait completion:wait --request-id {request_ids[-1]}", err=True)
        sys.exit(EXIT_UNREACHABLE if error.code == ErrorCode.DAEMON_UNREACHABLE else EXIT_ERROR)
    try:
        record_last_ask(location, result)
    except OSError as exc:
        click.secho(f"warning: could not record this conversation for --continue: {exc}", fg="yellow", err=True)
    if as_json:
        click.echo(dumps(result))
    else:
        click.secho(summary(result), dim=True, err=True)
