"""Storage backends by name (`KSI_STORAGE`): the composition root builds the one chosen.

A backend is imported only when chosen, so a JSONL daemon never loads a database driver.
"""

from __future__ import annotations

import importlib

from ksi_common.settings import Settings
from ksi_daemon.storage.ports import Storage

BACKENDS = {
    "jsonl": "ksi_daemon.storage.jsonl.storage:JsonlStorage",
    "postgres": "ksi_daemon.storage.postgres.storage:PostgresStorage",
}


def build_storage(settings: Settings) -> Storage:
    """The backend named by `settings.storage`, built from the settings (not yet opened)."""
    module_name, class_name = BACKENDS[settings.storage].split(":")
    backend = getattr(importlib.import_module(module_name), class_name)
    return backend(settings)  # type: ignore[no-any-return]
