"""What a summary of some exchanges must keep, as found in them (services/completion/salience.py
finds it); an exchange remembers its own once found, so it sits beside the exchange's memory."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Items:
    """What a range of exchanges says that a summary of it must keep."""

    user: list[str] = field(default_factory=list)  # the user's sentences about themselves
    facts: list[str] = field(default_factory=list)  # names, numbers, ... of both sides

    def all(self) -> list[str]:
        return list(dict.fromkeys([*self.user, *self.facts]))
