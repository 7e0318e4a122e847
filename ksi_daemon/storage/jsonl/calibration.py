"""Learned token-count ratios per model, one small replaceable JSON file in `state/`; the
`CalibrationStore` port."""

from __future__ import annotations

import asyncio
from typing import Any

from ksi_common.layout import VarLayout
from ksi_daemon.storage.jsonl.files import read_json, replace_json


class JsonlCalibration:
    def __init__(self, layout: VarLayout) -> None:
        self.path = layout.calibration_file

    def _load(self) -> dict[str, dict[str, Any]]:
        try:
            raw = read_json(self.path)
        except ValueError:  # damaged: start again from 1.0, as a fresh daemon would
            return {}
        models = raw.get("models") if isinstance(raw, dict) else None
        return {k: v for k, v in models.items() if isinstance(v, dict)} if isinstance(models, dict) else {}

    async def load(self) -> dict[str, dict[str, Any]]:
        return await asyncio.to_thread(self._load)

    def _save(self, ratios: dict[str, dict[str, Any]]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        replace_json(self.path, {"v": 1, "models": ratios})

    async def save(self, ratios: dict[str, dict[str, Any]]) -> None:
        await asyncio.to_thread(self._save, ratios)
