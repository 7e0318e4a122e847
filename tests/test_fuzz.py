"""Hostile input at the socket and at every registered event: random bytes, random JSON, deep
nesting, huge lines, wrong types, unicode edge cases, path tricks. The daemon must answer each
request with a structured error (a known code) or close the connection; it never crashes, never
leaks a traceback and never writes outside var/.

The probes and strategies here are shared with scripts/fuzz_socket.py, which runs them longer.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pytest
import pytest_asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ksi_common.errors import ErrorCode
from ksi_daemon.daemon import Daemon
from ksi_daemon.router import Route
from tests.conftest import running_daemon

KNOWN_CODES = frozenset(code.value for code in ErrorCode)
LINE_LIMIT = 64 * 1024
SENTINEL_ID = "fuzz-sentinel"
SENTINEL = orjson.dumps({"event": "system:health", "correlation_id": SENTINEL_ID}) + b"\n"
SKIPPED_EVENTS = frozenset({"system:shutdown"})  # it would end the shared daemon
OFFLINE_MODEL = "echo/fuzz"
ESCAPE_MARK = "ksi-fuzz-escape"
REPLY_TIMEOUT = 20.0

FUZZ_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                          HealthCheck.too_slow], derandomize=False)

# -- strategies ---------------------------------------------------------------------------------

EDGE_STRINGS = [
    "", " ", "\x00", "a\x00b", "\u202eevil\u202c", "\u200f\u200e", "😀" * 8, "\ufeff", "\U0010ffff",
    "e\u0301", "\n", "\r\n", "\t", "*", "ns:*", ":", "%s%n%x", "${jndi:ldap://x}", "null", "true", "-1",
    "9" * 400, "\u0000" * 3, "ℌ𝔢𝔩𝔩𝔬", "ﷺ", "\u2028\u2029", "..", "../" * 12 + f"tmp/{ESCAPE_MARK}",
    f"/tmp/{ESCAPE_MARK}-abs", f"a/../../{ESCAPE_MARK}", "%2e%2e%2f", "con", "NUL.txt", "a" * 200,
]
# lone surrogates are only expressible as escapes (\ud800) in JSON text, which the daemon must refuse
LONE_SURROGATES = ["\ud800", "a\udfffb", "\udbff"]

text = st.one_of(
    st.sampled_from(EDGE_STRINGS),
    st.text(max_size=30),
    st.text(alphabet=st.characters(codec="utf-8"), min_size=1, max_size=12),
)
scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    text,
)
json_values = st.recursive(
    scalars,
    lambda children: st.one_of(st.lists(children, max_size=4), st.dictionaries(text, children, max_size=4)),
    max_leaves=12,
)
raw_fragments = st.sampled_from([
    b"\n", b"{", b"}", b"[", b"]", b'"', b'{"event":', b'"system:health"', b'"data":', b",", b"\xff", b"\xc3",
    b"\x00", b"\r\n", b'{"event": "system:health", "data": ', b"null", b"1e999", b"\\u", b"\xed\xa0\x80",
])
random_bytes = st.lists(st.one_of(st.binary(max_size=120), raw_fragments), max_size=20).map(b"".join)


def encode_line(frame: Any, ascii_only: bool) -> bytes:
    """A JSON line; with ascii_only lone surrogates become \\ud800 escapes, else raw (invalid) UTF-8."""
    return json.dumps(frame, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass") + b"\n"


def tame(event: str, data: Any) -> Any:
    """Keep fuzzed payloads offline and the shared daemon alive: answers come from the echo model."""
    if isinstance(data, dict):
        if "model" in data or event in ("completion:async", "agent:spawn"):
            data["model"] = OFFLINE_MODEL
        data.pop("consortium", None)
        for key in ("wait", "timeout"):
            if key in data and isinstance(data[key], int | float) and not isinstance(data[key], bool):
                data[key] = min(abs(data[key]), 2)
    return data


@st.composite
def event_payloads(draw: st.DrawFn, routes: list[Route]) -> tuple[str, Any]:
    """An event's name and data: its real field names with values of any type, plus stray keys."""
    route = draw(st.sampled_from(routes))
    names = list(route.model.model_fields)
    data: Any
    shape = draw(st.integers(0, 9))
    if shape == 0:
        data = draw(json_values)  # not even an object, sometimes
    else:
        chosen = draw(st.lists(st.sampled_from(names), unique=True, max_size=len(names))) if names else []
        data = {name: draw(json_values) for name in chosen}
        if draw(st.booleans()):
            data.update(draw(st.dictionaries(text, json_values, max_size=2)))
        for name in chosen:  # string-looking fields get the unicode and path edge cases more often
            if name.endswith(("_id", "id")) or name in ("profile", "name", "prompt", "message", "files", "new_id"):
                if draw(st.integers(0, 2)) == 0:
                    data[name] = draw(st.sampled_from(EDGE_STRINGS))
    return route.name, tame(route.name, data)


# -- probing the daemon -------------------------------------------------------------------------


@dataclass
class Probe:
    """What came back for one hostile payload."""

    frames: list[dict[str, Any]] = field(default_factory=list)
    raw: bytes = b""
    closed: bool = False
    missing: set[str] = field(default_factory=set)


class FuzzFailure(AssertionError):
    pass


async def probe(socket_path: Path, payload: bytes, expect: set[str] | None = None,
                timeout: float = REPLY_TIMEOUT) -> Probe:
    """Send `payload` then a health request; read until every expected reply (and the health one)
    came, or the daemon closed the connection. Checks every frame on the way.

    Sending and receiving run side by side on a raw socket: when the daemon refuses an over-long
    line it replies and closes while the rest is still being sent, and the reply must still be read.
    """
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    result = Probe(missing={SENTINEL_ID, *(expect or ())})

    async def send() -> None:
        try:
            # the newline ends any half line of the payload
            await loop.sock_sendall(sock, payload + b"\n" + SENTINEL)
        except OSError:
            pass  # closed by the daemon after refusing the line

    try:
        await loop.sock_connect(sock, str(socket_path))
        sending = loop.create_task(send())
        buffer = b""
        deadline = loop.time() + timeout
        while result.missing:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise FuzzFailure(f"no reply for {sorted(result.missing)} within {timeout}s "
                                  f"to payload {payload[:200]!r}")
            try:
                chunk = await asyncio.wait_for(loop.sock_recv(sock, 1 << 20), remaining)
            except TimeoutError:
                continue
            except OSError:
                chunk = b""
            if not chunk:
                result.closed = True
                break
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                result.raw += line + b"\n"
                try:
                    frame = orjson.loads(line)
                except orjson.JSONDecodeError:
                    raise FuzzFailure(f"reply is not JSON: {line[:200]!r}") from None
                result.frames.append(frame)
                if isinstance(frame, dict) and not frame.get("push"):
                    if frame.get("correlation_id") is None:  # the line could not be parsed at all
                        result.missing &= {SENTINEL_ID}
                    result.missing.discard(frame.get("correlation_id"))
        sending.cancel()
        await asyncio.gather(sending, return_exceptions=True)
    finally:
        sock.close()
    check_replies(result, payload)
    return result


def check_replies(result: Probe, payload: bytes) -> None:
    if b"Traceback" in result.raw or b'File "' in result.raw:
        raise FuzzFailure(f"a reply leaks a traceback: {result.raw[:500]!r}")
    for frame in result.frames:
        if not isinstance(frame, dict):
            raise FuzzFailure(f"reply is not an object: {frame!r}")
        if frame.get("push"):
            continue
        if "error" in frame:
            error = frame["error"]
            if not isinstance(error, dict) or error.get("code") not in KNOWN_CODES:
                raise FuzzFailure(f"unknown error shape or code {error!r} for {payload[:200]!r}")
            if not isinstance(error.get("message"), str) or not isinstance(error.get("details"), dict):
                raise FuzzFailure(f"error without message/details: {error!r}")
        elif "data" not in frame:
            raise FuzzFailure(f"reply with neither data nor error: {frame!r}")
    if result.closed and SENTINEL_ID in result.missing:
        codes = {f["error"]["code"] for f in result.frames if "error" in f}
        if "payload_too_large" not in codes and result.frames:
            # closing is allowed, but it should be for a reason the client was told about
            raise FuzzFailure(f"connection closed without payload_too_large: {result.frames[-3:]!r}")


async def assert_alive(socket_path: Path) -> None:
    result = await probe(socket_path, b"", timeout=10.0)
    health = next(f for f in result.frames if f.get("correlation_id") == SENTINEL_ID)
    if health.get("data", {}).get("status") != "healthy":
        raise FuzzFailure(f"system:health does not answer healthy: {health!r}")


async def probe_event(socket_path: Path, event: str, data: Any, ascii_only: bool = True) -> Probe:
    frame = {"event": event, "data": data, "correlation_id": "fuzz-1"}
    return await probe(socket_path, encode_line(frame, ascii_only), expect={"fuzz-1"})


def tree_outside(parent: Path, var_dir: Path) -> set[str]:
    """Every path under `parent` except var/ itself (sockets included)."""
    seen = set()
    for dirpath, dirnames, filenames in os.walk(parent):
        if Path(dirpath) == var_dir.parent and var_dir.name in dirnames:
            dirnames.remove(var_dir.name)
        for name in dirnames + filenames:
            seen.add(str(Path(dirpath, name).relative_to(parent)))
    return seen


def escapes(*roots: Path) -> list[str]:
    found = []
    for root in roots:
        for dirpath, _dirs, files in os.walk(root):
            found.extend(os.path.join(dirpath, f) for f in files if ESCAPE_MARK in f)
    found.extend(str(p) for p in Path("/tmp").glob(f"{ESCAPE_MARK}*"))
    return found


def fuzz_routes(daemon: Daemon) -> list[Route]:
    return [route for route in daemon.router.events() if route.name not in SKIPPED_EVENTS]



# -- the shared daemon ----------------------------------------------------------------------------


@dataclass
class FuzzBox:
    daemon: Daemon
    parent: Path  # the temporary root's parent: nothing may appear here outside var/
    before: set[str]
    routes: list[Route]

    @property
    def socket(self) -> Path:
        return self.daemon.settings.socket


# Fuzzed requests are given echo/ models; should one slip through, every other model is sent to a
# closed local port (settings, as the autouse fixture resets provider variables for each test).
OFFLINE_MODELS = {"*": {"api_base": "http://127.0.0.1:9/v1"}, "echo/*": {}}


@asynccontextmanager
async def fuzz_box(**overrides: Any) -> AsyncIterator[FuzzBox]:
    """A daemon on a fresh temporary root, litellm loaded; providers other than echo/ go nowhere."""
    parent = Path(tempfile.mkdtemp(prefix="kf-", dir="/tmp"))
    root = parent / "r"
    root.mkdir()
    values = dict(default_model=OFFLINE_MODEL, line_limit=LINE_LIMIT, retry_attempts=1, request_timeout=5.0,
                  models=OFFLINE_MODELS)
    values.update(overrides)
    try:
        async with running_daemon(root, **values) as daemon:
            await daemon.litellm.ensure_loaded()  # now, while the offline litellm variables are set
            before = tree_outside(parent, daemon.layout.root)
            yield FuzzBox(daemon, parent, before, fuzz_routes(daemon))
    finally:
        shutil.rmtree(parent, ignore_errors=True)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def box() -> AsyncIterator[FuzzBox]:
    """One daemon for the whole module."""
    async with fuzz_box() as shared:
        yield shared


# -- the tests (200 hypothesis examples in all) --------------------------------------------------


@settings(max_examples=50, **FUZZ_SETTINGS)
@given(payload=random_bytes)
async def test_random_bytes(box: FuzzBox, payload: bytes) -> None:
    await probe(box.socket, payload)
    await assert_alive(box.socket)


@settings(max_examples=40, **FUZZ_SETTINGS)
@given(frame=json_values, ascii_only=st.booleans())
async def test_random_json_lines(box: FuzzBox, frame: Any, ascii_only: bool) -> None:
    if isinstance(frame, dict) and frame.get("event") in SKIPPED_EVENTS:
        return
    await probe(box.socket, encode_line(frame, ascii_only))
    await assert_alive(box.socket)


@settings(max_examples=110, **FUZZ_SETTINGS)
@given(data=st.data(), ascii_only=st.booleans())
async def test_every_event_with_hostile_data(box: FuzzBox, data: st.DataObject, ascii_only: bool) -> None:
    event, payload = data.draw(event_payloads(box.routes))
    result = await probe_event(box.socket, event, payload, ascii_only)
    reply = next((f for f in result.frames if f.get("correlation_id") == "fuzz-1"), None)
    assert reply is None or reply["event"] in (event, None)
    await assert_alive(box.socket)


async def test_each_event_gets_wrong_types_and_edge_strings(box: FuzzBox) -> None:
    """Deterministic sweep: every field of every event with each kind of wrong value."""
    wrong = [None, True, -1, 2**70, 1.5, "", "\x00", "\u202e", "\U0001F600", [], {}, [[[]]], {"a": {"b": {}}},
             "../" * 10 + f"tmp/{ESCAPE_MARK}", "x" * 5000]
    for route in box.routes:
        names = list(route.model.model_fields) or ["unexpected"]
        for value in wrong:
            payload = tame(route.name, {name: value for name in names})
            await probe_event(box.socket, route.name, payload)
        for bad_data in (None, [], "text", 7, [{"event": "system:shutdown"}]):
            await probe_event(box.socket, route.name, bad_data)
    await assert_alive(box.socket)


async def test_deep_nesting_is_a_structured_invalid_json(box: FuzzBox) -> None:
    for depth in (1025, 10_000, 200_000):
        for line in (b"[" * depth + b"]" * depth,
                     b'{"event": "system:health", "data": {"x": ' + b"[" * depth + b"]" * depth + b"}}",
                     b'{"a":' * depth + b"1" + b"}" * depth):
            if len(line) >= LINE_LIMIT:
                line = line[:LINE_LIMIT - 1]  # under the limit: parsed, and refused
            result = await probe(box.socket, line)
            codes = [f["error"]["code"] for f in result.frames if "error" in f]
            assert codes and codes[0] == "invalid_json", codes
    # nesting orjson reads (up to 1024 levels) but cannot write back (254 at most): refused up front
    for depth in (129, 300, 1000):
        deep = b'{"x": ' * depth + b"1" + b"}" * depth  # written out: json.dumps itself recurses
        for event in ("completion:async", "conversation:import", "agent:spawn", "monitor:subscribe"):
            line = (b'{"event": "' + event.encode() + b'", "correlation_id": "fuzz-1", "data": '
                    b'{"prompt": "deep", "model": "echo/fuzz", "metadata": ' + deep + b"}}")
            result = await probe(box.socket, line, expect={"fuzz-1"})
            (reply,) = [f for f in result.frames if f.get("correlation_id") == "fuzz-1"]
            assert reply["error"]["code"] == "invalid_request", reply
            assert reply["error"]["details"]["limit"] == 128
    # nesting within the limit is stored and answered like any other request
    fine: Any = "leaf"
    for _ in range(120):
        fine = [fine]
    payload = {"prompt": "fine", "metadata": {"deep": fine}, "model": OFFLINE_MODEL}
    result = await probe_event(box.socket, "completion:async", payload)
    (ack,) = [f for f in result.frames if f.get("correlation_id") == "fuzz-1"]
    wait = {"request_id": ack["data"]["request_id"], "timeout": 20}
    result = await probe_event(box.socket, "completion:wait", wait)
    (done,) = [f for f in result.frames if f.get("correlation_id") == "fuzz-1"]
    assert "content" in done["data"], done
    await assert_alive(box.socket)


async def test_huge_lines_under_and_over_the_limit(box: FuzzBox) -> None:
    under = {"event": "completion:async", "data": {"prompt": "\u00e9" * (LINE_LIMIT // 3), "model": OFFLINE_MODEL},
             "correlation_id": "fuzz-1"}
    result = await probe(box.socket, encode_line(under, False), expect={"fuzz-1"})
    assert "data" in next(f for f in result.frames if f.get("correlation_id") == "fuzz-1")
    for size in (LINE_LIMIT + 1, 4 * LINE_LIMIT, 64 * LINE_LIMIT):
        over = b'{"event": "system:health", "data": {"x": "' + b"a" * size + b'"}}'
        result = await probe(box.socket, over)
        assert [f["error"]["code"] for f in result.frames if "error" in f][:1] == ["payload_too_large"]
        assert result.closed
    # a huge line without any newline is refused too, before it is complete
    result = await probe(box.socket, b"x" * (8 * LINE_LIMIT))
    assert result.closed
    await assert_alive(box.socket)


async def test_unicode_edge_cases_are_answered_or_refused(box: FuzzBox) -> None:
    for value in [*EDGE_STRINGS, *LONE_SURROGATES]:
        for ascii_only in (True, False):
            for event, payload in (("completion:async", {"prompt": value, "create": True,
                                                         "conversation_id": value or "x"}),
                                   ("system:help", {"event": value}),
                                   ("monitor:subscribe", {"patterns": [value]}),
                                   (value, {})):
                await probe_event(box.socket, event, tame(event, payload), ascii_only)
    raw_cases = [b"\xff\xfe", b'{"event": "system:health\xff"}', b'{"event": "\xed\xa0\x80"}',
                 b'{"event": "sys\x00tem:health"}', b"\x00" * 100, b'{"event": "system:health", "data": {}}\x00']
    for raw in raw_cases:
        result = await probe(box.socket, raw)
        assert all(f["error"]["code"] in KNOWN_CODES for f in result.frames if "error" in f)
    await assert_alive(box.socket)


async def test_nothing_was_written_outside_var(box: FuzzBox) -> None:
    """Runs last in the module: no hostile id or path left a file outside var/."""
    await asyncio.sleep(0.5)  # let queued echo completions finish writing
    after = tree_outside(box.parent, box.daemon.layout.root)
    assert after - box.before == set(), sorted(after - box.before)
    assert escapes(box.parent, Path(tempfile.gettempdir())) == []
    await assert_alive(box.socket)


# -- events written by an agent: only its profile's allowlist passes -------------------------------

LOOKALIKES = [
    "system:shutdown", "Agent:Info", "AGENT:INFO", "agent:info ", " agent:info", "agent:info\u200b",
    "\u0430gent:info", "agent:*", "*", "agent:info\n", "agent:infos", "agent:", "agent:terminate",
    "monitor:subscribe",
]


async def test_agent_events_pass_only_the_profile_allowlist(short_tmp: Path) -> None:
    from tests.conftest import connected, stub_settings
    from tests.stub_openai import StubOpenAI

    profiles = short_tmp / "profiles"
    profiles.mkdir()
    (profiles / "narrow.yaml").write_text("system: You may look, not touch.\nallowed_events: ['agent:info']\n")
    events = [{"event": "agent:info", "data": {"agent_id": "b"}},
              {"event": "agent:info", "data": {"agent_id": "b", "event": "system:shutdown"}},
              *({"event": name, "data": {"agent_id": "b", "all": True}} for name in LOOKALIKES)]
    reply = "Here goes:\n" + "\n".join(json.dumps(e) for e in events)
    async with StubOpenAI() as stub, \
            running_daemon(short_tmp, **stub_settings(stub, profiles_dir=profiles)) as daemon, \
            connected(daemon) as client:
        if "agent:spawn" not in {r.name for r in daemon.router.events()}:
            pytest.skip("no agent service")
        await client.request("agent:spawn", {"agent_id": "a", "profile": "narrow"})
        await client.request("agent:spawn", {"agent_id": "b"})
        dispatched: list[str] = []
        daemon.router.listen("*", lambda name, _d, context: dispatched.append(name)
                             if context.agent_id == "a" and not name.startswith("completion:") else None)
        stub.enqueue(reply)
        await client.request("agent:send_message", {"agent_id": "a", "message": "go", "wait": True})
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while not any("[ksi]" in str(m.get("content")) for r in stub.requests for m in r["messages"]):
            assert loop.time() < deadline, "the agent never got the outcome of its events"
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)
        assert dispatched == ["agent:info"]  # the exact allowed name once; the one with a stray field is refused
        assert not daemon.shutting_down
        info = await client.request("agent:info", {"agent_id": "b"})
        assert info.get("status", "active") == "active"
        assert (await client.request("system:health"))["status"] == "healthy"
