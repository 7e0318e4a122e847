"""The composition root's door to storage: the backend `KSI_STORAGE` names, built from the table
of backends (`ksi_common.storage_backends`).

A backend is imported only when chosen, so a JSONL daemon never loads a database driver.
"""

from __future__ import annotations

from ksi_common.settings import Settings
from ksi_common.storage_backends import backend_named
from ksi_daemon.storage.ports import Storage


def build_storage(settings: Settings) -> Storage:
    """The backend named by `settings.storage`, built from the settings (not yet opened)."""
    backend = backend_named(settings.storage).load("storage")
    return backend(settings)  # type: ignore[no-any-return]
