"""KSI's Anthropic breakpoints: the end of the system prompt and of the newest message; a request
already carrying a client's cache_control is left as it came; the caller's messages are not changed."""

from __future__ import annotations

import copy
from typing import Any

from ksi_daemon.providers.cache_markers import EPHEMERAL, with_breakpoints

MESSAGES: list[dict[str, Any]] = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]


def test_breakpoints_close_the_system_prompt_and_the_newest_message() -> None:
    before = copy.deepcopy(MESSAGES)
    placed = with_breakpoints(MESSAGES)
    assert placed[0]["content"] == [{"type": "text", "text": "be brief", "cache_control": EPHEMERAL}]
    assert placed[1:3] == MESSAGES[1:3]
    assert placed[3]["content"] == [{"type": "text", "text": "a"},
                                    {"type": "text", "text": "b", "cache_control": EPHEMERAL}]
    assert MESSAGES == before


def test_a_clients_own_cache_control_is_kept_and_ksi_adds_none() -> None:
    own = copy.deepcopy(MESSAGES)
    own[1]["content"] = [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    assert with_breakpoints(own) == own
