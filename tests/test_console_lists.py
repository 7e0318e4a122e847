"""The console's lists, narrow layout, consortium index, health after a failure, Markdown and
sending from a page, in real headless Chromium against a real in-process daemon and local stubs.

The daemon, browser and login come from `tests.test_console` (one set for this module).
"""

from __future__ import annotations

from collections import deque
from typing import Any

import pytest
from playwright.async_api import Page, expect

from ksi_common.errors import KsiError
from tests.conftest import complete
from tests.stub_openai import Reply
from tests.test_console import WAIT_MS, Console, console  # noqa: F401 - `console` is the module's fixture

NARROW = 400

# Every element ends inside the window, or inside a box that scrolls sideways and itself fits;
# no element hides part of its text (a clipping overflow whose content is wider than the box).
OVERFLOWS = """() => {
  const width = document.documentElement.clientWidth;
  const scrolls = (box) => ["auto", "scroll"].includes(getComputedStyle(box).overflowX);
  const found = [];
  for (const element of document.querySelectorAll("body *")) {
    const box = element.getBoundingClientRect();
    if (!box.width && !box.height) continue;
    const name = element.tagName.toLowerCase() + (element.className ? "." + element.className : "");
    if (box.right > width + 0.5) {
      let parent = element.parentElement;
      while (parent && !(scrolls(parent) && parent.getBoundingClientRect().right <= width + 0.5)) {
        parent = parent.parentElement;
      }
      if (!parent) found.push("past the edge: " + name + " at " + Math.round(box.right));
    }
    const style = getComputedStyle(element);
    if (["hidden", "clip"].includes(style.overflowX) && element.scrollWidth > element.clientWidth + 1) {
      found.push("clipped: " + name);
    }
  }
  if (document.documentElement.scrollWidth > width) found.push("the page scrolls sideways");
  return found;
}"""


async def listing_row(page: Page, conversation_id: str) -> Any:
    return page.locator(f"tr[data-conversation='{conversation_id}']")


async def test_lists_show_first_inputs_origins_and_forks_with_whole_ids(console: Console) -> None:
    client = console.client
    first = await complete(client, prompt="How do tides **work**?", origin="cli")
    untitled = first["conversation_id"]
    await complete(client, prompt="and the moon?", conversation_id=untitled)
    await complete(client, prompt="named one", conversation_id="lists-named", create=True, origin="http")
    await client.request("conversation:update", {"conversation_id": "lists-named", "title": "A titled talk"})

    page = await console.page(f"/conversations/{untitled}")
    await page.click("button[data-fork='1']")  # a fork made through the console
    await page.wait_for_url(lambda url: "/conversations/conv-" in url and untitled not in url, timeout=WAIT_MS)
    fork_id = (await page.locator("[data-conversation-id]").text_content() or "").strip()
    await page.fill("textarea[name=prompt]", "a branch of its own")
    await page.click("form[data-answer] button[type=submit]")
    await expect(page.locator("form[data-answer]")).to_have_attribute("data-done", "result", timeout=WAIT_MS)
    await expect(page.locator("dd[data-turns]")).to_have_text(f"2 turns, 1 inherited from {untitled}")
    await page.reload()
    await expect(page.locator("dd[data-turns]")).to_have_text(f"2 turns, 1 inherited from {untitled}")
    await expect(page.locator("dd[data-origin]")).to_have_text("console")
    await expect(page.locator("li.turn.inherited")).to_have_count(1)

    await page.goto(console.url + "/conversations")
    row = await listing_row(page, untitled)
    await expect(row.locator("[data-preview]")).to_have_text("How do tides **work**?")  # as typed: one line
    await expect(row.locator("[data-origin]")).to_have_text("CLI")
    await expect(row.locator("[data-turns]")).to_have_text("2")
    await expect(row.locator("[data-id]")).to_have_text(untitled)
    fork = await listing_row(page, fork_id)
    await expect(fork.locator(".tag.fork")).to_have_text(f"fork of {untitled} at #1")
    await expect(fork.locator("[data-turns]")).to_have_text("2 (1 inherited)")
    await expect(fork.locator("[data-origin]")).to_have_text("console")
    await expect(fork.locator("[data-preview]")).to_have_text("How do tides **work**?")
    named = await listing_row(page, "lists-named")
    await expect(named.locator("a.title")).to_have_text("A titled talk")
    await expect(named.locator("[data-origin]")).to_have_text("HTTP")
    await complete(client, prompt="sent by a client that names no door", conversation_id="lists-doorless", create=True)
    await page.reload()
    await expect((await listing_row(page, "lists-doorless")).locator("[data-origin]")).to_have_text("unknown")
    # an id is shown whole, never cut with an ellipsis: what is selected and copied is the id
    whole = await page.evaluate("""(id) => {
      const cell = document.querySelector(`tr[data-conversation='${id}'] [data-id]`);
      return cell.scrollWidth <= cell.clientWidth && getComputedStyle(cell).textOverflow !== "ellipsis"
        && cell.textContent === id;
    }""", fork_id)
    assert whole
    await console.shot(page, "conversations-previews")
    await page.close()


async def test_every_page_fits_a_400_pixel_window(console: Console) -> None:
    client = console.client
    await complete(client, prompt="narrow " + "words " * 60, conversation_id="narrow-one-with-a-rather-long-identifier",
                   create=True, origin="cli")
    await client.request("conversation:fork", {"conversation_id": "narrow-one-with-a-rather-long-identifier",
                                               "new_id": "narrow-fork-of-the-long-identifier", "origin": "console"})
    await client.request("consortium:save", {"name": "narrow-pair", "members": ["openai/stub-a", "openai/stub-b"],
                                             "arbiter": "openai/judge"})
    run = await complete(client, prompt="decide narrowly", conversation_id="narrow-council", create=True,
                         model="consortium/narrow-pair")
    await client.request("agent:spawn", {"agent_id": "narrow-agent", "model": "openai/stub-model"})
    context = await console.logged_in(viewport={"width": NARROW, "height": 800})
    page = await context.new_page()
    paths = {"overview": "/", "conversations": "/conversations",
             "conversation": "/conversations/narrow-one-with-a-rather-long-identifier",
             "fork": "/conversations/narrow-fork-of-the-long-identifier", "agents": "/agents",
             "agent": "/agents/narrow-agent", "events": "/events", "health": "/health", "consortium": "/consortium",
             "consortium-run": f"/consortium/{run['run_id']}"}
    for name, path in paths.items():
        response = await page.goto(console.url + path)
        assert response is not None and response.status == 200, path
        if name in ("overview", "events"):
            await expect(page.locator("[data-state]").first).to_have_text("live", timeout=WAIT_MS)
            await client.request("conversation:list", {"tag": "a-row-in-the-live-table"})
            await expect(page.locator("[data-rows] tr").first).to_be_visible(timeout=WAIT_MS)
        if name == "conversation":  # with what its turn sent open too
            await page.click("#turn-1 details.sent summary")
            await expect(page.locator("#turn-1 [data-sent-loaded]")).to_be_visible(timeout=WAIT_MS)
        assert await page.evaluate("window.innerWidth") == NARROW
        assert await page.evaluate(OVERFLOWS) == [], path
        await page.evaluate("window.scrollTo(0, 0)")  # the sticky header at the top of the picture
        await console.shot(page, f"narrow-{name}")
    # the conversations table became cards: one per conversation, its id whole on it
    await page.goto(console.url + "/conversations")
    card = page.locator("tr[data-conversation='narrow-one-with-a-rather-long-identifier']")
    assert await card.evaluate("row => getComputedStyle(row).display") == "block"
    await expect(card.locator("[data-id]")).to_have_text("narrow-one-with-a-rather-long-identifier")
    await context.close()


async def test_the_consortium_index_tells_a_run_below_its_threshold_from_a_confident_one(console: Console) -> None:
    client = console.client
    await client.request("consortium:save", {"name": "strict", "members": ["openai/stub-a"],
                                             "arbiter": "openai/judge", "confidence_threshold": 0.99,
                                             "max_iterations": 1})
    await client.request("consortium:save", {"name": "easy", "members": ["openai/stub-a"], "arbiter": "openai/judge"})
    strict = await complete(client, prompt="a hard question", conversation_id="strict-council", create=True,
                            model="consortium/strict")
    easy = await complete(client, prompt="an easy question", conversation_id="easy-council", create=True,
                          model="consortium/easy")
    page = await console.page("/")
    await page.click("nav a:has-text('Consortium')")
    await expect(page.locator("h1")).to_have_text("Consortium runs")
    doubtful = page.locator(f"tr[data-run='{strict['run_id']}']")
    await expect(doubtful.locator("[data-outcome]")).to_have_text("below threshold")
    await expect(doubtful).to_contain_text("0.93 of 0.99")
    await expect(doubtful).to_contain_text("strict-council")
    await expect(page.locator(f"tr[data-run='{easy['run_id']}'] [data-outcome]")).to_have_text("confident")
    await console.shot(page, "consortium-index")
    await doubtful.locator("a", has_text=strict["run_id"]).click()
    await expect(page.locator("h1")).to_contain_text(strict["run_id"])
    outcome = page.locator("dd[data-outcome]")
    await expect(outcome).to_contain_text("below threshold")
    assert "ok" not in (await outcome.text_content() or "").split()  # the run never says `status ok`
    await expect(page.locator("dd[data-threshold]")).to_have_text("0.99")
    await expect(page.locator("nav a[aria-current=page]")).to_have_text("Consortium")
    await console.shot(page, "consortium-below-threshold")
    await page.close()


async def test_health_tells_the_truth_right_after_a_provider_error(console: Console) -> None:
    page = await console.page("/health")
    await expect(page.locator("[data-last-error]")).to_have_count(0)  # nothing has failed in this module yet
    console.stub.model_script["stub-broken"] = deque([Reply(status=500)] * 3)  # every attempt of the request
    with pytest.raises(KsiError) as failed:
        await complete(console.client, prompt="will fail", model="openai/stub-broken", conversation_id="broken",
                       create=True)
    assert failed.value.code == "provider_error"
    await page.reload()  # at once, not after a refresh period
    await expect(page.locator("[data-last-error]")).to_have_text("provider_error")
    await expect(page.locator("[data-failing]")).to_contain_text("openai/stub-broken")
    broken = page.locator("table.per-model tr[data-model='openai/stub-broken']")
    await expect(broken.locator("[data-requests]")).to_have_text("1")
    await expect(broken.locator("[data-failed]")).to_have_text("1")
    error = page.locator("table.recent-errors tr[data-error=provider_error]", has_text="openai/stub-broken")
    await expect(error).to_contain_text("broken")
    working = page.locator("table.per-model tr[data-model='openai/stub-model']")
    await expect(working).to_contain_text("ok")
    assert await working.locator("[data-failed]").text_content() == "0"
    await console.shot(page, "health-after-error")
    await page.close()


async def test_text_renders_as_markdown_and_raw_html_as_text(console: Console) -> None:
    planted = ("**bold words** and `a code span`\n\n- first item\n- second item\n\n"
               "<script>window.__planted = 1</script><b class=\"raw\">raw tag</b>"
               " [a link](javascript:window.__planted=2) <img src=x onerror=\"window.__planted = 3\">"
               " ![a pixel](http://127.0.0.1:9/leak.png?d=the-conversation)")
    await complete(console.client, prompt=planted, model="echo/echo", conversation_id="markdown", create=True)
    page = await console.page("/conversations/markdown")
    reply = page.locator("#turn-1 [data-reply]")
    await expect(reply.locator("strong")).to_have_text("bold words")  # the echo model repeats the input
    await expect(reply.locator("code")).to_have_text("a code span")
    await expect(reply.locator("li")).to_have_count(2)
    await expect(reply).to_contain_text('<script>window.__planted = 1</script><b class="raw">raw tag</b>')
    await expect(reply).to_contain_text('<img src=x onerror="window.__planted = 3">')
    typed = page.locator("#turn-1 [data-input]")
    await expect(typed.locator("strong")).to_have_text("bold words")
    await expect(typed).to_contain_text("<script>window.__planted = 1</script>")
    assert await page.locator("main script, main b.raw, main img, main a[href^=javascript]").count() == 0
    assert await page.evaluate("window.__planted") is None
    await expect(reply).to_contain_text("[a link](javascript:window.__planted=2)")  # refused as a link: text
    # a Markdown image would be fetched from wherever the reply points: shown as a link, never loaded
    await expect(reply.locator("a[href^='http://127.0.0.1:9/']")).to_have_count(1)
    reloaded = await page.reload()
    assert reloaded is not None and "img-src 'self'" in reloaded.headers["content-security-policy"]
    usage = await page.locator("#turn-1 [data-usage]").text_content() or ""
    assert " in · " in usage and " out · " in usage and usage.endswith(" tokens")
    await console.shot(page, "markdown")
    await page.close()


async def test_sending_from_a_page_ends_the_stream_clears_the_box_and_adds_the_turn(console: Console) -> None:
    await complete(console.client, prompt="first turn", conversation_id="sending", create=True)
    page = await console.page("/conversations/sending")
    await expect(page.locator("li.turn")).to_have_count(1)
    await page.fill("textarea[name=prompt]", "the **second** turn")
    await page.click("form[data-answer] button[type=submit]")
    form = page.locator("form[data-answer]")
    await expect(form).to_have_attribute("data-done", "result", timeout=WAIT_MS)
    await expect(page.locator("li.turn")).to_have_count(2)  # joined the list, without a reload
    await expect(page.locator("#turn-2 [data-reply]")).to_have_text("stub answer to: the second turn")
    await expect(page.locator("#turn-2 [data-reply] strong")).to_have_text("second")  # rendered, not streamed text
    await expect(page.locator("#turn-2 [data-input] strong")).to_have_text("second")
    await expect(page.locator("textarea[name=prompt]")).to_have_value("")
    await expect(page.locator("[data-answer-out] .role")).to_have_text("assistant")  # no longer "streaming"
    await expect(page.locator("[data-answer-out]")).to_be_hidden()  # shown once: in the list
    await expect(page.locator("[data-answer-state]")).to_contain_text("done: exchange #2")
    await expect(page.locator("[data-answer-state]")).to_contain_text("tokens")
    await page.click("#turn-2 details.sent summary")  # the new turn's own panel works like the others
    await expect(page.locator("#turn-2 [data-sent-loaded] .part-input")).to_contain_text("the **second** turn",
                                                                                         timeout=WAIT_MS)
    await console.shot(page, "sent-from-page")

    await page.fill("textarea[name=prompt]", "a third")
    await page.click("form[data-answer] button[type=submit]")
    await expect(page.locator("li.turn")).to_have_count(3, timeout=WAIT_MS)
    assert [t["n"] for t in (await console.client.request(
        "conversation:show", {"conversation_id": "sending"}))["exchanges"]] == [1, 2, 3]
    await page.close()
