"""The `llm` entry point: registers a `ksi/...` model for each model, consortium and agent the
KSI daemon offers (`llm models` lists them), found where the `ksi` command finds the daemon."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import llm

from ksi_common.errors import KsiError
from ksi_common.locate import locate
from ksi_llm.catalog import Catalog, discover, logged_names, requested_names
from ksi_llm.model import PREFIX, AsyncKsiModel, KsiModel

CACHE_FILE = "ksi-models.json"  # in llm's user directory: the last catalog, for when the daemon is down


@functools.lru_cache(maxsize=4)
def offered(socket_path: Path, user_dir: Path, argv: tuple[str, ...]) -> tuple[Catalog, list[str]]:
    """The catalog and every name to register, worked out once per process: `llm` calls
    register_models for every model lookup (a `llm -c` looks up each earlier turn's model)."""
    catalog = discover(socket_path, user_dir / CACHE_FILE)
    return catalog, catalog.model_names(requested_names(argv, PREFIX), logged_names(user_dir / "logs.db", PREFIX))


def aliases_for(name: str, catalog: Catalog) -> list[str]:
    """`ksi` for the daemon's default model, `ksi-NAME` for consortium NAME."""
    aliases = ["ksi"] if name == catalog.default else []
    if name.startswith("consortium/"):
        aliases.append("ksi-" + name.removeprefix("consortium/"))
    return aliases


@llm.hookimpl
def register_models(register: Callable[..., Any]) -> None:
    try:
        socket_path = locate().socket
    except KsiError:  # KSI_VAR_DIR names a file: llm goes on, without KSI's models
        return
    catalog, names = offered(socket_path, llm.user_dir(), tuple(sys.argv))
    for name in names:
        register(KsiModel(name, socket_path), AsyncKsiModel(name, socket_path), aliases=aliases_for(name, catalog))
