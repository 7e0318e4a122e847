"""The socket protocol end to end: framing, error codes, pipelining, misbehaving clients."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import orjson
import pytest

from ksi_common.client import KsiClient
from ksi_daemon.context import EventContext
from ksi_daemon.daemon import Daemon
from ksi_daemon.events import NoData
from ksi_daemon.transports.unix import Connection
from tests.conftest import running_daemon

REPLY_TIMEOUT = 10.0


class Raw:
    """A bare connection to the daemon: write any bytes, read reply lines."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, daemon: Daemon) -> Raw:
        reader, writer = await asyncio.open_unix_connection(str(daemon.settings.socket), limit=1 << 24)
        return cls(reader, writer)

    async def send_bytes(self, payload: bytes) -> None:
        self.writer.write(payload)
        await self.writer.drain()

    async def send(self, frame: Any) -> None:
        await self.send_bytes(orjson.dumps(frame) + b"\n")

    async def read(self, timeout: float = REPLY_TIMEOUT) -> dict[str, Any]:
        line = await asyncio.wait_for(self.reader.readline(), timeout)
        assert line, "the daemon closed the connection"
        return orjson.loads(line)

    async def roundtrip(self, payload: bytes) -> dict[str, Any]:
        await self.send_bytes(payload)
        return await self.read()

    async def close(self) -> None:
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except (ConnectionError, OSError):
            pass


@pytest.fixture
async def raw(daemon: Daemon) -> Any:
    connection = await Raw.open(daemon)
    yield connection
    await connection.close()


def error_of(reply: dict[str, Any]) -> dict[str, Any]:
    assert "error" in reply, reply
    assert "data" not in reply
    assert reply["timestamp"].endswith("Z")
    return reply["error"]


async def assert_healthy(daemon: Daemon) -> None:
    async with KsiClient(daemon.settings.socket) as other:
        health = await asyncio.wait_for(other.request("system:health"), REPLY_TIMEOUT)
        assert health["status"] == "healthy"


# -- framing and request shape ------------------------------------------------


async def test_success_reply_shape(raw: Raw) -> None:
    reply = await raw.roundtrip(b'{"event": "system:health", "correlation_id": "c-1"}\n')
    assert set(reply) == {"event", "correlation_id", "data", "timestamp"}
    assert reply["event"] == "system:health"
    assert reply["correlation_id"] == "c-1"
    assert reply["data"]["status"] == "healthy"
    assert reply["timestamp"].endswith("Z") and "T" in reply["timestamp"]


async def test_malformed_json_is_invalid_json_with_null_ids(raw: Raw) -> None:
    reply = await raw.roundtrip(b'{"event": "system:health", "correlation_id": "c-1"\n')
    assert error_of(reply)["code"] == "invalid_json"
    assert reply["event"] is None
    assert reply["correlation_id"] is None
    # the connection survives a bad line
    reply = await raw.roundtrip(b'{"event": "system:health", "correlation_id": "c-2"}\n')
    assert reply["correlation_id"] == "c-2" and "data" in reply


async def test_non_utf8_line_is_invalid_json(raw: Raw) -> None:
    reply = await raw.roundtrip(b'{"event": "system:health", "x": "\xff\xfe"}\n')
    assert error_of(reply)["code"] == "invalid_json"
    assert reply["event"] is None and reply["correlation_id"] is None


@pytest.mark.parametrize("line", [b"[1, 2]", b'"system:health"', b"42", b"null", b"true"])
async def test_json_that_is_not_an_object_is_invalid_request(raw: Raw, line: bytes) -> None:
    reply = await raw.roundtrip(line + b"\n")
    assert error_of(reply)["code"] == "invalid_request"


@pytest.mark.parametrize("frame", [
    {"data": {}, "correlation_id": "c-9"},
    {"event": 42, "correlation_id": "c-9"},
    {"event": None, "correlation_id": "c-9"},
    {"event": "", "correlation_id": "c-9"},
    {"event": ["system:health"], "correlation_id": "c-9"},
])
async def test_missing_or_non_string_event_is_invalid_request(raw: Raw, frame: dict[str, Any]) -> None:
    await raw.send(frame)
    reply = await raw.read()
    error = error_of(reply)
    assert error["code"] == "invalid_request"
    assert "event" in error["details"]["fields"]
    assert reply["correlation_id"] == "c-9"


@pytest.mark.parametrize("data", [[1], "text", 7, True])
async def test_data_not_an_object_is_invalid_request(raw: Raw, data: Any) -> None:
    await raw.send({"event": "system:health", "data": data, "correlation_id": "c-3"})
    reply = await raw.read()
    error = error_of(reply)
    assert error["code"] == "invalid_request"
    assert "data" in error["details"]["fields"]
    assert reply["correlation_id"] == "c-3"
    assert reply["event"] == "system:health"


async def test_unknown_event_lists_similar_names(raw: Raw) -> None:
    await raw.send({"event": "system:helth", "correlation_id": "c-4"})
    reply = await raw.read()
    error = error_of(reply)
    assert error["code"] == "unknown_event"
    assert "system:health" in error["details"]["similar"]
    assert reply["event"] == "system:helth"
    assert reply["correlation_id"] == "c-4"


async def test_unknown_event_far_from_everything_has_no_similar(raw: Raw) -> None:
    await raw.send({"event": "zzzz:qqqq"})
    error = error_of(await raw.read())
    assert error["code"] == "unknown_event"
    assert error["details"]["similar"] == []


async def test_wrong_type_is_validation_error_naming_the_field(raw: Raw) -> None:
    await raw.send({"event": "system:help", "data": {"event": {"x": 1}}})
    error = error_of(await raw.read())
    assert error["code"] == "validation_error"
    assert list(error["details"]["fields"]) == ["event"]


async def test_unknown_extra_field_is_validation_error_naming_the_field(raw: Raw) -> None:
    await raw.send({"event": "system:help", "data": {"event": "system:health", "evnt": "x"}})
    error = error_of(await raw.read())
    assert error["code"] == "validation_error"
    assert "evnt" in error["details"]["fields"]


async def test_missing_required_field_is_validation_error(raw: Raw) -> None:
    await raw.send({"event": "system:help", "data": {}})
    error = error_of(await raw.read())
    assert error["code"] == "validation_error"
    assert "event" in error["details"]["fields"]


async def test_number_for_a_string_field_is_coerced(raw: Raw) -> None:
    # {"event": 42} is taken as the text "42": an unknown event, not a validation error
    await raw.send({"event": "system:help", "data": {"event": 42}})
    error = error_of(await raw.read())
    assert error["code"] == "unknown_event"
    await raw.send({"event": "system:discover", "data": {"namespace": 7}})
    reply = await raw.read()
    assert reply["data"] == {"events": {}, "count": 0}


async def test_null_data_is_empty_data(raw: Raw) -> None:
    reply = await raw.roundtrip(b'{"event": "system:health", "data": null}\n')
    assert reply["data"]["status"] == "healthy"


async def test_correlation_id_echoed_or_generated(raw: Raw) -> None:
    await raw.send({"event": "system:health", "correlation_id": "mine-77"})
    assert (await raw.read())["correlation_id"] == "mine-77"
    await raw.send({"event": "system:health"})
    first = (await raw.read())["correlation_id"]
    await raw.send({"event": "system:health"})
    second = (await raw.read())["correlation_id"]
    assert isinstance(first, str) and first and isinstance(second, str) and second
    assert first != second
    # a failure reply echoes it too
    await raw.send({"event": "nope:nope", "correlation_id": "mine-78"})
    assert (await raw.read())["correlation_id"] == "mine-78"


async def test_blank_lines_are_ignored(raw: Raw) -> None:
    reply = await raw.roundtrip(b'\n  \n{"event": "system:health", "correlation_id": "c-5"}\n')
    assert reply["correlation_id"] == "c-5"


async def test_frame_split_across_writes(raw: Raw) -> None:
    await raw.send_bytes(b'{"event": "system:he')
    await asyncio.sleep(0.02)
    reply = await raw.roundtrip(b'alth", "correlation_id": "split"}\n')
    assert reply["correlation_id"] == "split"
    assert reply["data"]["status"] == "healthy"


# -- oversized lines and misbehaving clients ---------------------------------


async def test_line_over_the_limit_is_refused_and_closed(short_tmp: Path) -> None:
    async with running_daemon(short_tmp, line_limit=1000) as daemon:
        big = await Raw.open(daemon)
        other = await Raw.open(daemon)
        try:
            padding = "x" * 2000
            await big.send({"event": "system:help", "data": {"event": padding}})
            reply = await big.read()
            assert error_of(reply)["code"] == "payload_too_large"
            assert reply["event"] is None
            # then the daemon closes that connection
            assert await asyncio.wait_for(big.reader.read(), REPLY_TIMEOUT) == b""
            # and keeps serving the others
            reply = await other.roundtrip(b'{"event": "system:health", "correlation_id": "o"}\n')
            assert reply["data"]["status"] == "healthy"
            await assert_healthy(daemon)
        finally:
            await big.close()
            await other.close()


async def test_line_under_the_limit_is_served(short_tmp: Path) -> None:
    async with running_daemon(short_tmp, line_limit=1000) as daemon:
        raw = await Raw.open(daemon)
        try:
            await raw.send({"event": "system:help", "data": {"event": "x" * 900}})
            assert error_of(await raw.read())["code"] == "unknown_event"
        finally:
            await raw.close()


async def test_endless_line_without_newline_is_refused(short_tmp: Path) -> None:
    async with running_daemon(short_tmp, line_limit=1000) as daemon:
        raw = await Raw.open(daemon)
        try:
            raw.writer.write(b'{"event": "' + b"y" * 5000)
            reply = await raw.read()
            assert error_of(reply)["code"] == "payload_too_large"
            assert await asyncio.wait_for(raw.reader.read(), REPLY_TIMEOUT) == b""
            await assert_healthy(daemon)
        finally:
            await raw.close()


async def test_half_line_then_disconnect(daemon: Daemon) -> None:
    raw = await Raw.open(daemon)
    await raw.send_bytes(b'{"event": "system:health", "corr')
    await raw.close()
    await assert_healthy(daemon)
    deadline = asyncio.get_running_loop().time() + 10.0
    while daemon.server.connections:  # both closed connections are let go
        assert asyncio.get_running_loop().time() < deadline, "a closed connection was kept"
        await asyncio.sleep(0.01)


async def test_client_that_never_reads_does_not_stall_others(daemon: Daemon) -> None:
    deaf = await Raw.open(daemon)
    request = b'{"event": "system:discover"}\n' * 500
    # Write without draining: the daemon stops reading once its replies back up.
    for _ in range(20):
        deaf.writer.write(request)
    # its replies back up: the daemon pauses that connection instead of buffering without end
    deadline = asyncio.get_running_loop().time() + 10.0
    while not any(conn.paused_by_writer for conn in daemon.server.connections):
        assert asyncio.get_running_loop().time() < deadline, "the deaf connection was never paused"
        await asyncio.sleep(0.02)
    await assert_healthy(daemon)
    deaf.writer.transport.abort()
    await asyncio.sleep(0.05)
    await assert_healthy(daemon)
    async with KsiClient(daemon.settings.socket) as client:
        health = await client.request("system:health")
        assert health["connections"] == 1


async def test_abrupt_disconnect_with_requests_in_flight(daemon: Daemon) -> None:
    async def slow(_data: NoData, _context: EventContext) -> dict[str, Any]:
        await asyncio.sleep(0.2)
        return {"slow": True}

    unregister = daemon.router.register("test:slow_gone", slow, NoData, "test")
    try:
        raw = await Raw.open(daemon)
        await raw.send_bytes(b'{"event": "test:slow_gone"}\n' * 10)
        raw.writer.transport.abort()
        await asyncio.sleep(0.3)
        await assert_healthy(daemon)
    finally:
        unregister()


# -- pipelining ---------------------------------------------------------------


async def test_pipelined_requests_matched_by_correlation_id(raw: Raw, daemon: Daemon) -> None:
    names = [route.name for route in daemon.router.events()]
    frames = []
    expected: dict[str, str] = {}
    for index in range(200):
        name = names[index % len(names)]
        correlation_id = f"p-{index}"
        expected[correlation_id] = name
        frames.append(orjson.dumps({
            "event": "system:help", "data": {"event": name}, "correlation_id": correlation_id,
        }) + b"\n")
    await raw.send_bytes(b"".join(frames))
    seen = {}
    for _ in range(200):
        reply = await raw.read()
        seen[reply["correlation_id"]] = reply["data"]["event"]
    assert seen == expected


async def test_slow_request_does_not_block_a_fast_one(raw: Raw, daemon: Daemon) -> None:
    async def slow(_data: NoData, _context: EventContext) -> dict[str, Any]:
        await asyncio.sleep(0.5)
        return {"which": "slow"}

    async def fast(_data: NoData, _context: EventContext) -> dict[str, Any]:
        return {"which": "fast"}

    removers = [
        daemon.router.register("test:slow", slow, NoData, "sleeps"),
        daemon.router.register("test:fast", fast, NoData, "answers at once"),
    ]
    try:
        await raw.send_bytes(
            b'{"event": "test:slow", "correlation_id": "s"}\n'
            b'{"event": "test:fast", "correlation_id": "f"}\n'
        )
        first = await raw.read()
        second = await raw.read()
        assert (first["correlation_id"], first["data"]["which"]) == ("f", "fast")
        assert (second["correlation_id"], second["data"]["which"]) == ("s", "slow")
    finally:
        for remove in removers:
            remove()


async def test_handler_crash_is_internal_error_without_traceback(raw: Raw, daemon: Daemon) -> None:
    async def broken(_data: NoData, _context: EventContext) -> dict[str, Any]:
        raise RuntimeError("secret-internal-detail")

    unregister = daemon.router.register("test:broken", broken, NoData, "raises")
    try:
        await raw.send({"event": "test:broken", "correlation_id": "b"})
        reply = await raw.read()
        assert error_of(reply)["code"] == "internal_error"
        assert "secret-internal-detail" not in orjson.dumps(reply).decode()
        assert "Traceback" not in orjson.dumps(reply).decode()
        assert reply["correlation_id"] == "b"
        reply = await raw.roundtrip(b'{"event": "system:health"}\n')
        assert reply["data"]["status"] == "healthy"
    finally:
        unregister()


async def test_many_clients_many_requests(daemon: Daemon) -> None:
    async def one_client() -> int:
        async with KsiClient(daemon.settings.socket) as client:
            replies = await asyncio.gather(*(client.send_frame("system:health") for _ in range(100)))
            assert all(reply["data"]["status"] == "healthy" for reply in replies)
            assert len({reply["correlation_id"] for reply in replies}) == 100
            return len(replies)

    counts = await asyncio.wait_for(asyncio.gather(*(one_client() for _ in range(100))), 60)
    assert sum(counts) == 10_000


async def test_blocking_socket_client_sees_one_reply_per_request(daemon: Daemon) -> None:
    def blocking() -> list[dict[str, Any]]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(REPLY_TIMEOUT)
            sock.connect(str(daemon.settings.socket))
            sock.sendall(b'{"event": "system:health", "correlation_id": "a"}\n'
                         b'not json\n'
                         b'{"event": "system:health", "correlation_id": "b"}\n')
            buffer = b""
            while buffer.count(b"\n") < 3:
                chunk = sock.recv(65536)
                assert chunk
                buffer += chunk
            return [orjson.loads(line) for line in buffer.splitlines()]

    replies = await asyncio.to_thread(blocking)
    assert len(replies) == 3
    codes = sorted((r.get("correlation_id") or "", r.get("error", {}).get("code", "ok")) for r in replies)
    assert codes == [("", "invalid_json"), ("a", "ok"), ("b", "ok")]


# -- handlers run like any task: the first step is eager, the rest runs in the task --------


async def test_handlers_run_inside_a_task(raw: Raw, daemon: Daemon) -> None:
    seen: dict[str, Any] = {}

    async def timed(_data: NoData, _context: EventContext) -> dict[str, Any]:
        seen["task_before_await"] = asyncio.current_task()
        try:
            async with asyncio.timeout(0.05):
                await asyncio.sleep(5)
        except TimeoutError:
            pass
        seen["task_after_await"] = asyncio.current_task()
        async with asyncio.TaskGroup() as group:
            child = group.create_task(asyncio.sleep(0, result=7))
        return {"timed_out": True, "child": child.result()}

    unregister = daemon.router.register("test:timed", timed, NoData, "uses asyncio.timeout")
    try:
        await raw.send({"event": "test:timed", "correlation_id": "t"})
        reply = await raw.read()
        assert reply["data"] == {"timed_out": True, "child": 7}
        assert seen["task_before_await"] is not None
        assert seen["task_before_await"] is seen["task_after_await"]
    finally:
        unregister()


async def test_context_variables_do_not_leak_between_requests(raw: Raw, daemon: Daemon) -> None:
    import contextvars

    marker: contextvars.ContextVar[str] = contextvars.ContextVar("marker", default="unset")

    async def mark(_data: NoData, _context: EventContext) -> dict[str, Any]:
        before = marker.get()
        marker.set("set-by-handler")
        return {"before": before}

    unregister = daemon.router.register("test:mark", mark, NoData, "sets a context variable")
    try:
        for _ in range(3):
            await raw.send({"event": "test:mark"})
            assert (await raw.read())["data"] == {"before": "unset"}
    finally:
        unregister()


async def test_cancelled_handler_replies_shutting_down(short_tmp: Path) -> None:
    started = asyncio.Event()

    async def forever(_data: NoData, _context: EventContext) -> dict[str, Any]:
        started.set()
        await asyncio.sleep(60)
        return {}

    async with running_daemon(short_tmp, shutdown_timeout=0.1) as daemon:
        daemon.router.register("test:forever", forever, NoData, "never ends")
        raw = await Raw.open(daemon)
        await raw.send({"event": "test:forever", "correlation_id": "f"})
        await asyncio.wait_for(started.wait(), REPLY_TIMEOUT)
        assert sum(len(conn.tasks) for conn in daemon.server.connections) == 1
        await daemon.server.drain(0.05)
        reply = await raw.read()
        assert (reply["correlation_id"], error_of(reply)["code"]) == ("f", "shutting_down")
        await raw.close()


def run_from_callback(coro: Any) -> asyncio.Future[Any]:
    """Start `coro` with Connection._start from a plain loop callback, as data_received does."""
    loop = asyncio.get_running_loop()
    outcome: asyncio.Future[Any] = loop.create_future()

    def callback() -> None:
        try:
            assert asyncio.current_task() is None
            outcome.set_result(Connection._start(coro))
        except BaseException as exc:  # surface it in the test instead of hanging
            outcome.set_exception(exc)

    loop.call_soon(callback)
    return asyncio.ensure_future(asyncio.wait_for(outcome, REPLY_TIMEOUT))


async def test_start_finishing_in_its_first_step_needs_no_task() -> None:
    seen = []

    async def quick() -> None:
        seen.append(asyncio.current_task())

    assert await run_from_callback(quick()) is None
    assert len(seen) == 1 and seen[0] is not None
    await asyncio.sleep(0)  # the task, already done, ends quietly
    assert seen[0].done() and seen[0].exception() is None


async def test_start_cancelled_before_the_task_ran() -> None:
    seen: list[Any] = []

    async def waits() -> None:
        seen.append(asyncio.current_task())
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    loop = asyncio.get_running_loop()
    outcome: asyncio.Future[Any] = loop.create_future()

    def callback() -> None:
        try:
            task = Connection._start(waits())
            assert task is not None
            task.cancel()  # before the task's own first step
            outcome.set_result(task)
        except BaseException as exc:
            outcome.set_exception(exc)

    loop.call_soon(callback)
    task = await asyncio.wait_for(outcome, REPLY_TIMEOUT)
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, REPLY_TIMEOUT)
    assert seen == [task, "cancelled"]


async def test_start_resumes_with_the_awaited_value() -> None:
    loop = asyncio.get_running_loop()
    future: asyncio.Future[int] = loop.create_future()

    async def waits() -> int:
        first = await future
        await asyncio.sleep(0)
        return first * 2

    task = await run_from_callback(waits())
    assert task is not None and not task.done()
    future.set_result(21)
    assert await asyncio.wait_for(task, REPLY_TIMEOUT) == 42


async def test_start_propagates_errors_after_the_first_step() -> None:
    async def fails() -> None:
        await asyncio.sleep(0)
        raise ValueError("boom")

    task = await run_from_callback(fails())
    with pytest.raises(ValueError):
        await asyncio.wait_for(task, REPLY_TIMEOUT)
