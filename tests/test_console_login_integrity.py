"""Console login codes: a spent code stays spent across a daemon restart within its minute (the
spent nonces are kept in the var dir until their codes expire), and wrong codes are taken at a
bounded rate: past it they are answered 429 `too_many_login_attempts` with Retry-After, and
logged once per burst instead of once per try."""

from __future__ import annotations

from pathlib import Path

import httpx
from structlog.testing import capture_logs

from ksi_common.console_login import make_code
from tests.conftest import HTTP_TOKEN, running_http_daemon

TRIES = 100


async def login(base_url: str, code: str) -> httpx.Response:
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as http:
        return await http.get("/login", params={"code": code})


async def test_a_spent_code_stays_spent_after_a_restart(short_tmp: Path) -> None:
    code = make_code(HTTP_TOKEN)
    async with running_http_daemon(short_tmp) as served:
        assert (await login(served.base_url, code)).status_code == 303
        assert (await login(served.base_url, code)).status_code == 401
    async with running_http_daemon(short_tmp) as served:
        again = await login(served.base_url, code)
        assert again.status_code == 401, again.text
        assert again.json()["error"]["code"] == "unauthorized"
        assert (await login(served.base_url, make_code(HTTP_TOKEN))).status_code == 303  # a fresh one works
    stored = short_tmp / "var" / "state" / "console_codes.json"
    assert stored.stat().st_mode & 0o077 == 0  # owner-only, as all of the var dir


async def test_wrong_codes_are_throttled_and_not_logged_one_by_one(short_tmp: Path) -> None:
    async with running_http_daemon(short_tmp) as served:
        statuses: list[int] = []
        throttled: list[httpx.Response] = []
        with capture_logs() as logged:
            for n in range(TRIES):
                answer = await login(served.base_url, f"{n}.guess.0000")
                statuses.append(answer.status_code)
                if answer.status_code == 429:
                    throttled.append(answer)
        assert set(statuses) == {401, 429}, statuses
        assert statuses[0] == 401
        assert throttled[0].json()["error"]["code"] == "too_many_login_attempts"
        assert int(throttled[0].headers["retry-after"]) >= 1
        events = [line["event"] for line in logged]
        # each try that was checked is logged; the throttled ones are not
        assert events.count("console_login_refused") == statuses.count(401) < TRIES
        assert 1 <= events.count("console_login_throttled") <= statuses.count(401)
