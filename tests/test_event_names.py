"""Event names are defined once, beside their payload models; each one, and each name a door or
the client spells out itself, is known to the router of a started daemon, so a typo cannot hide."""

from __future__ import annotations

import re
from pathlib import Path
from types import ModuleType

from ksi_daemon.daemon import Daemon
from ksi_daemon.services import system
from ksi_daemon.services.completion import models as completion_models
from ksi_daemon.services.conversations import models as conversation_models
from tests.conftest import running_daemon

ROOT = Path(__file__).resolve().parent.parent
NAME = re.compile(r"[a-z]+:[a-z_]+")
# a whole string literal that is an event name ("completion:async"), not a sentence naming one
LITERAL = re.compile(r"""["']((?:system|monitor|completion|agent|conversation|consortium):[a-z_]+)["']""")
# written by the socket door itself to a subscriber that fell behind, never on the bus
DOOR_PUSHES = {"monitor:overflow"}


def constants(module: ModuleType) -> dict[str, str]:
    return {name: value for name, value in vars(module).items()
            if name.isupper() and isinstance(value, str) and NAME.fullmatch(value)}


def unknown(daemon: Daemon, names: set[str]) -> list[str]:
    missed = []
    for name in sorted(names):
        try:
            daemon.router.check_pattern(name)  # a handled event, or one declared as emitted
        except Exception:
            missed.append(name)
    return missed


async def test_every_event_constant_is_known_to_the_router(short_tmp: Path) -> None:
    defined = {**constants(completion_models), **constants(conversation_models), **constants(system)}
    assert {"COMPLETION_ASYNC", "COMPLETION_RESULT", "CONVERSATION_FORK", "SYSTEM_HEALTH"} <= set(defined)
    async with running_daemon(short_tmp) as daemon:
        assert unknown(daemon, set(defined.values())) == []
        assert unknown(daemon, {"completion:reslut"}) == ["completion:reslut"]  # the check itself can fail


async def test_every_event_name_spelt_out_in_the_code_is_known_to_the_router(short_tmp: Path) -> None:
    # the doors and the client keep their literals (they know no service, or must stay light)
    spelt: dict[str, set[str]] = {}
    for package in ("ksi_daemon", "ksi_cli", "ksi_common", "ksi_mcp"):
        for path in (ROOT / package).rglob("*.py"):
            for name in LITERAL.findall(path.read_text()):
                spelt.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    assert "completion:async" in spelt and "monitor:subscribe" in spelt
    async with running_daemon(short_tmp) as daemon:
        assert {name: sorted(spelt[name]) for name in unknown(daemon, set(spelt) - DOOR_PUSHES)} == {}
