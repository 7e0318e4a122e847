"""The console's turn view and "what was sent" of a tool-using conversation, in real headless
Chromium against a real daemon: tool calls, their outputs and image references are shown, and
text from a tool is escaped like any other."""

from __future__ import annotations

from playwright.async_api import expect

from tests.test_console import WAIT_MS, Console, console  # noqa: F401  (the module's daemon and browser)
from tests.tool_conversation import IMAGE_SHA, store_image, tool_document, tool_exchanges

CALL_LINE = '\u2192 call weather({"city": "Oslo"}) [c1]'


async def test_the_turn_view_shows_tool_calls_outputs_and_image_references(console: Console) -> None:  # noqa: F811
    await store_image(console.daemon)
    await console.client.request("conversation:import", {"data": tool_document(), "new_id": "tooled"})
    page = await console.page("/conversations/tooled")
    await expect(page.locator("#turn-1 [data-reply]")).to_have_text("Let me check.", timeout=WAIT_MS)
    await expect(page.locator("#turn-1 [data-tool-call]")).to_have_text(CALL_LINE)
    await expect(page.locator("#turn-2 [data-tool-output]")).to_have_text("\u2190 c1: 12C")
    await expect(page.locator("#turn-2 [data-reply]")).to_have_text("It is 12C in Oslo.")
    await expect(page.locator("#turn-3 [data-input]")).to_have_text("And what is in this picture?")
    await expect(page.locator("#turn-3 [data-ref='input_image']")).to_have_text(
        f"[image sha256:{IMAGE_SHA[:12]}\u2026 image/png 3 KB]")
    await expect(page.locator("#turn-3 [data-item='reasoning']")).to_contain_text("reasoning summary")
    await expect(page.locator("#turn-3 [data-reply]")).to_have_text("A cat.")
    assert await page.locator("main img").count() == 0  # an image is named, never fetched
    await console.shot(page, "tool-conversation")

    await page.click("#turn-3 details.sent summary")
    sent = page.locator("#turn-3 [data-sent-loaded]")
    await expect(sent).to_be_visible(timeout=WAIT_MS)
    await expect(sent.locator(".part-history [data-sent-call]")).to_have_text(CALL_LINE)
    await expect(sent.locator(".msg-tool.part-history")).to_contain_text("result of c1")
    await expect(sent.locator(".msg-tool.part-history pre")).to_have_text("12C")
    await expect(sent.locator(".part-input")).to_contain_text(f"[image sha256:{IMAGE_SHA[:12]}")
    await page.click("#turn-2 details.sent summary")
    await expect(page.locator("#turn-2 [data-sent-loaded] .msg-tool.part-input pre")).to_have_text(
        "12C", timeout=WAIT_MS)
    await console.shot(page, "tool-conversation-sent")
    await page.close()


async def test_text_from_a_tool_is_escaped(console: Console) -> None:  # noqa: F811
    attack = "<script>window.__injected = 1</script><img src=x onerror=\"window.__injected = 2\">"
    exchanges = tool_exchanges()
    exchanges[0]["output"][1]["arguments"] = '{"q": "' + attack.replace('"', '\\"') + '"}'
    exchanges[1]["input"][0]["output"] = attack
    await store_image(console.daemon)
    await console.client.request("conversation:import", {"data": tool_document(*exchanges), "new_id": "tool-hostile"})
    page = await console.page("/conversations/tool-hostile")
    await expect(page.locator("#turn-2 [data-tool-output]")).to_have_text(f"\u2190 c1: {attack}", timeout=WAIT_MS)
    await expect(page.locator("#turn-1 [data-tool-call]")).to_contain_text("<script>")
    await page.click("#turn-2 details.sent summary")
    await expect(page.locator("#turn-2 [data-sent-loaded] .part-input")).to_contain_text(attack, timeout=WAIT_MS)
    assert await page.evaluate("window.__injected") is None
    assert await page.locator("main img").count() == 0
    await page.close()
