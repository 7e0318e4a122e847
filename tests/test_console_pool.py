"""The console's health page lists the daemons of a pool in real headless Chromium: host, pid,
version, last heartbeat, in flight, queued and the conversation leases each holds, a daemon whose
heartbeat stopped marked stale."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import asyncpg
from playwright.async_api import async_playwright, expect

from ksi_common import __version__
from ksi_common.console_login import make_code
from tests.conftest import connected, running_http_daemon, stub_settings
from tests.test_console import WAIT_MS

SILENT = "0123456789ab"  # the id of a daemon that stopped beating long ago


async def test_the_health_page_lists_the_pools_daemons_with_their_leases_and_marks_a_stale_one(
        short_tmp: Path, pg_url: str, stub: Any, chromium_path: str) -> None:
    stub.model_delay["stub-slow"] = 30.0  # held at the model: its conversation's lease is held meanwhile
    settings = {**stub_settings(stub), "storage": "postgres", "database_url": pg_url,
                "heartbeat_interval": 0.2, "heartbeat_timeout": 1.0}
    async with running_http_daemon(short_tmp, **settings) as served, connected(served.daemon) as client, \
            async_playwright() as playwright:
        conn = await asyncpg.connect(pg_url)
        try:  # another daemon of the pool, whose heartbeat stopped a minute ago with 3 leases held
            await conn.execute(
                "INSERT INTO ksi_daemons (daemon_id, host, pid, version, started, heartbeat, in_flight, queued, "
                "leases) VALUES ($1, 'other-host', 4242, '0.0.1', now() - interval '1 hour', "
                "now() - interval '1 minute', 2, 5, 3)", SILENT)
        finally:
            await conn.close()
        ack = await client.request("completion:async", {"prompt": "slow", "conversation_id": "held", "create": True,
                                                        "model": "openai/stub-slow"})
        while not stub.requests:
            await asyncio.sleep(0.02)
        browser = await playwright.chromium.launch(executable_path=chromium_path)
        try:
            page = await browser.new_page(viewport={"width": 1280, "height": 800})
            await page.goto(f"{served.base_url}/login?code={make_code(served.token)}")
            health = served.base_url + served.daemon.http.sessions.root + "/health"
            me = served.daemon.pool.me.daemon_id
            mine = page.locator(f'table.daemons tr[data-daemon="{me}"]')
            for _ in range(100):  # until a heartbeat counted the lease the slow turn holds
                await page.goto(health)
                if await mine.locator('td[data-label="leases"]').text_content() == "1":
                    break
                await asyncio.sleep(0.1)
            await expect(page.locator("table.daemons tbody tr")).to_have_count(2)
            await expect(mine).to_have_attribute("data-state", "alive")
            for label, shown in (("host", served.daemon.pool.me.host), ("pid", str(os.getpid())),
                                 ("version", __version__), ("in flight", "1"), ("queued", "0"), ("leases", "1"),
                                 ("state", "alive")):
                await expect(mine.locator(f'td[data-label="{label}"]')).to_have_text(shown, timeout=WAIT_MS)
            await expect(mine.locator('td[data-label="last heartbeat"]')).to_contain_text("s ago")
            silent = page.locator(f'table.daemons tr[data-daemon="{SILENT}"]')
            await expect(silent).to_have_attribute("data-state", "stale")
            for label, shown in (("host", "other-host"), ("pid", "4242"), ("version", "0.0.1"), ("in flight", "2"),
                                 ("queued", "5"), ("leases", "3"), ("state", "stale")):
                await expect(silent.locator(f'td[data-label="{label}"]')).to_have_text(shown)
            assert float((await silent.locator('td[data-label="last heartbeat"]').text_content() or "").split()[0]) >= 59
        finally:
            await browser.close()
        await client.request("completion:cancel", {"request_id": ack["request_id"]})
