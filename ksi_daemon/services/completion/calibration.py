"""Calibrated token counts: per model, how the provider's prompt counts compare to the daemon's.

The daemon estimates every text with one tokenizer (cl100k) so counts stay cacheable in the
index; models whose tokenizers differ count more or fewer tokens for the same text. Each reply
that reports `prompt_tokens` teaches the ratio real/estimated for its model, and budgets divide
the model's window by that ratio, so history selection fits the window the model really has.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import structlog

from ksi_daemon.storage.ports import CalibrationStore

log = structlog.get_logger("ksi.calibration")

# Weight of the newest sample in the running ratio: recent replies matter most (a model behind
# a pattern may change), yet one odd reply does not swing the budget.
SMOOTHING = 0.5
TIGHTEN_FACTOR = 1.25  # a context_window_exceeded says the ratio is too low by at least this much
RATIO_BOUNDS = (0.25, 8.0)  # ratios outside are a misreporting provider, not a tokenizer
MIN_ESTIMATE = 16  # tiny prompts say more about per-message overhead than about the tokenizer
# Models whose ratios are kept: names come from requests, so the least recently taught go first.
MODELS_KEPT = 256


def _count(value: Any) -> int:
    """A stored count (absent: 0); anything but a whole number >= 0 is damage."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"not a count: {value!r:.40}")
    return value


@dataclass(slots=True)
class ModelCalibration:
    ratio: float = 1.0
    samples: int = 0
    tightened: int = 0

    def to_record(self) -> dict[str, Any]:
        return {"ratio": round(self.ratio, 5), "samples": self.samples, "tightened": self.tightened}


class NoCalibrationStore:
    """Ratios kept for the life of the process only."""

    async def load(self) -> dict[str, dict[str, Any]]:
        return {}

    async def save(self, ratios: dict[str, dict[str, Any]]) -> None:
        return None


class Calibration:
    """Running per-model ratios of real to estimated prompt tokens."""

    def __init__(self, store: CalibrationStore, enabled: bool = True) -> None:
        self.store = store
        self.enabled = enabled
        self._models: dict[str, ModelCalibration] = {}
        self.dirty = False

    async def load(self) -> None:
        """The stored ratios; a damaged entry is left out (its model starts again from 1.0)."""
        records = await self.store.load()
        damaged = 0
        for model, record in (records.items() if isinstance(records, dict) else ()):
            try:
                entry = ModelCalibration(float(record["ratio"]), _count(record.get("samples")),
                                         _count(record.get("tightened")))
            except (KeyError, TypeError, ValueError, AttributeError):
                damaged += 1
                continue
            in_bounds = math.isfinite(entry.ratio) and RATIO_BOUNDS[0] <= entry.ratio <= RATIO_BOUNDS[1]
            if isinstance(model, str) and in_bounds:
                self._models[model] = entry
            else:
                damaged += 1
        if damaged or not isinstance(records, dict):
            log.warning("calibration_entries_damaged", left_out=damaged, models_loaded=len(self._models))
        # stored in the order they were last taught: the most recent are kept
        for model in list(self._models)[:-MODELS_KEPT]:
            del self._models[model]

    async def save(self) -> None:
        """Write the ratios; a store that cannot take them (a directory in the file's place) is
        logged, and the ratios stay learned in memory."""
        try:
            await self.store.save(self.snapshot())
        except Exception as exc:
            log.warning("calibration_not_saved", error=f"{type(exc).__name__}: {exc}"[:300])

    def _taught(self, model: str) -> ModelCalibration | None:
        """`model`'s entry moved to the most recent end, the oldest one past the bound dropped."""
        found = self._models.pop(model, None)
        if found is not None:
            self._models[model] = found
        elif len(self._models) >= MODELS_KEPT:
            del self._models[next(iter(self._models))]
        return found

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """The ratios to save, taken on the loop before the store writes them."""
        self.dirty = False
        return {model: c.to_record() for model, c in self._models.items()}

    def ratio(self, model: str) -> float:
        if not self.enabled:
            return 1.0
        found = self._models.get(model)
        return found.ratio if found is not None else 1.0

    def observe(self, model: str, estimated: int, real: int) -> None:
        """Learn from a reply: the provider counted `real` prompt tokens where we estimated `estimated`."""
        if not self.enabled or estimated < MIN_ESTIMATE or real <= 0:
            return
        sample = real / estimated
        if not RATIO_BOUNDS[0] <= sample <= RATIO_BOUNDS[1]:
            return
        found = self._taught(model)
        if found is None:
            self._models[model] = ModelCalibration(sample, 1)
        else:  # the first sample is taken whole; later ones move the ratio part of the way
            found.ratio += SMOOTHING * (sample - found.ratio)
            found.samples += 1
        self.dirty = True

    def tighten(self, model: str) -> float:
        """The provider refused a prompt as too long: count more strictly from now on."""
        found = self._taught(model)
        if found is None:
            found = self._models[model] = ModelCalibration()
        found.ratio = min(RATIO_BOUNDS[1], found.ratio * TIGHTEN_FACTOR)
        found.tightened += 1
        self.dirty = True
        log.warning("calibration_tightened", model=model, ratio=round(found.ratio, 4))
        return found.ratio

    def report(self, models: list[str] | None = None) -> dict[str, dict[str, Any]]:
        names = models if models is not None else sorted(self._models)
        return {m: (self._models[m].to_record() if m in self._models else ModelCalibration().to_record())
                for m in names}
