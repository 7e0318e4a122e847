"""Where the JSONL backend keeps blobs, as every reader lists them (the daemon's store, `ksi doctor`)."""

from __future__ import annotations

import re

from ksi_common.layout import VarLayout

SHA256 = re.compile(r"^[0-9a-f]{64}$")


def stored_hashes(layout: VarLayout) -> list[str]:
    """The hashes of the blobs under the var dir, sorted; links are never followed or listed."""
    root = layout.blobs_dir
    if root.parent.is_symlink() or root.is_symlink() or not root.is_dir():
        return []
    found: list[str] = []
    for fan_out in sorted(root.iterdir()):
        if fan_out.is_symlink() or not fan_out.is_dir():
            continue
        found.extend(p.name for p in fan_out.iterdir()
                     if SHA256.match(p.name) and p.name.startswith(fan_out.name) and not p.is_symlink())
    return sorted(found)
