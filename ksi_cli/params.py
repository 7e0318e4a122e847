"""Click parameter types for numbers: finite and within the daemon's bounds, refused otherwise."""

from __future__ import annotations

import math
from typing import Any

import click


class Seconds(click.ParamType):
    """A finite number of seconds from 0 to `maximum` (click's FloatRange lets NaN through)."""

    name = "seconds"

    def __init__(self, maximum: float) -> None:
        self.maximum = maximum

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        try:
            number = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number", param, ctx)
        if not math.isfinite(number) or not 0 <= number <= self.maximum:
            self.fail(f"{value!r} is not a number of seconds from 0 to {self.maximum:g}", param, ctx)
        return number
