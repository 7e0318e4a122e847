"""An answer a retry cannot change says `x-should-retry: false`, so the official `openai` SDK (two
retries by default, seconds apart) gives its user the error at once: counted at the daemon."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from tests.conftest import running_http_daemon


async def test_a_missing_key_reaches_an_openai_sdk_user_without_retries(
        short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    async with running_http_daemon(short_tmp) as http:
        client = openai.AsyncOpenAI(base_url=f"{http.base_url}/v1", api_key=http.token)  # its default retries
        assert client.max_retries == 2
        with pytest.raises(openai.APIStatusError) as caught:
            await client.chat.completions.create(model="openai/gpt-4o", messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(openai.APIStatusError) as again:
            await client.responses.create(model="openai/gpt-4o", input="hi")
        await client.close()
        asked = sorted(http.daemon.layout.responses_dir.glob("*.jsonl"))  # one file per request the daemon took
    for error in (caught.value, again.value):
        assert error.status_code == 503
        assert error.response.headers["x-should-retry"] == "false"
        assert error.code == "api_key_missing"  # type: ignore[attr-defined]
    assert len(asked) == 2, asked


async def test_a_retryable_answer_does_not_say_so(short_tmp: Path) -> None:
    async with running_http_daemon(short_tmp) as http:
        client = openai.AsyncOpenAI(base_url=f"{http.base_url}/v1", api_key=http.token, max_retries=0)
        with pytest.raises(openai.NotFoundError) as caught:
            await client.responses.retrieve("resp_echo-default-000000000000")
        await client.close()
    assert "x-should-retry" not in caught.value.response.headers
