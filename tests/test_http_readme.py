"""The HTTP flow of docs/http.md: the official SDK chains by previous_response_id and streams with the
echo model, then `ksi ask --conversation` (a real process) continues the same conversation."""

from __future__ import annotations

import asyncio
import sys

import openai

from tests.conftest import HttpDaemon
from tests.test_cli import clean_env


async def test_sdk_chain_stream_then_ksi_ask_continues(http_daemon: HttpDaemon) -> None:
    async with openai.AsyncOpenAI(base_url=f"{http_daemon.base_url}/v1", api_key=http_daemon.token,
                                  max_retries=0) as client:
        first = await client.responses.create(model="echo/demo", input="My name is Alice")
        second = await client.responses.create(input="What is my name?", previous_response_id=first.id)
        assert "Earlier user inputs: My name is Alice" in second.output_text
        deltas = []
        async with client.responses.stream(model="echo/demo", input="Tell me more",
                                           previous_response_id=second.id) as stream:
            async for event in stream:
                if event.type == "response.output_text.delta":
                    deltas.append(event.delta)
            final = await stream.get_final_response()
    assert "".join(deltas) == final.output_text
    assert final.conversation is not None and first.conversation is not None
    conversation_id = final.conversation.id
    assert conversation_id == first.conversation.id
    settings = http_daemon.daemon.settings
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "ksi_cli", "ask", "--socket", str(settings.socket), "--var-dir", str(settings.var_dir),
        "--conversation", conversation_id, "And what did I ask first?",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=clean_env())
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, err.decode()
    assert "Earlier user inputs: My name is Alice | What is my name? | Tell me more" in out.decode()
