"""Another web server on the same host, seen by a real browser (Chromium) that is logged into the
console: it receives nothing of KSI's, and the pages it serves change no conversation through any
route, even when they know the session's path prefix.

Browsers send a host's cookies to every port of it, and a page on another port of 127.0.0.1 is the
same site (SameSite=Strict lets its requests carry the cookie): only the cookie's path and the
daemon's own origin check stand between such a page and the conversations.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
from playwright.async_api import async_playwright

from ksi_common.console_login import make_code
from tests.conftest import complete, connected, running_http_daemon
from tests.test_console import WAIT_MS

# A page of another local server: it tries every way a page has to write into a conversation.
ATTACK = """<!doctype html><html><body><script>
const ksi = %(ksi)s + new URLSearchParams(location.search).get("prefix");
const planted = {model: "echo/x", input: "planted", conversation: "target"};
const items = {items: [{type: "message", role: "user", content: "planted question"},
                       {type: "message", role: "assistant", content: "planted answer"}]};
const bodies = {
  "/v1/responses": JSON.stringify(planted),
  "/v1/conversations/target/items": JSON.stringify(items),
  "/v1/conversations/target": JSON.stringify({metadata: {planted: "yes"}}),
  "/v1/conversations": JSON.stringify(items),
  "/v1/chat/completions": JSON.stringify({model: "echo/x", messages: [{role: "user", content: "planted"}],
                                          conversation_id: "target"}),
  "/conversations/target/send": "prompt=planted",
  "/conversations/target/fork": "at=1",
  "/conversations/target/archive": "",
  "/agents/target/send": "prompt=planted",
};
const tries = [];
for (const [path, body] of Object.entries(bodies)) {
  for (const type of ["text/plain", "application/x-www-form-urlencoded"]) {
    tries.push(fetch(ksi + path, {method: "POST", mode: "no-cors", credentials: "include",
                                  headers: {"Content-Type": type}, body}));
  }
  const form = new FormData();
  form.append("prompt", "planted");
  tries.push(fetch(ksi + path, {method: "POST", mode: "no-cors", credentials: "include", body: form}));
  tries.push(fetch(ksi + path, {method: "POST", credentials: "include",
                                headers: {"Content-Type": "application/json"}, body}));
}
tries.push(fetch(ksi + "/v1/conversations/target", {method: "DELETE", credentials: "include"}));
// forms submitted into frames: navigations carry the cookie as a link would; a text/plain form
// can shape its body as JSON
let frames = 0;
function submit(path, enctype, name, value) {
  const frame = document.createElement("iframe");
  frame.name = "f" + (++frames);
  document.body.appendChild(frame);
  const form = document.createElement("form");
  form.method = "POST"; form.action = ksi + path; form.enctype = enctype; form.target = frame.name;
  const input = document.createElement("input");
  input.name = name; input.value = value;
  form.appendChild(input);
  document.body.appendChild(form);
  tries.push(new Promise(done => { frame.onload = done; setTimeout(done, 5000); }));
  form.submit();
}
for (const path of Object.keys(bodies)) {
  const json = bodies[path];
  if (json.startsWith("{")) {
    submit(path, "text/plain", json.slice(0, -1) + ', "pad": "', '"}');
  }
  submit(path, "application/x-www-form-urlencoded", "prompt", "planted");
  submit(path, "multipart/form-data", "prompt", "planted");
}
// and its own server, where a cookie for this host would be sent along
for (const path of ["/", "/s/", "/login", "/v1/models", "/conversations"]) {
  tries.push(fetch(path, {credentials: "include"}));
}
Promise.allSettled(tries).then(() => { window.done = true; });
</script></body></html>"""


class Neighbour:
    """Another web server on 127.0.0.1 (a dev server, a notebook): it serves the page above and
    records the headers of every request it receives."""

    def __init__(self, ksi_base: str) -> None:
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        page = (ATTACK % {"ksi": json.dumps(ksi_base)}).encode()
        received = self.requests

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                received.append((self.command, self.path, {k.lower(): v for k, v in self.headers.items()}))
                body = page if urlsplit(self.path).path == "/attack" else b""
                self.send_response(200 if body else 204)
                self.send_header("Content-Type", "text/html; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer  # noqa: N815 (http.server's names)

            def log_message(self, *_args: Any) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Neighbour:
        self.thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


def stored(var_dir: Path) -> dict[str, bytes]:
    """Every stored file of the var dir (the daemon's own log, run files and exchange journal aside:
    the journal empties itself once an exchange's files are written)."""
    return {str(path.relative_to(var_dir)): path.read_bytes() for path in sorted(var_dir.rglob("*"))
            if path.is_file() and path.relative_to(var_dir).parts[:2] != ("logs", "daemon")
            and path.relative_to(var_dir).parts[0] != "run"
            and path.relative_to(var_dir).parts[:2] != ("state", "exchange-log")
            and path.relative_to(var_dir).parts != ("state", "console_codes.json")}  # the login's spent code


async def test_another_local_server_gets_no_credential_and_its_pages_change_nothing(short_tmp: Path,
                                                                                   chromium_path: str) -> None:
    async with running_http_daemon(short_tmp, http_token=None) as served, connected(served.daemon) as client:
        await complete(client, prompt="the original turn", model="echo/x", conversation_id="target", create=True)
        before = stored(served.daemon.settings.var_dir)
        listed = (await client.request("conversation:list", {}))["total"]
        root = served.daemon.http.sessions.root
        with Neighbour(served.base_url) as neighbour:
            async with async_playwright() as playwright:
                browser = await playwright.chromium.launch(executable_path=chromium_path)
                try:
                    context = await browser.new_context()
                    console = await context.new_page()
                    await console.goto(f"{served.base_url}/login?code={make_code(served.token)}")
                    assert console.url == f"{served.base_url}{root}/"
                    # the neighbour's page, not knowing the session's prefix, then knowing it
                    for prefix in ("", root):
                        page = await context.new_page()
                        await page.goto(f"{neighbour.url}/attack?prefix={prefix}")
                        await page.wait_for_function("window.done === true", timeout=WAIT_MS * 3)
                        await page.close()
                    # the victim's own console still works: the session itself is intact
                    shown = await console.goto(f"{served.base_url}{root}/conversations/target")
                    assert shown is not None and shown.status == 200
                    assert "planted" not in await console.content()
                finally:
                    await browser.close()
        assert stored(served.daemon.settings.var_dir) == before
        assert (await client.request("conversation:list", {}))["total"] == listed
        assert (await client.request("conversation:show", {"conversation_id": "target"}))["total_exchanges"] == 1
        paths = [path for _method, path, _headers in neighbour.requests]
        assert "/s/" in paths and "/v1/models" in paths  # the page ran, and asked its own server
        for _method, path, headers in neighbour.requests:
            assert "ksi_session" not in headers.get("cookie", ""), (path, headers)
            assert served.token not in json.dumps(headers), (path, headers)
            assert not headers.get("referer", "").startswith(served.base_url), (path, headers)
        # whatever it received opens nothing at the daemon, not even with the prefix
        async with httpx.AsyncClient(base_url=served.base_url) as http:
            for _method, _path, headers in neighbour.requests:
                replay = {k: v for k, v in headers.items() if k in ("cookie", "authorization")}
                for path in ("/v1/models", f"{root}/v1/models", f"{root}/"):
                    assert (await http.get(path, headers=replay)).status_code == 401, (path, replay)
