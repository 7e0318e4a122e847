"""`ksi console` on a terminal opens the browser with a one-time login code: the token is in no
command line (every local user reads those under /proc) and in no browser history."""

from __future__ import annotations

import asyncio
import sqlite3
import stat
import sys
from pathlib import Path

import httpx
import pexpect
from playwright.async_api import async_playwright

from tests.conftest import running_http_daemon
from tests.test_cli import clean_env


def fake_browser(root: Path) -> tuple[Path, Path]:
    """A browser command that only writes down the arguments it was started with."""
    argv = root / "browser-argv"
    script = root / "fake-browser"
    script.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {argv}\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script, argv


def console_on_a_terminal(root: Path, browser: Path, *args: str) -> str:
    child = pexpect.spawn(sys.executable, ["-m", "ksi_cli", "console", *args], cwd=str(root),
                          env=clean_env(BROWSER=str(browser)), encoding="utf-8", timeout=60)
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0, child.before
    return str(child.before)


async def test_ksi_console_starts_the_browser_with_a_code_that_works_once(short_tmp: Path) -> None:
    async with running_http_daemon(short_tmp, http_token=None) as served:
        settings = served.daemon.settings
        browser, argv = fake_browser(short_tmp)
        said = await asyncio.to_thread(console_on_a_terminal, short_tmp, browser, "--socket", str(settings.socket),
                                       "--var-dir", str(settings.var_dir))
        assert "opened in the system's browser" in said
        started_with = argv.read_text()
        assert served.token not in started_with and served.token not in said
        url = started_with.strip().splitlines()[-1]
        assert url.startswith(f"{served.base_url}/login?code=")
        async with httpx.AsyncClient() as http:
            first = await http.get(url)
            assert first.status_code == 303 and "ksi_session=" in first.headers["set-cookie"]
            assert served.token not in first.headers["set-cookie"]
            again = await http.get(url)
            assert again.status_code == 401


async def test_the_browser_history_holds_no_token(short_tmp: Path, chromium_path: str) -> None:
    async with running_http_daemon(short_tmp, http_token=None) as served:
        settings = served.daemon.settings
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "ksi_cli", "console", "--no-browser", "--socket", str(settings.socket),
            "--var-dir", str(settings.var_dir), stdout=asyncio.subprocess.PIPE, env=clean_env())
        out, _ = await process.communicate()
        url = out.decode().strip()
        profile = short_tmp / "profile"
        async with async_playwright() as playwright:
            context = await playwright.chromium.launch_persistent_context(str(profile), executable_path=chromium_path)
            try:
                page = await context.new_page()
                await page.goto(url)
                root = served.daemon.http.sessions.root
                assert page.url == f"{served.base_url}{root}/"
                await page.goto(f"{served.base_url}{root}/conversations")
            finally:
                await context.close()  # writes the history out
        with sqlite3.connect(profile / "Default" / "History") as history:
            visited = [row[0] for row in history.execute("SELECT url FROM urls")]
        assert any(link.startswith(f"{served.base_url}/s/") for link in visited), visited
        assert not [link for link in visited if served.token in link]
        for link in visited:  # a login link there is spent
            if "/login?" in link:
                async with httpx.AsyncClient() as http:
                    assert (await http.get(link)).status_code == 401
