"""The console's one-time login codes on the daemon's side: the nonces already spent, kept in the
var dir until their codes expire (a restart within a code's minute must not make a spent code
good again), and a bounded rate of wrong codes (a guesser is answered 429 and logged once per
burst, not once per try)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import orjson
import structlog

from ksi_common.console_login import code_nonce

log = structlog.get_logger("ksi.http")

WRONG_BURST = 10  # wrong codes taken at once before the throttle
WRONG_PER_SECOND = 1.0  # wrong codes taken per second after a burst


class LoginCodes:
    """Spends login codes once, across restarts, and throttles wrong ones."""

    def __init__(self, spent_file: Path | None, clock: Callable[[], float] = time.time) -> None:
        self.spent_file = spent_file  # None: kept in memory only (a daemon without a var dir of its own)
        self.clock = clock
        self._spent = self._load()  # nonce -> when its code expires
        self._allowance = float(WRONG_BURST)
        self._checked_at = clock()
        self._throttled_logged = False

    def retry_after(self) -> float | None:
        """Seconds until a try is taken again, or None when one is taken now."""
        now = self.clock()
        self._allowance = min(float(WRONG_BURST), self._allowance + (now - self._checked_at) * WRONG_PER_SECOND)
        self._checked_at = now
        if self._allowance >= 1.0:
            self._throttled_logged = False
            return None
        if not self._throttled_logged:  # one line per burst of wrong codes
            self._throttled_logged = True
            log.warning("console_login_throttled", wrong_per_second=WRONG_PER_SECOND)
        return (1.0 - self._allowance) / WRONG_PER_SECOND

    def spend(self, token: str, code: str) -> bool:
        """Take a code once: signed by the token, within its lifetime, never taken before (by this
        run or an earlier one). A refused code uses up one try of the allowance."""
        now = self.clock()
        self._spent = {nonce: until for nonce, until in self._spent.items() if until >= now}
        checked = code_nonce(token, code, now)
        if checked is None or checked[0] in self._spent:
            self._allowance -= 1.0
            return False
        self._spent[checked[0]] = checked[1]
        self._save()
        return True

    def _load(self) -> dict[str, float]:
        if self.spent_file is None:
            return {}
        try:
            loaded = orjson.loads(self.spent_file.read_bytes())
        except (OSError, orjson.JSONDecodeError):
            return {}  # none spent yet, or damaged: codes live a minute, so little is at stake
        now = self.clock()
        if not isinstance(loaded, dict):
            return {}
        return {str(k): float(v) for k, v in loaded.items() if isinstance(v, int | float) and v >= now}

    def _save(self) -> None:
        """Written before the login is answered: a kill right after must not free the code."""
        if self.spent_file is None:
            return
        temporary = self.spent_file.with_name(f".{self.spent_file.name}.tmp")
        try:
            self.spent_file.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(descriptor, "wb") as handle:
                handle.write(orjson.dumps(self._spent))
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, self.spent_file)
        except OSError as exc:  # the code is still spent for this run
            log.warning("console_codes_not_saved", error=exc.strerror or str(exc))
