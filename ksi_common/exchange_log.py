"""Reading the exchange log `state/exchange-log/N.jsonl` (written by the daemon's JSONL store with
fsync on): exchanges synced there whose files a crash of the machine may have kept from the disk."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ksi_common.jsonl import read_records


def generations(directory: Path) -> list[Path]:
    """The log's files, oldest first."""
    found = [(int(p.stem), p) for p in directory.glob("*.jsonl") if p.stem.isdigit()]
    return [p for _n, p in sorted(found)]


def logged_exchanges(directory: Path) -> list[dict[str, Any]]:
    """Every complete record that was not revoked, oldest first (a torn last line was never
    acknowledged and is left out)."""
    found = [record for path in generations(directory) for record in read_records(path)]
    revoked = {record["revoke"] for record in found if "revoke" in record}
    return [record for record in found if "revoke" not in record and record.get("id") not in revoked]
