"""What a `ksi daemon start` or `restart` would run with, against the daemon that runs now: the
settings that differ, and whether the new HTTP address can be served (checked before anything
is stopped). Imports pydantic through the settings only when called."""

from __future__ import annotations

import socket
from typing import Any

# the same for both by construction (the CLI found the daemon through them)
SAME_BY_LOCATION = ("var_dir", "socket_path")
MISSING = object()

def wanted_settings(var_dir: Any, socket_path: Any, http_addr: str | None) -> dict[str, Any]:
    """The settings a daemon started here would run with (secrets masked); KsiError when invalid."""
    from ksi_common.settings import load_settings

    overrides: dict[str, Any] = {"var_dir": var_dir, "socket_path": socket_path}
    if http_addr:
        overrides["http_addr"] = http_addr
    return load_settings(**overrides).public_view()

def database_unreachable(var_dir: Any, socket_path: Any, http_addr: str | None) -> str | None:
    """Why a daemon started here could not open its database, or None (also for JSONL): a
    restart asks before it stops the running daemon. asyncpg is imported only for PostgreSQL."""
    from ksi_common.dburl import mask_urls_in, url_password
    from ksi_common.settings import load_settings

    settings = load_settings(var_dir=var_dir, socket_path=socket_path, **({"http_addr": http_addr} if http_addr else {}))
    if settings.storage != "postgres" or settings.database_url is None:
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

def differences(running: dict[str, Any], wanted: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """`KSI_NAME` -> (running value, wanted value) for every setting that differs."""
    changed: dict[str, tuple[Any, Any]] = {}
    for key in sorted(set(running) | set(wanted)):
        if key in SAME_BY_LOCATION or key not in wanted:  # a key only the daemon reports is no setting
            continue
        theirs, ours = running.get(key, MISSING), wanted[key]
        if key == "http_addr":
            # a start without --http (nor KSI_HTTP_ADDR) asks for no particular front: the one
            # serving is fine; one with an address asks for that one
            same = ours is None or http_address(theirs if isinstance(theirs, str) else None) == http_address(ours)
        else:
            same = theirs == ours
        if not same:
            changed[f"KSI_{key.upper()}"] = (None if theirs is MISSING else theirs, ours)
    return changed

def describe(changed: dict[str, tuple[Any, Any]]) -> str:
    return "\n".join(f"  {name}: running {_shown(theirs)}, this start {_shown(ours)}"
                     for name, (theirs, ours) in changed.items())

def _shown(value: Any) -> str:
    return "unset" if value is None else str(value)

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
