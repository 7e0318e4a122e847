"""The one rule for a client's path: absolute, and inside an allowed root once links are followed."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from ksi_common.errors import ErrorCode, KsiError


class FileRoots:
    """`KSI_ALLOWED_FILE_ROOTS`, resolved once; files attached and images read by path both ask it."""

    def __init__(self, roots: Sequence[Path]) -> None:
        self.roots = [Path(root).resolve() for root in roots]

    def allowed(self, resolved: Path) -> bool:
        return any(resolved == root or resolved.is_relative_to(root) for root in self.roots)

    def resolve(self, raw: str, field_name: str) -> Path:
        """The path with every link followed; `validation_error` when it is relative,
        `path_not_allowed` when it ends outside the roots (or in a loop of links)."""
        path = Path(raw)
        if not path.is_absolute():
            raise KsiError(ErrorCode.VALIDATION_ERROR, f"{raw!r} is not an absolute path",
                           fields={field_name: "must be an absolute path"})
        try:
            resolved = path.resolve()
        except (OSError, RuntimeError):  # a symlink loop
            resolved = None
        if resolved is None or not self.allowed(resolved):
            raise KsiError(ErrorCode.PATH_NOT_ALLOWED, self._outside(raw), path=raw,
                           allowed_roots=[str(r) for r in self.roots], setting="KSI_ALLOWED_FILE_ROOTS")
        return resolved

    def _outside(self, raw: str) -> str:
        """Where the allowed roots come from and how to add one: the setting, not only its effect."""
        roots = os.pathsep.join(str(root) for root in self.roots)
        now = f"KSI_ALLOWED_FILE_ROOTS is {roots}" if roots else "KSI_ALLOWED_FILE_ROOTS is empty: no file may be read"
        return (f"{raw} is outside the allowed file roots ({now}); add a directory holding it to "
                "KSI_ALLOWED_FILE_ROOTS (`ksi config set allowed_file_roots DIR[:DIR...]`) and restart the daemon")

    def regular_file(self, raw: str, field_name: str) -> Path:
        """As `resolve`, and a `validation_error` unless it names an existing regular file (blocking)."""
        resolved = self.resolve(raw, field_name)
        if not resolved.exists():
            raise KsiError(ErrorCode.VALIDATION_ERROR, f"{raw} does not exist", fields={field_name: "no such file"})
        if not resolved.is_file():
            raise KsiError(ErrorCode.VALIDATION_ERROR, f"{raw} is not a regular file",
                           fields={field_name: "not a regular file"})
        return resolved
