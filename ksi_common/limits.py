"""Upper bounds of the numbers users set, shared by the daemon's validation and the CLI: a value
past them is refused where it enters, not saved to break a later reader."""

from __future__ import annotations

import math
from typing import Any

MAX_TTL = 10 * 366 * 86400.0  # ten years, in seconds
MAX_TIMEOUT = 7 * 86400.0  # a week, in seconds: request, wait and attempt timeouts
MAX_TURN_CAP = 10_000_000  # exchanges of one conversation
MAX_TOKENS = 100_000_000  # a token count (max_tokens, imported usage)
MAX_COST = 1e9  # a cost, in the provider's currency
INT64_MAX = 2**63 - 1
MAX_MODEL_NAME = 200  # characters of a model name; the longest real ones (a deployment path) are under 120


def out_of_range(value: Any) -> str | None:
    """Why `value` (parsed JSON) cannot travel as JSON numbers do, or None: NaN and infinities
    have no JSON form, and integers past 64 bits are refused by the daemon's parser."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, bool):
            continue
        if isinstance(item, float) and not math.isfinite(item):
            return f"{item} is not a finite number"
        if isinstance(item, int) and not -INT64_MAX - 1 <= item <= INT64_MAX:
            return f"{item} does not fit in 64 bits"
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return None
