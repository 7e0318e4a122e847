"""The console's "what was sent" marks the prompt-cache breakpoints each message carried and the
first message that differed from the previous request. Real headless Chromium against the console
module's daemon; the model takes OpenAI's explicit breakpoints, so KSI places them."""

from __future__ import annotations

from playwright.async_api import expect

from tests.conftest import complete
from tests.test_console import WAIT_MS, Console, console  # noqa: F401  (the module's daemon and browser)

MODEL = "openai/gpt-5.6-stub"


async def test_what_was_sent_shows_the_breakpoints_and_where_the_request_first_differed(
        console: Console) -> None:  # noqa: F811
    client = console.client
    await complete(client, prompt="first question", conversation_id="marks", create=True, system="be brief",
                   model=MODEL)
    await complete(client, prompt="second question", conversation_id="marks", model=MODEL)
    sent = await client.request("conversation:sent", {"conversation_id": "marks", "n": 2})
    assert sent["breakpoints"] and sent["extends_previous"] is True  # what the page must show
    page = await console.page("/conversations/marks")
    await page.click("#turn-2 details.sent summary")
    panel = page.locator("#turn-2 [data-sent-loaded]")
    await expect(panel).to_be_visible(timeout=WAIT_MS)
    marks = panel.locator("[data-cache-breakpoint]")
    await expect(marks).to_have_count(len(sent["breakpoints"]))
    await expect(panel.locator(".part-system [data-cache-breakpoint]")).to_contain_text("KSI's")
    await expect(panel.locator(".part-input [data-cache-breakpoint]")).to_have_count(1)
    difference = panel.locator("[data-first-difference]")
    await expect(difference).to_have_text("differs from the previous request from here")
    # the line stands right before the first message the previous request did not have
    after = panel.locator("[data-first-difference] + li")
    await expect(after).to_contain_text(sent["messages"][sent["first_difference"]]["content"])
    await expect(panel.locator("[data-sent-compared]")).to_have_text("extends the request of #1")
    await console.shot(page, "sent-breakpoints")

    await page.click("#turn-1 details.sent summary")
    first = page.locator("#turn-1 [data-sent-loaded]")
    await expect(first).to_be_visible(timeout=WAIT_MS)
    await expect(first.locator("[data-first-difference]")).to_have_count(0)  # nothing came before it
    await page.close()
