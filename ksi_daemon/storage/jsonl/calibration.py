"""Learned token-count ratios per model, one small replaceable JSON file in `state/`; the
`CalibrationStore` port."""

from __future__ import annotations

import asyncio
from typing import Any

import structlog

from ksi_common.layout import VarLayout
from ksi_daemon.storage.jsonl.files import read_json, replace_json

log = structlog.get_logger("ksi.storage.calibration")


class JsonlCalibration:
    def __init__(self, layout: VarLayout) -> None:
        self.path = layout.calibration_file

    def _load(self) -> dict[str, dict[str, Any]]:
        # damaged (not JSON, not the expected shape, a directory in its place): every model starts
        # again from 1.0, as on a fresh daemon
        try:
            raw = read_json(self.path)
        except (ValueError, OSError) as exc:
            log.warning("calibration_file_unreadable", path=str(self.path), error=f"{type(exc).__name__}: {exc}"[:200])
            return {}
        models = raw.get("models") if isinstance(raw, dict) else None
        if raw is not None and not isinstance(models, dict):
            log.warning("calibration_file_unreadable", path=str(self.path), error="no `models` object")
            return {}
        return {k: v for k, v in models.items() if isinstance(v, dict)} if isinstance(models, dict) else {}

    async def load(self) -> dict[str, dict[str, Any]]:
        return await asyncio.to_thread(self._load)

    def _save(self, ratios: dict[str, dict[str, Any]]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        replace_json(self.path, {"v": 1, "models": ratios})

    async def save(self, ratios: dict[str, dict[str, Any]]) -> None:
        await asyncio.to_thread(self._save, ratios)
