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

from ksi_cli import completion
from ksi_cli.options import VAR_DIR_HELP
from ksi_cli.output import EXIT_ERROR, EXIT_OK, EXIT_UNREACHABLE
from ksi_cli.params import Seconds
from ksi_common import oneshot
from ksi_common.errors import ErrorCode, KsiError
from ksi_common.events import (
    AGENT_INFO,
    AGENT_SEND_MESSAGE,
    AGENT_SPAWN,
    COMPLETION_ASYNC,
    COMPLETION_CANCEL,
    COMPLETION_CHUNK,
    CONVERSATION_DELETE,
    CONVERSATION_FORK,
    CONVERSATION_SHOW,
    CONVERSATION_STATS,
    MONITOR_SUBSCRIBE,
)
from ksi_common.ids import new_id
from ksi_common.limits import MAX_TIMEOUT
from ksi_common.locate import Location, locate

if TYPE_CHECKING:
    import asyncio

    from ksi_common.client import KsiClient

# asyncio and the async client are imported where they are used: every other `ksi` command
# imports this module and should not pay for them.

QUIT = ("/quit", "/exit")
BARE_QUIT = ("exit", "quit")  # alone on a line, as in a shell or a REPL: what a user types to leave
HELP = """/exit, /quit, exit, quit or Ctrl-D ends (resume later with the command shown at the start)
/help          this text
/model NAME    answer with NAME from now on (a conversation, not an agent)
/system TEXT   a new system prompt from the next turn on
/files PATH..  attach files to the next message
/fork          continue in a fork of this conversation (the original stays as it is)
\"\"\"          on a line of its own starts a multi-line message; another one ends it
Ctrl-C during a reply cancels that reply only."""
FATAL = (ErrorCode.DAEMON_UNREACHABLE, ErrorCode.AGENT_NOT_FOUND, ErrorCode.AGENT_TERMINATED)


@dataclass
class Turn:
    """The request in flight, so Ctrl-C can cancel it."""

    request_id: str | None = None


class Interrupted(Exception):
    """Ctrl-C during a reply: the reply is cancelled, the chat goes on."""


@dataclass
class Target:
    """Whom the chat talks to: an agent, or a conversation answered by a model."""

    agent_id: str | None = None
    conversation_id: str | None = None
    model: str | None = None
    system: str | None = None
    files: list[str] | None = None
    fresh: bool = False  # conversation_id was chosen here and is made by the next turn

    def request(self, message: str, stream: bool) -> tuple[str, dict[str, Any]]:
        """The event and data of one turn; pending /system and /files go with it, once."""
        if self.agent_id is not None:
            return AGENT_SEND_MESSAGE, {"agent_id": self.agent_id, "message": message, "stream": stream}
        data: dict[str, Any] = {"prompt": message, "stream": stream, "origin": "cli"}
        for key, value in (("conversation_id", self.conversation_id), ("model", self.model),
                           ("system", self.system), ("files", self.files)):
            if value is not None:
                data[key] = value
        if self.fresh:
            data["create"] = True
        self.system = self.files = None
        return COMPLETION_ASYNC, data


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
        agent_id = (await client.request(AGENT_SPAWN, data))["agent_id"]
    info = await client.request(AGENT_INFO, {"agent_id": agent_id})
    if info.get("status") == "terminated":
        raise KsiError(ErrorCode.AGENT_TERMINATED, f"agent {agent_id} was terminated", agent_id=agent_id)
    return info


async def _reply(client: KsiClient, target: Target, message: str, stream: bool, timeout: float,
                 turn: Turn, interrupt: asyncio.Event) -> dict[str, Any]:
    """Send one message and show the reply, chunk by chunk when streaming; returns the result.

    `interrupt` set (Ctrl-C) cancels the request in the daemon and raises Interrupted; one set
    before the ack came is acted on once the request has an id to cancel."""
    import asyncio

    event, data = target.request(message, stream)
    ack = await client.request(event, data)
    if target.agent_id is None:
        target.conversation_id, target.fresh = ack["conversation_id"], False
    request_id = turn.request_id = ack["request_id"]
    shown: list[str] = []
    following = asyncio.ensure_future(_follow(client, request_id, timeout, shown))
    stop = asyncio.ensure_future(interrupt.wait())
    try:
        done, _pending = await asyncio.wait({following, stop}, return_when=asyncio.FIRST_COMPLETED)
        if stop in done and not following.done():
            await _cancel(client, request_id)  # raises unless the reply was complete already
            await asyncio.wait({following})
    finally:
        for pending in (stop, following):
            if not pending.done():
                pending.cancel()
            elif not pending.cancelled():
                pending.exception()  # seen: a cancelled reply's failure is not reported as never retrieved
    result = following.result()
    turn.request_id = None
    if "content" not in result:
        raise KsiError(ErrorCode.TIMEOUT, f"no reply within {timeout:g}s; request {request_id} is {result.get('status')}",
                       request_id=request_id)
    # Chunks still queued when the answer came are not waited for: the answer completes the text.
    content, streamed = result["content"], "".join(shown)
    _write((content[len(streamed):] if content.startswith(streamed) else "\n" + content) + "\n")
    return result


async def _follow(client: KsiClient, request_id: str, timeout: float, shown: list[str]) -> dict[str, Any]:
    """Write each chunk of the request as it comes; its result, or its status once `timeout` passed."""
    from ksi_common.submitting import follow  # asyncio with it: loaded once a chat runs

    last: dict[str, Any] = {}
    async for event, payload in follow(client, request_id, timeout, once=True):
        if event == COMPLETION_CHUNK:
            shown.append(payload.get("text", ""))
            _write(shown[-1])
        else:
            last = payload
    return last


async def _cancel(client: KsiClient, request_id: str) -> None:
    """Cancel the request in the daemon (nothing of it is stored); Interrupted unless it was done."""
    outcome = await client.request(COMPLETION_CANCEL, {"request_id": request_id})
    if outcome.get("status") != "done":
        raise Interrupted(request_id)


async def _read_message(prompt: str) -> str | None:
    """One message: a line, or the lines between two lines of three double quotes (paste-safe)."""
    line = await _next_line(prompt)
    if line is None or line.strip() != '"""':
        return line
    lines: list[str] = []
    while (more := await _next_line("... ")) is not None and more.strip() != '"""':
        lines.append(more)
    return "\n".join(lines)


async def _command(client: KsiClient, target: Target, line: str) -> bool:
    """Handle a slash command; False when the chat should end."""
    name, _, argument = line.strip().partition(" ")
    argument = argument.strip()
    if name in QUIT:
        return False
    if name == "/help":
        click.echo(HELP)
    elif name == "/model" and argument:
        if target.agent_id is not None:
            click.echo("an agent answers with its own model; /model applies to `ksi chat --model/--cid`", err=True)
        else:
            target.model = argument
            click.secho(f"model {argument} from the next message on", dim=True)
    elif name == "/system" and argument:
        target.system = argument
        if target.agent_id is not None:
            click.echo("an agent keeps its profile's system prompt; /system applies to conversations", err=True)
        else:
            click.secho("new system prompt from the next message on", dim=True)
    elif name == "/files" and argument:
        import shlex
        from pathlib import Path

        target.files = [str(Path(word).absolute()) for word in shlex.split(argument)]
        click.secho(f"{len(target.files)} file(s) go with the next message", dim=True)
    elif name == "/fork":
        if target.conversation_id is None or target.fresh or target.agent_id is not None:
            click.echo("/fork needs a conversation with at least one exchange (not an agent's)", err=True)
        else:
            try:
                fork = await client.request(CONVERSATION_FORK, {"conversation_id": target.conversation_id,
                                                                      "origin": "cli"})
            except KsiError as error:
                _error(error)
            else:
                target.conversation_id = fork["conversation_id"]
                click.secho(f"now in fork {target.conversation_id}", dim=True)
    else:
        click.echo(f"unknown or incomplete command {name!r}; /help lists them", err=True)
    return True


async def _interruptible_reply(client: KsiClient, target: Target, message: str, stream: bool, timeout: float,
                               turn: Turn) -> dict[str, Any]:
    """_reply with Ctrl-C turned into a cancel of that reply only, for as long as it runs."""
    import asyncio
    import signal

    loop = asyncio.get_running_loop()
    interrupt = asyncio.Event()
    before = signal.getsignal(signal.SIGINT)  # asyncio.run's own: it ends the chat at the prompt
    try:
        loop.add_signal_handler(signal.SIGINT, interrupt.set)
    except (ValueError, RuntimeError):  # not the main thread: Ctrl-C stays KeyboardInterrupt
        return await _reply(client, target, message, stream, timeout, turn, interrupt)
    try:
        return await _reply(client, target, message, stream, timeout, turn, interrupt)
    finally:
        loop.remove_signal_handler(signal.SIGINT)  # that leaves Python's default, not the one before
        signal.signal(signal.SIGINT, before)


async def _unmake(client: KsiClient, target: Target) -> None:
    """Remove the conversation a failed first turn created under the id the chat chose (it holds
    no exchange), and keep the id for the next turn."""
    target.fresh = True
    try:
        await client.request(CONVERSATION_DELETE, {"conversation_id": target.conversation_id})
    except KsiError:  # never made, or the daemon went away: nothing to remove here
        pass


async def _recap(client: KsiClient, conversation_id: str, turns: int = 3) -> None:
    """The last few exchanges of a resumed conversation, so the user sees where it stands."""
    try:
        shown = await client.request(CONVERSATION_SHOW, {"conversation_id": conversation_id})
    except KsiError:
        return
    from ksi_common.items import item_line
    from ksi_common.transcripts import exchange_items

    exchanges = shown.get("exchanges") or []
    for exchange in exchanges[-turns:]:
        _lines, inputs, output = exchange_items(exchange)
        # tool outputs and calls read as `← c1: 12C` and `→ call weather(...) [c1]`; images by reference
        asked = " ".join(item_line(item) for item in inputs if item.get("role") != "system")
        answered = " ".join(item_line(item) for item in output) if exchange.get("reply") else ""
        if asked or answered:
            click.secho(f"  earlier you: {asked[:300]}", dim=True)
            click.secho(f"  earlier answer: {answered[:300]}", dim=True)


async def _connect(location: Location, stream: bool, wait: float = 0.0) -> KsiClient:
    """A connection, subscribed to chunks when streaming; retried for `wait` seconds (a restart)."""
    import asyncio

    from ksi_common.client import KsiClient

    deadline = asyncio.get_running_loop().time() + wait
    while True:
        client = KsiClient(location.socket)
        try:
            await client.connect()
            if stream:
                await client.request(MONITOR_SUBSCRIBE, {"patterns": [COMPLETION_CHUNK]})
            return client
        except KsiError:
            await client.close()
            if asyncio.get_running_loop().time() >= deadline:
                raise
            await asyncio.sleep(0.2)


async def _session(location: Location, target: Target, profile: str | None, model: str | None,
                   stream: bool, timeout: float, turn: Turn) -> int:
    try:
        client = await _connect(location, stream)
    except KsiError as error:
        _error(error)
        click.echo(f"Is the daemon running? Start it with: ksi daemon start (var dir {location.describe()})",
                   err=True)
        return EXIT_UNREACHABLE
    try:
        try:
            if target.agent_id is not None or profile is not None:
                info = await _open(client, target.agent_id, profile, model)
                target.agent_id = info["agent_id"]
                name = target.agent_id
                click.secho(f"agent {name} (profile {info.get('profile') or '-'}, model {info.get('model')})",
                            bold=True)
                click.secho(f"conversation {info['conversation_id']}, {info.get('exchanges', 0)} exchanges so far",
                            dim=True)
                if info.get("exchanges"):
                    await _recap(client, info["conversation_id"])
            else:
                name = "ksi"
                if target.conversation_id is not None:
                    shown = await client.request(CONVERSATION_STATS, {"conversation_id": target.conversation_id})
                    click.secho(f"conversation {target.conversation_id}, {shown.get('exchanges', 0)} exchanges so far",
                                bold=True)
                    await _recap(client, target.conversation_id)
                else:  # its id chosen now, so the banner can name it (the first turn creates it)
                    target.conversation_id, target.fresh = new_id("conv-"), True
                    click.secho(f"a new conversation {target.conversation_id} with "
                                f"{target.model or 'the default model'}", bold=True)
        except KsiError as error:
            _error(error)
            if error.code == ErrorCode.AGENT_NOT_FOUND and profile is None:
                click.echo("Start a new agent with: ksi chat --profile assistant", err=True)
            return EXIT_UNREACHABLE if error.code == ErrorCode.DAEMON_UNREACHABLE else EXIT_ERROR
        click.secho('/help for commands, """ for several lines, /exit or Ctrl-D ends', dim=True)
        while True:
            line = await _read_message("you> ")
            if line is None:
                break
            if not line.strip():
                continue
            if line.strip().lower() in BARE_QUIT:
                break
            if line.startswith("/") and "\n" not in line:
                if not await _command(client, target, line):
                    break
                continue
            _write(f"{name}> ")
            fresh = target.fresh
            try:
                await _interruptible_reply(client, target, line, stream, timeout, turn)
            except Interrupted as interrupted:
                _write("\n")
                click.echo(f"cancelled request {interrupted}", err=True)
                if fresh:  # the cancelled turn was its conversation's first: nothing of it stays
                    await _unmake(client, target)
            except KsiError as error:
                _write("\n")
                _error(error)
                if fresh:  # a failed first turn leaves no conversation to continue
                    await _unmake(client, target)
                if error.code == ErrorCode.DAEMON_UNREACHABLE:  # a restart: reconnect and go on
                    await client.close()
                    click.echo("reconnecting to the daemon...", err=True)
                    try:
                        client = await _connect(location, stream, wait=30.0)
                    except KsiError:
                        return EXIT_UNREACHABLE
                    click.echo("reconnected; send your message again", err=True)
                elif error.code in FATAL:
                    return EXIT_ERROR
            finally:
                turn.request_id = None
        if target.agent_id is not None:
            click.secho(f"resume with: ksi chat {target.agent_id}", dim=True)
        elif target.conversation_id is not None and not target.fresh:
            click.secho(f"resume with: ksi chat --cid {target.conversation_id}", dim=True)
        return EXIT_OK
    finally:
        await client.close()


@click.command()
@click.argument("agent_id", required=False, shell_complete=completion.agents)
@click.option("--profile", "-p", help="Spawn a new agent from this profile (AGENT_ID, if given, names it).")
@click.option("--model", "-m", help="Model: of a new agent with --profile, else of a plain conversation.")
@click.option("--cid", "conversation_id", shell_complete=completion.conversations, help="Continue this conversation (any, not only an agent's).")
@click.option("--no-stream", is_flag=True, help="Show each reply whole instead of as it is written.")
@click.option("--timeout", type=Seconds(MAX_TIMEOUT), default=300.0, show_default=True, help="Seconds to wait for each reply.")
@click.option("--var-dir", help=VAR_DIR_HELP)
@click.option("--socket", "socket_path", help="Unix socket of the daemon.")
def chat(agent_id: str | None, profile: str | None, model: str | None, conversation_id: str | None,
         no_stream: bool, timeout: float, var_dir: str | None, socket_path: str | None) -> None:
    """Chat with agent AGENT_ID, a new agent (--profile P), a model (--model M) or a conversation (--cid ID)."""
    if agent_id is not None and conversation_id is not None:
        raise click.UsageError("give AGENT_ID or --cid ID, not both")
    if agent_id is None and profile is None and model is None and conversation_id is None:
        raise click.UsageError("give AGENT_ID, --profile P, --model M or --cid ID")
    import asyncio

    location = locate(var_dir, socket_path)
    turn = Turn()
    target = Target(agent_id=agent_id, conversation_id=conversation_id,
                    model=None if profile is not None else model)
    while True:
        try:
            code = asyncio.run(_session(location, target, profile, model, not no_stream, timeout, turn))
            break
        except KeyboardInterrupt:
            # Ctrl-C during a reply cancels that reply only; at the prompt it ends the chat
            if turn.request_id is None:
                click.echo("", err=True)
                code = EXIT_OK
                break
            try:
                oneshot.request(location.socket, COMPLETION_CANCEL, {"request_id": turn.request_id}, timeout=5.0)
            except KsiError:
                pass
            click.echo(f"\ncancelled request {turn.request_id}", err=True)
            turn.request_id = None
            profile = None  # the agent exists now: resume it instead of spawning another
    sys.exit(code)
