"""Learned token-count ratios per model, one small replaceable JSON file in var/state/."""

from __future__ import annotations

from typing import Any

from ksi_common.layout import VarLayout
from ksi_daemon.storage.files import read_json, replace_json


class CalibrationFile:
    def __init__(self, layout: VarLayout) -> None:
        self.path = layout.calibration_file

    def load(self) -> dict[str, dict[str, Any]]:
        try:
            raw = read_json(self.path)
        except ValueError:  # damaged: start again from 1.0, as a fresh daemon would
            return {}
        models = raw.get("models") if isinstance(raw, dict) else None
        return {k: v for k, v in models.items() if isinstance(v, dict)} if isinstance(models, dict) else {}

    def save(self, ratios: dict[str, dict[str, Any]]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        replace_json(self.path, {"v": 1, "models": ratios})
