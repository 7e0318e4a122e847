"""What a `ksi daemon start` or `restart` would run with, against the daemon that runs now: the
settings that differ, and whether the new HTTP address can be served (checked before anything
is stopped). Imports pydantic through the settings only when called."""

from __future__ import annotations

import json
import socket
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ksi_common.settings import Settings

# the same for both by construction (the CLI found the daemon through them)
SAME_BY_LOCATION = ("var_dir", "socket_path")
# what a start asks for itself; the file and the defaults are what any start would read
ASKED_ORIGINS = ("flag", "env", ".env")
SHOWN_AT_MOST = 48  # characters of a value in a one-line difference (a KSI_MODELS table runs to hundreds)
MISSING = object()


def settings_here(var_dir: Any, socket_path: Any, http_addr: str | None,
                  kept: dict[str, Any] | None = None) -> Settings:
    """The settings a daemon started here would run with; KsiError when invalid."""
    from ksi_common.settings import load_settings

    overrides: dict[str, Any] = {"var_dir": var_dir, "socket_path": socket_path}
    if http_addr:
        overrides["http_addr"] = http_addr
    return load_settings(kept=kept, **overrides)


def asked_for(settings: Settings) -> set[str]:
    """The settings this start was given itself (flags, environment, .env), not found by location."""
    return {name for name, origin in settings.origins.items()
            if origin in ASKED_ORIGINS and name not in SAME_BY_LOCATION}


def missing_secrets(settings: Settings, secrets: tuple[str, ...]) -> list[str]:
    """The secrets the running daemon was given that this start would not have: KSI never writes
    one to disk by itself, so a restart cannot carry them over."""
    return [f"KSI_{name.upper()}" for name in secrets if settings.origins.get(name, "default") == "default"]


def file_changes(running: dict[str, Any], origins: dict[str, str], here: Settings) -> list[str]:
    """`KSI_NAME`s whose value the configuration file changed since the running daemon read it
    (a value the daemon took from its flags or environment is not the file's to change)."""
    view = here.public_view()
    from_file = {name for name, origin in here.origins.items() if origin == "file"}
    read_from_file = {name for name, origin in origins.items() if origin in ("file", "default")}
    candidates = (from_file & read_from_file) | {name for name, origin in origins.items() if origin == "file"}
    return [f"KSI_{name.upper()}" for name in sorted(candidates)
            if name not in SAME_BY_LOCATION and running.get(name, MISSING) != view.get(name)]


def database_unreachable(settings: Settings) -> str | None:
    """Why a daemon with `settings` could not open its database, or None (also for JSONL): a
    restart asks before it stops the running daemon. asyncpg is imported only for PostgreSQL."""
    from ksi_common.dburl import mask_urls_in, url_password
    from ksi_common.storage_backends import needs_url

    if not needs_url(settings.storage) or settings.database_url is None:
        return None  # JSONL, or a missing URL, which the settings check already refused
    import asyncio

    import asyncpg

    url = settings.database_url.get_secret_value()

    async def probe() -> None:
        connection = await asyncpg.connect(url, timeout=5.0)
        await connection.close()

    try:
        asyncio.run(probe())
    except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        said = mask_urls_in(f"cannot open the database {url}: {exc}")
        password = url_password(url)
        return said.replace(password, "***") if password else said
    return None


def http_address(addr: str | None) -> tuple[str, int] | None:
    """`[HOST:]PORT` as the daemon reads it (the host defaults to 127.0.0.1); None when off or unreadable."""
    if not addr:
        return None
    host, _, port = addr.strip().rpartition(":")
    try:
        return (host.removeprefix("[").removesuffix("]") or "127.0.0.1", int(port))
    except ValueError:
        return None

def differences(running: dict[str, Any], wanted: dict[str, Any], only: set[str] | None = None,
                any_front: bool = True) -> dict[str, tuple[Any, Any]]:
    """`KSI_NAME` -> (running value, wanted value) for every setting that differs (of `only`, when
    given); with `any_front`, a wanted HTTP address that is unset takes whichever the running one is."""
    changed: dict[str, tuple[Any, Any]] = {}
    for key in sorted(set(running) | set(wanted)):
        if key in SAME_BY_LOCATION or key not in wanted or (only is not None and key not in only):
            continue  # a key only the daemon reports is no setting
        theirs, ours = running.get(key, MISSING), wanted[key]
        if key == "http_addr" and any_front:
            # a start without --http (nor KSI_HTTP_ADDR) asks for no particular front: the one
            # serving is fine; one with an address asks for that one
            same = ours is None or http_address(theirs if isinstance(theirs, str) else None) == http_address(ours)
        else:
            same = theirs == ours
        if not same:
            changed[f"KSI_{key.upper()}"] = (None if theirs is MISSING else theirs, ours)
    return changed


def describe(changed: dict[str, tuple[Any, Any]], ours: str = "asked") -> str:
    """One short line per difference."""
    return "\n".join(f"  {name}: running {shown(theirs)}, {ours} {shown(wanted)}"
                     for name, (theirs, wanted) in changed.items())


def one_line(changed: dict[str, tuple[Any, Any]]) -> str:
    """The settings a restart changed, on one line."""
    if not changed:
        return "settings: the same as before"
    return "settings changed: " + "; ".join(f"{name} {shown(before)} -> {shown(after)}"
                                            for name, (before, after) in changed.items())


def shown(value: Any) -> str:
    if value is None:
        return "unset"
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= SHOWN_AT_MOST else f"{text[:SHOWN_AT_MOST - 12]}... ({len(text)} chars)"


def http_unavailable(addr: str | None, held_by_running: str | None) -> str | None:
    """Why the HTTP front could not be served at `addr`, or None when it could. The running
    daemon's own address counts as free: a restart frees it before the new daemon binds it."""
    wanted = http_address(addr)
    if wanted is None or wanted == http_address(held_by_running) or wanted[1] == 0:
        return None
    host, port = wanted
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        return f"cannot serve HTTP on {host}:{port}: {exc}"
    family, kind, proto, _name, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the daemon binds it
        try:
            probe.bind(address)
        except OSError as exc:
            return f"cannot serve HTTP on {host}:{port}: {exc.strerror or exc}"
    return None
