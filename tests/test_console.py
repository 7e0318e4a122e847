"""The web console in real headless Chromium against a real in-process daemon and local stubs.

One daemon, one browser and one console server serve the whole module (Chromium's start-up
is the expensive part); every test uses its own conversations and agents. Screenshots of each
page land in `test-artifacts/console/` (gitignored).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import tempfile
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from playwright.async_api import Browser, BrowserContext, Page, async_playwright, expect

from ksi_common.client import KsiClient
from ksi_common.console_login import make_code
from ksi_daemon.daemon import Daemon
from tests.conftest import PROVIDER_PREFIXES, complete, connected, running_http_daemon
from tests.stub_openai import StubOpenAI

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts" / "console"
WAIT_MS = 20_000  # generous: two cores shared with other work


def verdict(_messages: list[dict[str, Any]]) -> str:
    return json.dumps({"synthesis": "the members agree", "confidence": 0.93, "dissent": "",
                       "refinement_areas": [], "needs_iteration": False, "ranking": [1, 2]})


@dataclass
class Console:
    daemon: Daemon
    client: KsiClient
    stub: StubOpenAI
    browser: Browser
    context: BrowserContext
    base: str  # the daemon's HTTP address
    url: str  # the console's root: below the browser session's prefix, where its cookie is sent
    token: str

    async def page(self, path: str = "/") -> Page:
        page = await self.context.new_page()
        await page.goto(self.url + path)
        return page

    async def logged_in(self, **options: Any) -> BrowserContext:
        """A fresh browser context (its own cookies) logged in through the login link."""
        context = await self.browser.new_context(**options)
        page = await context.new_page()
        await page.goto(f"{self.base}/login?code={make_code(self.token)}")
        assert page.url == self.url + "/"
        await page.close()
        return context

    async def shot(self, page: Page, name: str) -> None:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        await page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)

    async def subscriptions(self) -> int:
        return int((await self.client.request("system:health", {}))["subscriptions"])


async def wait_for(predicate: Any, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await predicate():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


async def ksi(*args: str) -> str:
    """Run the real `ksi` CLI as a subprocess without blocking the loop the daemon serves on."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "ksi_cli", *args, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await process.communicate()
    assert process.returncode == 0, err.decode()
    return out.decode()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def console(chromium_path: str) -> AsyncIterator[Console]:
    root = Path(tempfile.mkdtemp(prefix="ksi-console-", dir="/tmp"))
    async with AsyncExitStack() as stack:
        # the daemon outlives each test's own environment fixture: it gets the same one for the module
        environment = stack.enter_context(pytest.MonkeyPatch.context())
        for name in [n for n in os.environ if n.startswith(PROVIDER_PREFIXES)]:
            environment.delenv(name)
        environment.setenv("OPENAI_API_KEY", "sk-test-dummy")
        environment.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        environment.setenv("LITELLM_MODE", "PRODUCTION")
        stub = await stack.enter_async_context(StubOpenAI())
        judge = await stack.enter_async_context(StubOpenAI(answer=verdict))
        models = {"openai/stub*": {"api_base": stub.api_base}, "openai/judge*": {"api_base": judge.api_base},
                  # a window so small that a few turns leave the oldest out
                  "openai/tiny*": {"api_base": stub.api_base, "context_window": 400, "output_reserve": 50},
                  # a model that takes OpenAI's explicit cache breakpoints, answered by the stub
                  "openai/gpt-5.6*": {"api_base": stub.api_base}}
        # no explicit token: the daemon generates one into its var dir, where `ksi console` finds it
        served = await stack.enter_async_context(running_http_daemon(
            root, models=models, default_model="openai/stub-model", http_token=None))
        client = await stack.enter_async_context(connected(served.daemon))
        await served.daemon.litellm.ensure_loaded()  # its import is not what the tests' waits measure
        playwright = await stack.enter_async_context(async_playwright())
        browser = await playwright.chromium.launch(executable_path=chromium_path)
        context = await browser.new_context(viewport={"width": 1280, "height": 800})
        login = await context.new_page()
        await login.goto(f"{served.base_url}/login?code={make_code(served.token)}")  # the cookie every test uses
        await login.close()
        url = served.base_url + served.daemon.http.sessions.root
        try:
            yield Console(served.daemon, client, stub, browser, context, served.base_url, url, served.token)
        finally:
            await context.close()
            await browser.close()
            shutil.rmtree(root, ignore_errors=True)


async def test_the_ksi_console_url_logs_the_browser_in(console: Console) -> None:
    settings = console.daemon.settings
    url = (await ksi("console", "--no-browser", "--socket", str(settings.socket), "--var-dir", str(settings.var_dir))).strip()
    assert url.startswith(f"{console.base}/login?code=") and console.token not in url
    context = await console.browser.new_context(viewport={"width": 1280, "height": 800})
    page = await context.new_page()
    refused = await page.goto(console.url + "/")
    assert refused is not None and refused.status == 401  # no cookie yet: a page that says how to log in
    await expect(page.locator("body")).to_contain_text("ksi console")
    await page.goto(url)
    assert page.url == console.url + "/"  # the code is left behind in the redirect
    await expect(page.locator("h1")).to_have_text("Overview")
    cookies = {c["name"]: c for c in await context.cookies()}
    assert cookies["ksi_session"]["httpOnly"] is True and cookies["ksi_session"]["sameSite"] == "Strict"
    assert all(console.token not in c["value"] for c in cookies.values())
    await console.shot(page, "overview")
    again = await (await context.new_page()).goto(url)
    assert again is not None and again.status == 401  # the link worked once
    await context.close()


async def test_an_event_sent_with_ksi_send_appears_in_the_live_stream(console: Console) -> None:
    page = await console.page("/events")
    await expect(page.locator("[data-state]")).to_have_text("live", timeout=WAIT_MS)
    await ksi("send", "--socket", str(console.daemon.settings.socket), "conversation:list", "--tag", "marker-from-ksi-send")
    await expect(page.locator("[data-rows] tr", has_text="marker-from-ksi-send").first).to_be_visible(timeout=2000)
    await console.shot(page, "events")
    await page.close()


async def test_the_agents_table_shows_a_spawned_agent(console: Console) -> None:
    page = await console.page("/agents")
    await console.client.request("agent:spawn", {"agent_id": "scout", "model": "openai/stub-model"})
    row = page.locator("tr[data-agent=scout]")
    await expect(row).to_be_visible(timeout=WAIT_MS)  # the table refreshes itself
    await expect(row).to_contain_text("active")
    await expect(row).to_contain_text("openai/stub-model")
    await console.shot(page, "agents")
    await page.goto(console.url + "/agents/scout")
    await page.fill("textarea[name=prompt]", "report in")
    await page.click("form[data-answer] button[type=submit]")
    await expect(page.locator("form[data-answer]")).to_have_attribute("data-done", "result", timeout=WAIT_MS)
    await expect(page.locator("[data-answer-text]")).to_have_text("stub answer to: report in")
    await console.shot(page, "agent")
    await page.close()


async def test_a_turn_shows_what_was_sent_and_a_fork_continues_from_the_page(console: Console) -> None:
    client = console.client
    await complete(client, prompt="first question", conversation_id="tour", create=True, system="be brief")
    await complete(client, prompt="second question", conversation_id="tour")
    page = await console.page("/conversations/tour")
    await page.click("#turn-2 details.sent summary")
    sent = page.locator("#turn-2 [data-sent-loaded]")
    await expect(sent).to_be_visible(timeout=WAIT_MS)
    await expect(sent.locator(".part-history")).to_have_count(2)  # turn 1's question and answer
    await expect(sent.locator(".part-input")).to_contain_text("second question")
    await expect(sent.locator(".part-system")).to_contain_text("be brief")
    await console.shot(page, "conversation")

    await page.click("button[data-fork='1']")
    await page.wait_for_url(lambda url: "/conversations/conv-" in url, timeout=WAIT_MS)
    fork_id = (await page.locator("[data-conversation-id]").text_content() or "").strip()
    await expect(page.locator("li.turn")).to_have_count(1)
    requests_before = len(console.stub.requests)
    await page.fill("textarea[name=prompt]", "a different second")
    await page.click("form[data-answer] button[type=submit]")
    await expect(page.locator("form[data-answer]")).to_have_attribute("data-done", "result", timeout=WAIT_MS)
    await expect(page.locator("[data-answer-text]")).to_have_text("stub answer to: a different second")
    assert len(console.stub.requests) == requests_before + 1
    users = [m["content"] for m in console.stub.messages(-1) if m["role"] == "user"]
    assert users == ["first question", "a different second"]  # only turn 1 of the history
    shown = await client.request("conversation:show", {"conversation_id": fork_id})
    assert [x["n"] for x in shown["exchanges"]] == [1, 2]
    await console.shot(page, "fork")
    await page.close()


async def test_the_pin_button_pins_an_exchange_and_what_was_sent_shows_it(console: Console) -> None:
    client = console.client
    for prompt in ("remember the code 4817", "second", "third"):
        await complete(client, prompt=prompt, conversation_id="pinning", create=True)
    page = await console.page("/conversations/pinning")
    await page.click("button[data-pin='1']")
    await expect(page.locator("button[data-pin='1']")).to_have_text("Unpin", timeout=WAIT_MS)
    shown = await client.request("conversation:show", {"conversation_id": "pinning"})
    assert shown["conversation"]["pins"] == [1]
    await page.click("button[data-pin='1']")
    await expect(page.locator("button[data-pin='1']")).to_have_text("Pin", timeout=WAIT_MS)
    shown = await client.request("conversation:show", {"conversation_id": "pinning"})
    assert shown["conversation"]["pins"] == []
    await page.close()


async def test_what_was_sent_names_what_stood_in_for_the_exchanges_left_out(console: Console) -> None:
    for turn in range(6):
        await complete(console.client, prompt=f"turn {turn} " + "words " * 40, conversation_id="narrow",
                       create=True, model="openai/tiny-window")
    sent = await console.client.request("conversation:sent", {"conversation_id": "narrow", "n": 6})
    assert sent["stand_in"] and sent["stand_in"][0]["first"] == 1  # what the page must show
    page = await console.page("/conversations/narrow")
    await page.click("#turn-6 details.sent summary")
    panel = page.locator("#turn-6 [data-sent-loaded]")
    await expect(panel).to_contain_text(f"#1–#{sent['stand_in'][0]['upto']} stood in for by", timeout=WAIT_MS)
    await expect(panel).to_contain_text(f"left out: {sent['omitted']}")
    await page.close()


async def test_a_consortium_runs_page_shows_members_and_confidence(console: Console) -> None:
    await console.client.request("consortium:save", {
        "name": "pair", "members": ["openai/stub-a", "openai/stub-b"], "arbiter": "openai/judge"})
    result = await complete(console.client, prompt="decide", conversation_id="council", create=True,
                            model="consortium/pair")
    page = await console.page("/conversations/council")
    await page.click("a:has-text('consortium run')")
    await expect(page.locator("h1")).to_contain_text(result["run_id"])
    await expect(page.locator("tr[data-member='openai/stub-a']")).to_contain_text("stub answer to: decide")
    await expect(page.locator("tr[data-member='openai/stub-b']")).to_be_visible()
    await expect(page.locator("[data-confidence]")).to_have_text("0.93")
    await expect(page.locator("[data-final-confidence]")).to_have_text("0.93")
    await console.shot(page, "consortium")
    await page.close()


async def test_conversation_content_is_escaped(console: Console) -> None:
    attack = "<script>window.__injected = 1</script><img src=x onerror=\"window.__injected = 2\">"
    await complete(console.client, prompt=attack, conversation_id="hostile", create=True)
    page = await console.page("/conversations/hostile")
    await expect(page.locator("[data-reply]")).to_have_text(f"stub answer to: {attack}")
    await page.click("#turn-1 details.sent summary")
    await expect(page.locator("#turn-1 .part-input")).to_contain_text(attack)
    assert await page.evaluate("window.__injected") is None
    assert await page.locator("main img").count() == 0
    listing = await console.page("/conversations?text=__injected")
    await expect(listing.locator("table.conversations")).to_contain_text("hostile")
    await console.shot(listing, "conversations")
    await page.close()
    await listing.close()


async def test_closing_a_tab_frees_its_subscription(console: Console) -> None:
    before = await console.subscriptions()
    page = await console.page("/events")
    await expect(page.locator("[data-state]")).to_have_text("live", timeout=WAIT_MS)

    async def subscribed() -> bool:
        return await console.subscriptions() == before + 1

    async def freed() -> bool:
        return await console.subscriptions() == before

    await wait_for(subscribed)
    await page.close()
    await wait_for(freed)


async def test_pages_render_on_a_narrow_window_and_in_dark_mode(console: Console) -> None:
    context = await console.logged_in(viewport={"width": 390, "height": 800}, color_scheme="dark")
    page = await context.new_page()
    for path, name in (("/", "overview-narrow-dark"), ("/conversations", "conversations-narrow-dark"),
                       ("/health", "health-narrow-dark")):
        response = await page.goto(console.url + path)
        assert response is not None and response.status == 200
        width = await page.evaluate("document.documentElement.scrollWidth")
        assert width <= 390, f"{path} scrolls sideways on a narrow window"
        await console.shot(page, name)
    background = await page.evaluate("getComputedStyle(document.body).backgroundColor")
    assert background == "rgb(21, 23, 26)"
    await context.close()


PAGES = ["/", "/events", "/events/stream", "/agents", "/agents/guard", "/conversations", "/conversations/guarded",
         "/conversations/guarded/sent/1", "/conversations/guarded/export?format=json", "/consortium", "/consortium/run-x",
         "/health", "/health?fragment=1", "/agents?fragment=1", "/static/console.js"]
ACTIONS = ["/agents/guard/send", "/conversations/guarded/send", "/conversations/guarded/fork",
           "/conversations/guarded/archive"]


async def test_every_page_and_endpoint_refuses_a_missing_or_wrong_token(console: Console) -> None:
    import httpx

    await complete(console.client, prompt="keep me", conversation_id="guarded", create=True)
    before = await console.client.request("conversation:list", {"limit": 1000})
    requests_before = len(console.stub.requests)
    ways = [({}, {}), ({"Authorization": "Bearer wrong-token"}, {}), ({}, {"ksi_session": "wrong-session"}),
            ({}, {"ksi_token": console.token}),
            ({"Authorization": f"Basic {console.token}"}, {})]
    async with httpx.AsyncClient(base_url=console.url, timeout=10.0) as http:
        for headers, cookies in ways:
            http.cookies.clear()
            http.cookies.update(cookies)
            for path in PAGES:
                response = await http.get(path, headers=headers)
                assert response.status_code == 401, (path, headers, cookies)
                assert "keep me" not in response.text
            for path in ACTIONS:
                response = await http.post(path, headers=headers, data={"prompt": "sneak in", "at": "1"})
                assert response.status_code == 401, (path, headers, cookies)
        http.cookies.clear()
        good = await http.get("/conversations/guarded", headers={"Authorization": f"Bearer {console.token}"})
        assert good.status_code == 200 and "keep me" in good.text
    after = await console.client.request("conversation:list", {"limit": 1000})
    assert after["total"] == before["total"]  # no fork was made
    assert next(c for c in after["conversations"] if c["conversation_id"] == "guarded")["status"] == "active"
    assert len(console.stub.requests) == requests_before  # nothing reached the model


async def test_a_form_posted_from_another_site_is_refused(console: Console) -> None:
    import httpx

    await complete(console.client, prompt="stay active", conversation_id="forged", create=True)
    async with httpx.AsyncClient(base_url=console.base, timeout=10.0) as http:
        assert (await http.get("/login", params={"code": make_code(console.token)})).status_code == 303
        response = await http.post(console.url + "/conversations/forged/archive", headers={"Origin": "http://evil.example"})
    assert response.status_code == 403 and response.json()["error"]["code"] == "cross_site_request"
    shown = await console.client.request("conversation:show", {"conversation_id": "forged", "limit": 1})
    assert shown["conversation"]["status"] == "active"


async def test_the_health_page_shows_in_flight_requests_per_model_and_the_storage(console: Console) -> None:
    console.stub.hold = 2.0  # answers wait, so the request is seen running
    try:
        ack = await console.client.request("completion:async", {"prompt": "slow one", "conversation_id": "slow",
                                                                "create": True, "model": "openai/stub-slow"})
        page = await console.page("/health")
        in_flight = page.locator("table.in-flight tr", has_text="openai/stub-slow")
        await expect(in_flight).to_be_visible(timeout=WAIT_MS)
        await expect(page.locator(".card", has_text="storage")).to_contain_text("jsonl")
        await expect(page.locator(".card", has_text="resident memory")).to_contain_text("MB")
        # the pool: this daemon alone on JSONL storage, alive, with its pid
        daemons = page.locator("table.daemons tbody tr")
        await expect(daemons).to_have_count(1)
        await expect(daemons.first).to_have_attribute("data-state", "alive")
        await expect(daemons.first).to_contain_text(f"{os.getpid()}")
        await expect(daemons.first).to_contain_text("(this)")
        await console.shot(page, "health")
        await console.client.request("completion:wait", {"request_id": ack["request_id"], "timeout": 30})
        await expect(in_flight).to_have_count(0, timeout=WAIT_MS)
        await page.close()
    finally:
        console.stub.hold = 0.0


async def run_ksi(*args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "ksi_cli", *args, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await process.communicate()
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_ksi_console_says_when_there_is_no_http_front_or_no_daemon(daemon: Daemon, short_tmp: Path) -> None:
    code, out, err = await run_ksi("console", "--no-browser", "--socket", str(daemon.settings.socket))
    assert (code, out) == (1, "") and "--http" in err
    code, out, err = await run_ksi("console", "--no-browser", "--socket", str(short_tmp / "nobody.sock"))
    assert (code, out) == (3, "") and "daemon_unreachable" in err


async def test_the_live_view_filters_and_pauses(console: Console) -> None:
    page = await console.page("/events")
    await expect(page.locator("[data-state]")).to_have_text("live", timeout=WAIT_MS)
    client = console.client
    await client.request("conversation:list", {"tag": "filter-a"})
    await client.request("system:help", {"event": "system:health"})
    rows = page.locator("[data-rows] tr")
    await expect(rows.filter(has_text="filter-a")).to_have_count(1, timeout=WAIT_MS)
    await page.fill("input[name=namespace]", "system")
    await expect(rows.filter(has_text="conversation:list")).to_have_count(0)
    await expect(rows.filter(has_text="system:help").first).to_be_visible()
    await page.fill("input[name=namespace]", "")
    await page.select_option("select[name=level]", "error")
    await expect(rows).to_have_count(0)
    await page.select_option("select[name=level]", "")

    await page.click("[data-pause]")
    await expect(page.locator("[data-pause]")).to_have_attribute("aria-pressed", "true")
    for number in range(3):
        await client.request("conversation:list", {"tag": f"while-paused-{number}"})
    await page.wait_for_function("window.ksiEvents.pending >= 3", timeout=WAIT_MS)
    await expect(rows.filter(has_text="while-paused")).to_have_count(0)  # the table holds still
    await page.click("[data-pause]")
    await expect(rows.filter(has_text="while-paused")).to_have_count(3)
    await console.shot(page, "events-filtered")
    await page.close()


def test_every_link_of_the_templates_stays_below_the_session_prefix() -> None:
    """A browser sends its session cookie only below `root`: a page linking to `/...` would log it out."""
    import re

    templates = Path(__file__).resolve().parent.parent / "ksi_daemon" / "transports" / "console" / "templates"
    rooted = re.compile(r'(?:href|action|src|data-[a-z-]+)\s*=\s*"/')  # a Jinja `with action="/..."` too
    found = [(path.name, line) for path in sorted(templates.glob("*.html"))
             for line in path.read_text().splitlines() if rooted.search(line)]
    assert found == []


async def test_a_prompt_past_the_body_limit_is_refused_and_said_on_the_page(console: Console) -> None:
    await complete(console.client, prompt="before the big one", conversation_id="too-big", create=True)
    before = await console.client.request("conversation:show", {"conversation_id": "too-big"})
    requests_before = len(console.stub.requests)
    page = await console.page("/conversations/too-big")
    await page.fill("textarea[name=prompt]", "x" * (console.daemon.settings.line_limit + 1))
    await page.click("form[data-answer] button[type=submit]")
    await expect(page.locator("form[data-answer]")).to_have_attribute("data-done", "error", timeout=WAIT_MS)
    await expect(page.locator("[data-answer-state]")).to_contain_text("payload_too_large")
    await page.close()
    assert len(console.stub.requests) == requests_before
    after = await console.client.request("conversation:show", {"conversation_id": "too-big"})
    assert after["total_exchanges"] == before["total_exchanges"] == 1
    assert (await console.client.request("system:health", {}))["status"] == "healthy"
