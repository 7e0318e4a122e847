"""KSI's Anthropic breakpoints: the end of the system prompt, of the newest reply and of the newest
message, four at most; a request
already carrying a client's cache_control is left as it came; the caller's messages are not changed.
A client's own OpenAI breakpoints go out on their messages' last blocks, the newest three."""

from __future__ import annotations

import copy
from typing import Any

from ksi_daemon.providers.cache_markers import (
    EPHEMERAL,
    OPENAI_BREAKPOINT,
    lifetime,
    with_breakpoints,
    with_openai_breakpoints,
    with_prefix_breakpoints,
)
from ksi_daemon.providers.client_markers import sendable_markers

MESSAGES: list[dict[str, Any]] = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]


def test_breakpoints_close_the_system_prompt_the_newest_reply_and_the_newest_message() -> None:
    before = copy.deepcopy(MESSAGES)
    placed = with_breakpoints(MESSAGES)
    assert placed[0]["content"] == [{"type": "text", "text": "be brief", "cache_control": EPHEMERAL}]
    assert placed[1] == MESSAGES[1]
    # what a fork at this point sends again ends here
    assert placed[2]["content"] == [{"type": "text", "text": "hello", "cache_control": EPHEMERAL}]
    assert placed[3]["content"] == [{"type": "text", "text": "a"},
                                    {"type": "text", "text": "b", "cache_control": EPHEMERAL}]
    assert MESSAGES == before


def test_a_clients_own_cache_control_is_kept_and_ksi_adds_none() -> None:
    own = copy.deepcopy(MESSAGES)
    own[1]["content"] = [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    assert with_breakpoints(own) == own


def test_the_stable_parts_the_system_message_opens_with_each_get_a_breakpoint_of_the_models_lifetime() -> None:
    summary = "[Summary of exchanges 1-4]\nthe user wants tea"
    system = {"role": "system", "content": f"be brief\n\n{summary}\n\n[Note: 2 earlier exchanges were left out]"}
    placed = with_prefix_breakpoints([system, *MESSAGES[1:]], ["be brief", summary], "1h")
    blocks = placed[0]["content"]
    assert "".join(block["text"] for block in blocks) == system["content"]  # the same text, cut
    assert [block["text"] for block in blocks[:2]] == ["be brief", f"\n\n{summary}"]
    # four at most: the end of the notes gives way to the newest reply's
    assert [block.get("cache_control") for block in blocks] == [lifetime("1h"), lifetime("1h"), None]
    assert placed[2]["content"][-1]["cache_control"] == EPHEMERAL
    assert placed[3]["content"][-1]["cache_control"] == EPHEMERAL  # the newest message: five minutes
    without_reply = with_prefix_breakpoints([system, MESSAGES[1]], ["be brief", summary], "1h")
    assert [block["cache_control"] for block in without_reply[0]["content"]] == [lifetime("1h"), lifetime("1h"),
                                                                                 EPHEMERAL]


def test_an_empty_reply_gets_no_breakpoint() -> None:
    calling = {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
                                                                    "function": {"name": "f", "arguments": "{}"}}]}
    placed = with_breakpoints([MESSAGES[0], MESSAGES[1], calling, MESSAGES[3]])
    assert placed[2] == calling


def test_a_part_the_system_message_does_not_open_with_is_not_cut_at() -> None:
    system = {"role": "system", "content": "be brief\n\nnotes"}
    placed = with_prefix_breakpoints([system, *MESSAGES[1:]], ["be quick"], "1h")
    assert placed == with_breakpoints([system, *MESSAGES[1:]])
    assert lifetime("5m") == EPHEMERAL


def test_explicit_openai_breakpoints_close_the_stable_parts_and_the_newest_message_not_the_assistants() -> None:
    system = {"role": "system", "content": "be brief\n\n[Summary]\n\nnotes"}
    messages = [system, MESSAGES[1], {"role": "assistant", "content": "hello"}]
    placed = with_openai_breakpoints(messages, ["be brief", "[Summary]"])
    assert [block.get("prompt_cache_breakpoint") for block in placed[0]["content"]] == [
        OPENAI_BREAKPOINT, OPENAI_BREAKPOINT, None]
    assert placed[1]["content"] == [{"type": "text", "text": "hi", "prompt_cache_breakpoint": OPENAI_BREAKPOINT}]
    assert placed[2] == messages[2]
    own = [system, {"role": "user", "content": [{"type": "text", "text": "x", "prompt_cache_breakpoint": {}}]}]
    assert with_openai_breakpoints(own, ["be brief"]) == own


def test_a_clients_own_openai_breakpoints_go_out_the_newest_three_on_their_blocks_and_to_no_other_model() -> None:
    marks = [{"mode": "explicit", "n": n} for n in range(4)]
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "zero", "prompt_cache_breakpoint": marks[0]},
        {"role": "user", "content": "one", "prompt_cache_breakpoint": marks[1]},
        {"role": "assistant", "content": "reply"},
        {"role": "user", "content": [{"type": "text", "text": "two"}, {"type": "image_url", "image_url": {"url": "u"}}],
         "prompt_cache_breakpoint": marks[2]},
        {"role": "user", "content": "three", "prompt_cache_breakpoint": marks[3], "cache_control": EPHEMERAL}]
    before = copy.deepcopy(messages)
    sent = sendable_markers(messages, takes_markers=False, takes_breakpoints=True)
    assert messages == before  # the caller's messages are not changed
    assert sent[0] == {"role": "user", "content": "zero"}  # the oldest of four: over OpenAI's limit
    assert sent[1]["content"] == [{"type": "text", "text": "one", "prompt_cache_breakpoint": marks[1]}]
    assert sent[3]["content"][-1] == {"type": "image_url", "image_url": {"url": "u"},
                                      "prompt_cache_breakpoint": marks[2]}
    assert sent[4] == {"role": "user", "content": [{"type": "text", "text": "three",
                                                    "prompt_cache_breakpoint": marks[3]}]}
    anthropic = sendable_markers(messages, takes_markers=True, takes_breakpoints=False)
    assert "prompt_cache_breakpoint" not in str(anthropic) and anthropic[4]["cache_control"] == EPHEMERAL
