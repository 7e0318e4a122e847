"""Event names are spelt once, in ksi_common.events; each one is known to the router of a started
daemon, and a name written out anywhere else in the packages fails here, so a typo cannot hide."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

from ksi_common import events
from ksi_daemon.daemon import Daemon
from tests.conftest import running_daemon

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("ksi_daemon", "ksi_cli", "ksi_common", "ksi_mcp", "ksi_llm")
NAMES_MODULE = ROOT / "ksi_common" / "events.py"
NAME = re.compile(r"[a-z]+:[a-z_]+")
DEFINED = {name: value for name, value in vars(events).items()
           if name.isupper() and isinstance(value, str) and NAME.fullmatch(value)}
NAMESPACES = "|".join(sorted({value.split(":")[0] for value in DEFINED.values()}))
# a whole string literal that is an event name ("completion:async"), not a sentence naming one
LITERAL = re.compile(rf"""(["'])((?:{NAMESPACES}):[a-z_]+)\1""")
# written by the socket door itself to a subscriber that fell behind, never on the bus
DOOR_PUSHES = {events.MONITOR_OVERFLOW}


def unknown(daemon: Daemon, names: set[str]) -> list[str]:
    missed = []
    for name in sorted(names):
        try:
            daemon.router.check_pattern(name)  # a handled event, or one declared as emitted
        except Exception:
            missed.append(name)
    return missed


def spelt_out(source: str) -> list[str]:
    """The event names a module's code writes as whole string literals (comments and prose ignored)."""
    found = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        match = LITERAL.fullmatch(token.string) if token.type == tokenize.STRING else None
        if match:
            found.append(match.group(2))
    return found


async def test_every_event_name_is_known_to_the_router(short_tmp: Path) -> None:
    assert {"COMPLETION_ASYNC", "COMPLETION_RESULT", "CONVERSATION_FORK", "SYSTEM_HEALTH"} <= set(DEFINED)
    async with running_daemon(short_tmp) as daemon:
        assert unknown(daemon, set(DEFINED.values()) - DOOR_PUSHES) == []
        assert unknown(daemon, {"completion:reslut"}) == ["completion:reslut"]  # the check itself can fail


def test_no_event_name_is_spelt_out_outside_the_names_module() -> None:
    spelt: dict[str, list[str]] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path != NAMES_MODULE:
                for name in spelt_out(path.read_text()):
                    spelt.setdefault(str(path.relative_to(ROOT)), []).append(name)
    assert spelt == {}


def test_the_check_finds_a_literal_and_passes_over_prose() -> None:
    code = 'send("completion:async", {})  # "completion:wait" in a comment\n"""A docstring naming completion:result."""\n'
    assert spelt_out(code) == ["completion:async"]
    assert spelt_out(NAMES_MODULE.read_text()) != []  # the names module itself is where they are spelt
