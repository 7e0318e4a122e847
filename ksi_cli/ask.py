"""`ksi ask`: one question to a model, answered in a conversation that can be continued.

It sends `completion:async` then `completion:wait` with the blocking client, prints the
answer, and records the conversation of the last successful ask in
`var/state/client.json` so `ksi ask --continue` can pick it up explicitly (never guessed
from the files under `var/logs`). Standard library and click only: no pydantic, no litellm,
no daemon code.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click

from ksi_cli.options import VAR_DIR_HELP
from ksi_cli.locate import Location, locate
from ksi_cli.output import EXIT_ERROR, EXIT_UNREACHABLE, wants_json
from ksi_common import oneshot
from ksi_common.errors import ErrorCode, KsiError
from ksi_cli.params import Seconds
from ksi_common.privacy import private_dir
from ksi_common.limits import MAX_TIMEOUT

ACK_TIMEOUT = 30.0  # seconds for completion:async's acknowledgement
LAST_ASK = "last_ask"


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


# -- output ----------------------------------------------------------------------------------
def _start_hint(var_dir: str | None, socket_path: str | None) -> str:
    words = ["ksi", "daemon", "start"]
    if var_dir:
        words += ["--var-dir", var_dir]
    if socket_path:
        words += ["--socket", socket_path]
    return " ".join(words)


def _fail(error: KsiError, as_json: bool, hint: str | None = None) -> None:
    """Show an error and exit: 3 when the daemon is unreachable, else 1."""
    unreachable = error.code == ErrorCode.DAEMON_UNREACHABLE
    if wants_json(as_json):
        click.echo(json.dumps({"error": error.to_wire()}, ensure_ascii=False, default=str))
    else:
        click.secho(f"error [{error.code}]: {error.message}", fg="red", err=True)
    if hint:
        click.echo(hint, err=True)
    sys.exit(EXIT_UNREACHABLE if unreachable else EXIT_ERROR)


def _show_result(result: dict[str, Any], as_json: bool) -> None:
    if wants_json(as_json):
        click.echo(json.dumps(result, ensure_ascii=False, default=str))
        return
    click.echo(result.get("content", ""))
    click.secho(f"conversation {result.get('conversation_id')}  response {result.get('response_id')}"
                f"  ({result.get('model')})", dim=True)


# -- the command -----------------------------------------------------------------------------
@click.command()
@click.argument("question", nargs=-1, required=True)
@click.option("--model", "-m", help="Model to answer (default: the conversation's last, else the daemon's default).")
@click.option("--conversation", "-c", "conversation_id", help="Continue this conversation id.")
@click.option("--continue", "continue_last", is_flag=True,
              help="Continue the conversation of the last `ksi ask` on this var dir.")
@click.option("--system", "-s", help="System prompt; replaces the conversation's from now on.")
@click.option("--timeout", type=Seconds(MAX_TIMEOUT), default=300.0, show_default=True,
              help="Seconds to wait for the answer.")
@click.option("--json", "as_json", is_flag=True, help="Print the whole result as JSON even on a terminal.")
@click.option("--var-dir", help=VAR_DIR_HELP)
@click.option("--socket", "socket_path", help="Unix socket of the daemon.")
def ask(question: tuple[str, ...], model: str | None, conversation_id: str | None, continue_last: bool,
        system: str | None, timeout: float, as_json: bool, var_dir: str | None, socket_path: str | None) -> None:
    """Ask QUESTION and print the answer; --continue carries on the last conversation.

    QUESTION may be several words; `-` reads it from standard input.
    """
    text = " ".join(question)
    if text == "-":
        text = sys.stdin.read()
    if not text.strip():
        raise click.UsageError("the question is empty")
    if conversation_id is not None and continue_last:
        raise click.UsageError("give either --conversation ID or --continue, not both")
    if timeout <= 0:
        raise click.UsageError("--timeout must be positive")
    location = locate(var_dir, socket_path)
    if continue_last:
        conversation_id = last_conversation(location)
        if conversation_id is None:
            raise click.UsageError(
                f"--continue: no earlier `ksi ask` is recorded for {location.var_dir} "
                f"(in {location.layout.client_state_file()}); ask once without --continue first")

    data: dict[str, Any] = {"prompt": text}
    for key, value in (("model", model), ("conversation_id", conversation_id), ("system", system)):
        if value is not None:
            data[key] = value
    hint = f"Is the daemon running? Start it with: {_start_hint(var_dir, socket_path)}"

    try:
        ack = oneshot.request(location.socket, "completion:async", data, timeout=ACK_TIMEOUT)
    except KsiError as error:
        _fail(error, as_json, hint if error.code == ErrorCode.DAEMON_UNREACHABLE else None)
        return
    request_id = ack["request_id"]
    try:
        result = oneshot.request(location.socket, "completion:wait",
                                 {"request_id": request_id, "timeout": timeout}, timeout=timeout + 10)
    except KeyboardInterrupt:
        try:
            oneshot.request(location.socket, "completion:cancel", {"request_id": request_id}, timeout=5.0)
        except KsiError:
            pass
        raise
    except KsiError as error:
        _fail(error, as_json, hint if error.code == ErrorCode.DAEMON_UNREACHABLE else None)
        return
    if "content" not in result:  # still queued or running when the wait ended
        _fail(KsiError(ErrorCode.TIMEOUT, f"no answer within {timeout:g}s; request {request_id} is still "
                                          f"{result.get('status', 'pending')}",
                       request_id=request_id, conversation_id=ack.get("conversation_id"),
                       status=result.get("status")),
              as_json, f"Wait for it with: ksi send completion:wait --request-id {request_id} --timeout 300")
        return
    try:
        record_last_ask(location, result)
    except OSError as exc:
        click.secho(f"warning: could not record this conversation for --continue: {exc}", fg="yellow", err=True)
    _show_result(result, as_json)
