"""The storage backends, by name (`KSI_STORAGE`): the one table settings, the `ksi` commands, the
daemon's composition root, migration and the tests read.

Client-light: the reader and the daemon's storage are named as "module:class" and imported only
when chosen, so a JSONL client never loads a database driver and `ksi` never imports the daemon.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Backend:
    name: str
    reader: str  # "module:class" of its read port, built as `cls(layout, database_url)`
    storage: str  # "module:class" of the daemon's storage, built as `cls(settings)`
    needs_url: bool  # it lives in a database named by `KSI_DATABASE_URL`, not in the var dir
    shared: bool  # several daemons may share it: the pool's ports do real work there

    def load(self, attribute: str) -> Any:
        """The class named by `attribute` ("reader" or "storage"), imported now."""
        module_name, class_name = getattr(self, attribute).split(":")
        return getattr(importlib.import_module(module_name), class_name)


BACKENDS = (
    Backend("jsonl", reader="ksi_common.reading:JsonlReader",
            storage="ksi_daemon.storage.jsonl.storage:JsonlStorage", needs_url=False, shared=False),
    Backend("postgres", reader="ksi_common.postgres_reader:PostgresReader",
            storage="ksi_daemon.storage.postgres.storage:PostgresStorage", needs_url=True, shared=True),
)
STORAGE_NAMES = tuple(backend.name for backend in BACKENDS)
DEFAULT_STORAGE = STORAGE_NAMES[0]


def backend_named(name: str) -> Backend:
    """The backend called `name`; ValueError naming the known ones for any other."""
    for backend in BACKENDS:
        if backend.name == name:
            return backend
    raise ValueError(f"unknown storage {name!r}; one of {', '.join(STORAGE_NAMES)}")


def needs_url(name: str) -> bool:
    """Whether backend `name` lives in a database (False for an unknown name: nothing to reach)."""
    return any(backend.needs_url for backend in BACKENDS if backend.name == name)
