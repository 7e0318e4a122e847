"""The web console under load, measured in headless Chromium with Playwright's timings.

    .venv/bin/python scripts/bench/console_bench.py [--conversations 10000] [--rate 1000] [--seconds 5]

1. Conversation list: a var dir with 10,000 conversations on disk (written in the documented
   on-disk format: metadata, index line and response file each), a real daemon subprocess
   serving HTTP. The browser loads `/conversations` (the first page, 50 rows, paginated on the
   server) repeatedly; the time is the navigation's `responseStart - requestStart` (the server's
   answer) and `loadEventEnd - startTime` (the page rendered). Baselines in the same run: the
   first load after the daemon starts (every metadata file read once), and `/health`, a page
   that lists nothing (the floor of HTTP, templates and the browser). Goal: first page under
   200 ms.
2. Event burst: the browser shows `/events` while a client sends `--rate` requests per second
   for `--seconds` over the Unix socket (each one is an event on the bus). In the page: events
   received, dropped by the daemon (the stream's bounded queue), trimmed from the page's buffer,
   table renders, and the longest gap between animation frames (a frozen page has long gaps).
   Goal: every event is received or counted as dropped, and the page keeps drawing.

Prints a table and writes scripts/bench/results/console_bench.json.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
from harness import clean_env, free_port, machine, write_results

from ksi_common.client import KsiClient
from ksi_common.console_login import make_code
from ksi_common.layout import VarLayout

CHROMIUM = "/usr/bin/chromium"
TOKEN = "ksi-bench-token-0123456789"
GOAL_MS = 200.0


def write_conversations(layout: VarLayout, count: int) -> None:
    """`count` one-exchange conversations in the on-disk format the daemon writes."""
    for directory in (layout.conversations_dir, layout.responses_dir, layout.conversation_meta_dir):
        directory.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        conversation_id, response_id = f"bench-{i:05d}", f"openai-stub-model-{i:012x}"
        ts = f"2026-01-{1 + i % 28:02d}T{i % 24:02d}:{i % 60:02d}:{i % 59:02d}Z"
        layout.response_file(response_id).write_bytes(
            orjson.dumps({"v": 1, "type": "user", "content": f"question {i}", "ts": ts,
                          "conversation_id": conversation_id}) + b"\n"
            + orjson.dumps({"v": 1, "type": "assistant", "content": f"answer {i}", "model": "openai/stub-model",
                            "usage": {"prompt_tokens": 5, "completion_tokens": 3}, "ts": ts,
                            "conversation_id": conversation_id}) + b"\n")
        layout.index_file(conversation_id).write_bytes(orjson.dumps(
            {"v": 1, "n": 1, "response_id": response_id, "ts": ts, "model": "openai/stub-model",
             "tokens_in": 6, "tokens_out": 5}) + b"\n")
        layout.meta_file(conversation_id).write_bytes(orjson.dumps(
            {"v": 1, "conversation_id": conversation_id, "created": ts, "last_activity": ts,
             "title": f"bench conversation {i}", "tags": ["bench", f"t{i % 10}"], "exchanges": 1,
             "tokens_in": 5, "tokens_out": 3, "models": ["openai/stub-model"]}))


def start_daemon(root: Path, port: int) -> subprocess.Popen[bytes]:
    env = clean_env(KSI_HTTP_TOKEN=TOKEN, KSI_LITELLM_PRELOAD="false", OPENAI_API_KEY="sk-bench")
    return subprocess.Popen(
        [sys.executable, "-m", "ksi_daemon", "--quiet", "--var-dir", str(root / "var"),
         "--socket", str(root / "d.sock"), "--http", f"127.0.0.1:{port}"],
        cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


async def wait_for_http(url: str, process: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient() as http:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"the daemon exited: {process.stderr.read().decode() if process.stderr else ''}")
            try:
                if (await http.get(url + "/health", headers={"Authorization": f"Bearer {TOKEN}"})).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError("the daemon's HTTP front did not answer")


NAVIGATION = """() => { const n = performance.getEntriesByType("navigation")[0];
  return {server: n.responseStart - n.requestStart, loaded: n.loadEventEnd - n.startTime}; }"""

FRAME_WATCH = """() => { window.benchGaps = []; let last = performance.now();
  const tick = (now) => { window.benchGaps.push(now - last); last = now; window.benchFrame = requestAnimationFrame(tick); };
  window.benchFrame = requestAnimationFrame(tick); }"""


async def load(page: Any, url: str) -> dict[str, float]:
    await page.goto(url, wait_until="load")
    return await page.evaluate(NAVIGATION)


def summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {"median_ms": round(statistics.median(ordered), 1),
            "p95_ms": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.95))], 1),
            "max_ms": round(ordered[-1], 1), "runs": len(ordered)}


async def burst(client: KsiClient, rate: int, seconds: float) -> int:
    """`rate` requests per second for `seconds`, in 10 ms steps; each one is an event on the bus."""
    sent = 0
    step = 0.01
    per_step = max(1, round(rate * step))
    loop = asyncio.get_running_loop()
    start = loop.time()
    pending: list[asyncio.Future[Any]] = []
    while loop.time() - start < seconds:
        for _ in range(per_step):
            pending.append(asyncio.ensure_future(client.request("system:help", {"event": "system:health"})))
            sent += 1
        next_step = start + (sent / per_step) * step
        await asyncio.sleep(max(0.0, next_step - loop.time()))
    await asyncio.gather(*pending)
    return sent


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from playwright.async_api import async_playwright

    root = Path(tempfile.mkdtemp(prefix="ksi-cbench-", dir="/tmp"))
    layout = VarLayout(root / "var")
    started = time.perf_counter()
    write_conversations(layout, args.conversations)
    written_s = time.perf_counter() - started
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = start_daemon(root, port)
    report: dict[str, Any] = {"conversations": args.conversations, "write_s": round(written_s, 1)}
    try:
        await wait_for_http(url, process)
        async with async_playwright() as playwright:
            browser = await playwright.chromium.launch(executable_path=CHROMIUM)
            context = await browser.new_context(viewport={"width": 1280, "height": 800})
            page = await context.new_page()
            await page.goto(f"{url}/login?code={make_code(TOKEN)}")
            url = page.url.rstrip("/")  # the console's pages live below the session's prefix
            first = await load(page, url + "/conversations")
            rows = await page.locator("table.conversations tbody tr").count()
            total = await page.locator("[data-total]").get_attribute("data-total")
            assert rows == 50 and total == str(args.conversations), (rows, total)
            warm = [await load(page, url + "/conversations") for _ in range(args.repeats)]
            second_page = [await load(page, url + "/conversations?offset=50") for _ in range(args.repeats)]
            health = [await load(page, url + "/health") for _ in range(args.repeats)]
            report["list"] = {
                "first_after_start": {k: round(v, 1) for k, v in first.items()},
                "first_page_server": summary([s["server"] for s in warm]),
                "first_page_loaded": summary([s["loaded"] for s in warm]),
                "second_page_loaded": summary([s["loaded"] for s in second_page]),
                "health_page_loaded": summary([s["loaded"] for s in health]),
            }

            await page.goto(url + "/events")
            await page.wait_for_function("document.querySelector('[data-state]').textContent === 'live'")
            await page.evaluate(FRAME_WATCH)
            before = await page.evaluate("({...window.ksiEvents})")
            async with KsiClient(root / "d.sock") as client:
                burst_started = time.perf_counter()
                sent = await burst(client, args.rate, args.seconds)
                burst_s = time.perf_counter() - burst_started
            # settle: everything sent is either in the page or counted as dropped
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                now = await page.evaluate("({...window.ksiEvents})")
                if (now["received"] - before["received"]) + (now["dropped"] - before["dropped"]) >= sent:
                    break
                await asyncio.sleep(0.2)
            gaps = await page.evaluate("cancelAnimationFrame(window.benchFrame), window.benchGaps")
            after = await page.evaluate("({...window.ksiEvents})")
            shown_rows = await page.locator("[data-rows] tr").count()
            report["burst"] = {
                "sent": sent, "seconds": round(burst_s, 2), "rate_per_s": round(sent / burst_s),
                "received": after["received"] - before["received"],
                "dropped_by_daemon": after["dropped"] - before["dropped"],
                "trimmed_from_buffer": after["trimmed"] - before["trimmed"],
                "renders": after["renders"] - before["renders"],
                "rows_in_table": shown_rows,
                "frames": len(gaps),
                "longest_frame_gap_ms": round(max(gaps), 1) if gaps else None,
                "frame_gap_p95_ms": round(sorted(gaps)[int(len(gaps) * 0.95)], 1) if gaps else None,
            }
            await browser.close()
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
        shutil.rmtree(root, ignore_errors=True)
    report["machine"] = machine()
    return report


def print_table(report: dict[str, Any]) -> None:
    listing, events = report["list"], report["burst"]
    print(f"\nconversation list, {report['conversations']:,} conversations on disk (goal: first page < {GOAL_MS:.0f} ms)")
    print(f"{'what':44} {'median ms':>10} {'p95 ms':>10} {'max ms':>10}")
    rows = [("first page, server answer", listing["first_page_server"]),
            ("first page, rendered (loadEventEnd)", listing["first_page_loaded"]),
            ("second page, rendered", listing["second_page_loaded"]),
            ("baseline: /health page, rendered", listing["health_page_loaded"])]
    for name, stats in rows:
        print(f"{name:44} {stats['median_ms']:>10} {stats['p95_ms']:>10} {stats['max_ms']:>10}")
    cold = listing["first_after_start"]
    print(f"{'baseline: first load after start (cold)':44} {cold['loaded']:>10} {'':>10} {'':>10}"
          f"   (server {cold['server']} ms)")
    print(f"\nevent burst: {events['sent']:,} events in {events['seconds']} s ({events['rate_per_s']:,}/s)")
    for key in ("received", "dropped_by_daemon", "trimmed_from_buffer", "renders", "rows_in_table", "frames",
                "longest_frame_gap_ms", "frame_gap_p95_ms"):
        print(f"  {key:26} {events[key]}")
    accounted = events["received"] + events["dropped_by_daemon"]
    print(f"  every event received or counted as dropped: {'yes' if accounted >= events['sent'] else 'NO'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=10_000)
    parser.add_argument("--rate", type=int, default=1000, help="events per second in the burst")
    parser.add_argument("--seconds", type=float, default=5.0, help="how long the burst lasts")
    parser.add_argument("--repeats", type=int, default=20, help="page loads per measurement")
    args = parser.parse_args()
    report = asyncio.run(run(args))
    print_table(report)
    write_results("console_bench", report)


if __name__ == "__main__":
    main()
