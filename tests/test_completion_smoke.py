from typing import Any

from ksi_common.client import KsiClient
from ksi_daemon.daemon import Daemon
from tests.conftest import complete, connected


async def test_stub_sees_history_in_order(stub_daemon: Daemon, stub: Any) -> None:
    async with connected(stub_daemon) as client:
        first = await complete(client, prompt="My name is Alice and I am a dentist")
        await complete(client, prompt="What is my name?", conversation_id=first["conversation_id"])
    roles = [m["role"] for m in stub.messages()]
    assert roles == ["user", "assistant", "user"]
    assert stub.messages()[0]["content"] == "My name is Alice and I am a dentist"
    assert stub.messages()[1]["content"] == first["content"]
