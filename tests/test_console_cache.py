"""The console shows prompt-cache use: the conversation page the share of its prompts read from
the cache (in all and per model), each turn its cached tokens. Real headless Chromium against the
console module's daemon; the conversation is imported with the usage its provider reported."""

from __future__ import annotations

from typing import Any

from playwright.async_api import expect

from tests.test_console import WAIT_MS, Console, console  # noqa: F401  (the module's daemon and browser)

TS = "2026-01-02T03:04:05Z"


def cached_exchange(n: int, read: int) -> dict[str, Any]:
    usage = {"prompt_tokens": 2000, "completion_tokens": 5, "cache_read_input_tokens": read}
    return {"ts": TS, "model": "openai/stub-a",
            "input": [{"type": "message", "role": "user", "content": f"question {n}"}],
            "output": [{"type": "message", "role": "assistant", "content": f"answer {n}"}],
            "reply": {"model": "openai/stub-a", "usage": usage, "ts": TS, "content": f"answer {n}",
                      "finish_reason": "stop"}}


async def test_the_conversation_page_shows_the_cache_hit_rate_in_all_per_model_and_per_turn(
        console: Console) -> None:  # noqa: F811
    document = {"v": 1, "format": "ksi.conversation", "conversation": {"conversation_id": "x", "title": "Cached"},
                "exchanges": [cached_exchange(1, 0), cached_exchange(2, 1800)]}
    await console.client.request("conversation:import", {"data": document, "new_id": "cached"})
    page = await console.page("/conversations/cached")
    await expect(page.locator("[data-cache]")).to_have_text(
        "45% read from the cache (1,800 tokens); openai/stub-a 45%", timeout=WAIT_MS)
    await expect(page.locator("#turn-2 [data-usage]")).to_contain_text("1,800 cached (90%)")
    await expect(page.locator("#turn-1 [data-usage]")).not_to_contain_text("cached")
    await console.shot(page, "conversation-cache")
    await page.close()
