"""What the plugin offers `llm`: the daemon's models, saved consortia and agents, asked of the
running daemon, with the last answer kept in a small file for when the daemon is down."""

from __future__ import annotations

import json
import os
import sqlite3
import tempfile
from collections.abc import Sequence
from contextlib import closing
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ksi_common.errors import KsiError
from ksi_common.events import AGENT_LIST, COMPLETION_MODELS, CONSORTIUM_LIST
from ksi_common.oneshot import Connection

DISCOVERY_TIMEOUT = 2.0  # seconds: `llm` asks on every start, a hung daemon must not hang it long
BUILTIN_MODELS = ("echo/demo",)  # every KSI daemon serves its built-in echo model


@dataclass
class Catalog:
    default: str | None = None
    models: list[str] = field(default_factory=list)
    consortia: list[str] = field(default_factory=list)
    agents: list[str] = field(default_factory=list)
    live: bool = False  # False: read from the cache (or empty) because the daemon did not answer

    def model_names(self, *more: Sequence[str]) -> list[str]:
        """Every KSI model name to register, without the `ksi/` prefix, each once."""
        names = [*self.models, *BUILTIN_MODELS, *(f"consortium/{name}" for name in self.consortia)]
        names += [f"agent/{agent_id}" for agent_id in self.agents]
        for extra in more:
            names += extra
        return list(dict.fromkeys(names))


def requested_names(argv: Sequence[str], prefix: str) -> list[str]:
    """Names after `-m`/`--model` on the command line that start with `prefix`, without it.

    KSI serves any model litellm reaches, more than a daemon can list: a name the user asks for
    is registered so that it reaches KSI, which answers it or says why not (an unknown
    consortium gets KSI's `consortium_not_found`, not llm's "unknown model")."""
    found = []
    for i, arg in enumerate(argv):
        value = None
        if arg in ("-m", "--model") and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith("--model="):
            value = arg.removeprefix("--model=")
        if value and value.startswith(prefix) and len(value) > len(prefix):
            found.append(value.removeprefix(prefix))
    return found


def logged_names(logs_db: Path, prefix: str) -> list[str]:
    """KSI models that earlier `llm` prompts used (from llm's own log), so `llm -c` finds them."""
    if not logs_db.is_file():
        return []
    found: set[str] = set()
    try:
        with closing(sqlite3.connect(f"file:{logs_db}?mode=ro", uri=True)) as db:
            # `turns` is where llm logs now; `responses` holds what older versions logged
            tables = {name for (name,) in db.execute("select name from sqlite_master where type = 'table'")}
            for table in ("turns", "responses"):
                if table in tables:
                    rows = db.execute(f"select distinct model from {table} where substr(model, 1, ?) = ?",
                                      (len(prefix), prefix))
                    found.update(str(model).removeprefix(prefix) for (model,) in rows)
    except sqlite3.Error:
        return []
    return sorted(found)


def ask_daemon(socket_path: Path) -> Catalog:
    """The catalog of the running daemon; raises `KsiError` when it cannot be reached."""
    with Connection(socket_path, timeout=DISCOVERY_TIMEOUT) as connection:
        models = connection.request(COMPLETION_MODELS)
        consortia = connection.request(CONSORTIUM_LIST)
        agents = connection.request(AGENT_LIST, {"status": "active"})
    return Catalog(
        default=models.get("default"),
        models=[str(name) for name in models.get("models", [])],
        consortia=[str(item["name"]) for item in consortia.get("consortia", [])],
        agents=[str(item["agent_id"]) for item in agents.get("agents", [])],
        live=True,
    )


def read_cache(path: Path) -> Catalog | None:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        fields = {key: raw[key] for key in ("default", "models", "consortia", "agents") if key in raw}
        return Catalog(**fields)
    except (OSError, ValueError, TypeError, KeyError):
        return None


def write_cache(path: Path, catalog: Catalog) -> None:
    """Replace the cache atomically; a failure only costs the fallback, never the command."""
    record: dict[str, Any] = {"v": 1, **asdict(catalog)}
    record.pop("live")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".ksi-models.", dir=path.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(record, handle)
        os.replace(tmp, path)
    except OSError:
        pass


def discover(socket_path: Path, cache_path: Path) -> Catalog:
    """Ask the daemon; when it does not answer, the last catalog it gave (or only the built-ins)."""
    try:
        catalog = ask_daemon(socket_path)
    except KsiError:
        return read_cache(cache_path) or Catalog()
    if replace(catalog, live=False) != read_cache(cache_path):
        write_cache(cache_path, catalog)
    return catalog
