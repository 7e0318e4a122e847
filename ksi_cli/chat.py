"""`ksi chat`: talk with an agent in the terminal, its replies streamed as they are written.

Each line read from standard input is one `agent:send_message`; the reply streams in through a
`completion:chunk` subscription on the same connection. The agent's conversation is its id, so
`ksi chat AGENT_ID` later resumes it with the whole history. Standard library, click and the
async client only: no pydantic, no litellm, no daemon code.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import click

from ksi_cli.options import VAR_DIR_HELP
from ksi_cli.locate import Location, locate
from ksi_cli.output import EXIT_ERROR, EXIT_OK, EXIT_UNREACHABLE
from ksi_common import oneshot
from ksi_common.errors import ErrorCode, KsiError
from ksi_cli.params import Seconds
from ksi_common.limits import MAX_TIMEOUT

if TYPE_CHECKING:
    import asyncio

    from ksi_common.client import KsiClient

# asyncio and the async client are imported where they are used: every other `ksi` command
# imports this module and should not pay for them.

QUIT = ("/quit", "/exit")
FATAL = (ErrorCode.DAEMON_UNREACHABLE, ErrorCode.AGENT_NOT_FOUND, ErrorCode.AGENT_TERMINATED)


@dataclass
class Turn:
    """The request in flight, so Ctrl-C can cancel it."""

    request_id: str | None = None


def _read_line(prompt: str) -> str | None:
    """One line of input without its newline; None at end of input."""
    if sys.stdin.isatty():
        import readline  # noqa: F401  (line editing and history for input())

        try:
            return input(prompt)
        except EOFError:
            return None
    line = sys.stdin.readline()
    return line.rstrip("\n") if line else None


async def _next_line(prompt: str) -> str | None:
    """Read a line in a daemon thread: a read still blocked at exit (Ctrl-C) must not hold the process."""
    import asyncio

    loop = asyncio.get_running_loop()
    future: asyncio.Future[str | None] = loop.create_future()

    def deliver(line: str | None) -> None:
        if not future.done():
            future.set_result(line)

    def read() -> None:
        try:
            line = _read_line(prompt)
        except (OSError, ValueError, UnicodeDecodeError):
            line = None
        try:
            loop.call_soon_threadsafe(deliver, line)
        except RuntimeError:  # the loop is gone: nobody waits for this line any more
            pass

    threading.Thread(target=read, name="ksi-chat-stdin", daemon=True).start()
    return await future


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _error(error: KsiError) -> None:
    click.secho(f"error [{error.code}]: {error.message}", fg="red", err=True)


async def _open(client: KsiClient, agent_id: str | None, profile: str | None, model: str | None) -> dict[str, Any]:
    """Spawn a new agent (with --profile) or find the one to resume; returns its agent:info."""
    if profile is not None:
        data: dict[str, Any] = {"profile": profile}
        if agent_id is not None:
            data["agent_id"] = agent_id
        if model is not None:
            data["model"] = model
        agent_id = (await client.request("agent:spawn", data))["agent_id"]
    info = await client.request("agent:info", {"agent_id": agent_id})
    if info.get("status") == "terminated":
        raise KsiError(ErrorCode.AGENT_TERMINATED, f"agent {agent_id} was terminated", agent_id=agent_id)
    return info


async def _reply(client: KsiClient, agent_id: str, message: str, stream: bool, timeout: float,
                 turn: Turn) -> dict[str, Any]:
    """Send one message and show the reply, chunk by chunk when streaming; returns the result."""
    import asyncio

    ack = await client.request("agent:send_message", {"agent_id": agent_id, "message": message, "stream": stream})
    request_id = turn.request_id = ack["request_id"]
    waiter = asyncio.ensure_future(client.request("completion:wait", {"request_id": request_id, "timeout": timeout}))
    shown: list[str] = []
    pusher: asyncio.Future[dict[str, Any] | None] | None = None
    closed = not stream
    try:
        while not waiter.done():
            if closed:
                await asyncio.wait({waiter})
                break
            if pusher is None:
                pusher = asyncio.ensure_future(client.next_push())
            done, _pending = await asyncio.wait({waiter, pusher}, return_when=asyncio.FIRST_COMPLETED)
            if pusher in done:
                frame, pusher = pusher.result(), None
                if frame is None:  # the connection closed; the waiter fails with it
                    closed = True
                elif frame.get("event") == "completion:chunk" and frame["data"].get("request_id") == request_id:
                    shown.append(frame["data"].get("text", ""))
                    _write(shown[-1])
    finally:
        if pusher is not None:
            pusher.cancel()
    result = waiter.result()
    turn.request_id = None
    if "content" not in result:
        raise KsiError(ErrorCode.TIMEOUT, f"no reply within {timeout:g}s; request {request_id} is {result.get('status')}",
                       request_id=request_id)
    # Chunks still queued when the answer came are not waited for: the answer completes the text.
    content, streamed = result["content"], "".join(shown)
    _write((content[len(streamed):] if content.startswith(streamed) else "\n" + content) + "\n")
    return result


async def _session(location: Location, agent_id: str | None, profile: str | None, model: str | None,
                   stream: bool, timeout: float, turn: Turn) -> int:
    from ksi_common.client import KsiClient

    client = KsiClient(location.socket)
    try:
        await client.connect()
    except KsiError as error:
        _error(error)
        click.echo("Is the daemon running? Start it with: ksi daemon start", err=True)
        return EXIT_UNREACHABLE
    try:
        try:
            info = await _open(client, agent_id, profile, model)
            if stream:
                await client.request("monitor:subscribe", {"patterns": ["completion:chunk"]})
        except KsiError as error:
            _error(error)
            if error.code == ErrorCode.AGENT_NOT_FOUND and profile is None:
                click.echo("Start a new agent with: ksi chat --profile assistant", err=True)
            return EXIT_UNREACHABLE if error.code == ErrorCode.DAEMON_UNREACHABLE else EXIT_ERROR
        agent_id = info["agent_id"]
        click.secho(f"agent {agent_id} (profile {info.get('profile') or '-'}, model {info.get('model')})", bold=True)
        click.secho(f"conversation {info['conversation_id']}, {info.get('exchanges', 0)} exchanges so far; "
                    f"/quit or Ctrl-D ends, `ksi chat {agent_id}` resumes", dim=True)
        while True:
            line = await _next_line("you> ")
            if line is None or line.strip() in QUIT:
                return EXIT_OK
            if not line.strip():
                continue
            _write(f"{agent_id}> ")
            try:
                await _reply(client, agent_id, line, stream, timeout, turn)
            except KsiError as error:
                _write("\n")
                _error(error)
                if error.code in FATAL:
                    return EXIT_UNREACHABLE if error.code == ErrorCode.DAEMON_UNREACHABLE else EXIT_ERROR
    finally:
        await client.close()


@click.command()
@click.argument("agent_id", required=False)
@click.option("--profile", "-p", help="Spawn a new agent from this profile (AGENT_ID, if given, names it).")
@click.option("--model", "-m", help="Model of a new agent (default: the profile's, else the daemon's).")
@click.option("--no-stream", is_flag=True, help="Show each reply whole instead of as it is written.")
@click.option("--timeout", type=Seconds(MAX_TIMEOUT), default=300.0, show_default=True, help="Seconds to wait for each reply.")
@click.option("--var-dir", help=VAR_DIR_HELP)
@click.option("--socket", "socket_path", help="Unix socket of the daemon.")
def chat(agent_id: str | None, profile: str | None, model: str | None, no_stream: bool, timeout: float,
         var_dir: str | None, socket_path: str | None) -> None:
    """Chat with agent AGENT_ID (resuming its conversation), or with a new one: --profile P."""
    if agent_id is None and profile is None:
        raise click.UsageError("give AGENT_ID to resume an agent, or --profile P to start a new one")
    if model is not None and profile is None:
        raise click.UsageError("--model applies to a new agent: use it with --profile")
    if timeout <= 0:
        raise click.UsageError("--timeout must be positive")
    import asyncio

    location = locate(var_dir, socket_path)
    turn = Turn()
    try:
        code = asyncio.run(_session(location, agent_id, profile, model, not no_stream, timeout, turn))
    except KeyboardInterrupt:
        if turn.request_id is not None:  # do not leave the interrupted reply running
            try:
                oneshot.request(location.socket, "completion:cancel", {"request_id": turn.request_id}, timeout=5.0)
            except KsiError:
                pass
        click.echo("", err=True)
        code = EXIT_OK
    sys.exit(code)
