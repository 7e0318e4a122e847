"""What the daemon keeps of a finished request: enough for completion:wait and completion:status,
never the job, task, context and input it ran with (thousands are kept; a garbage collection
walks every object each of them holds)."""

from __future__ import annotations

import asyncio
import gc
import weakref
from pathlib import Path
from typing import Any

from tests.conftest import complete, connected, running_daemon, stub_settings


async def test_a_finished_request_answers_but_keeps_nothing_it_ran_with(short_tmp: Path, stub: Any) -> None:
    async with running_daemon(short_tmp, **stub_settings(stub), finished_requests_kept=2) as daemon, \
            connected(daemon) as client:
        # litellm loaded first: what is alive when it loads is frozen out of garbage collection
        await complete(client, prompt="warm up", conversation_id="w", create=True)
        stub.hold = 0.3  # still running when the ack arrives
        ack = await client.request("completion:async", {"prompt": "hello", "conversation_id": "c", "create": True})
        running = weakref.ref(daemon.completion.requests.get(ack["request_id"]))
        result = await client.request("completion:wait", {"request_id": ack["request_id"], "timeout": 30})
        for _ in range(50):  # the request's task ends an instant after the reply
            gc.collect()
            if running() is None:
                break
            await asyncio.sleep(0.02)
        assert running() is None  # the request's state, job, task and context are gone
        status = await client.request("completion:status", {"request_id": ack["request_id"]})
        assert (status["status"], status["response_id"], status["model"]) == ("done", result["response_id"],
                                                                               "openai/stub-model")
        again = await client.request("completion:wait", {"request_id": ack["request_id"], "timeout": 0})
        assert again == result
        stub.hold = 0.0
        for prompt in ("two", "three"):  # only the last two finished requests are kept
            done = await client.request("completion:async", {"prompt": prompt, "conversation_id": "c"})
            await client.request("completion:wait", {"request_id": done["request_id"], "timeout": 30})
        gone = await client.send_frame("completion:status", {"request_id": ack["request_id"]})
        assert gone["error"]["code"] == "request_not_found"
