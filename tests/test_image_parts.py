"""Image parts in `input` items (a data URL, an https URL, a path inside the allowed roots) reach a
vision model through the socket, real litellm and the stub; stored by hash, named by reference in
the record, sent again from storage on later turns; refused before anything is written where they
cannot go."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest

from ksi_common.errors import ErrorCode, KsiError
from tests.conftest import complete, connected, running_daemon, stub_settings
from tests.image_bytes import png
from tests.stored import stored_snapshot
from tests.test_image_files import blob_files, data_url, read_jsonl, vision_models


def asking(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "what is this?"}, *parts]}]


async def test_image_parts_reach_a_vision_model_and_come_back_from_storage(short_tmp: Path, stub: Any) -> None:
    stub.answer = lambda _messages: "a square"
    image = png(64, 64)
    root = short_tmp / "allowed"
    root.mkdir()
    (root / "square.png").write_bytes(image)
    async with running_daemon(short_tmp, allowed_file_roots=[root], **stub_settings(stub, **vision_models(stub))) \
            as daemon, connected(daemon) as client:
        first = await complete(client, model="openai/stub-vision", conversation_id="pic", create=True,
                               input=asking({"type": "input_image", "image_url": data_url(image, "image/png")},
                                            {"type": "input_image", "image_url": "https://example.org/cat.png"}))
        sent = stub.messages()[-1]["content"]
        assert sent == [{"type": "text", "text": "what is this?"},
                        {"type": "image_url", "image_url": {"url": data_url(image, "image/png")}},
                        {"type": "image_url", "image_url": {"url": "https://example.org/cat.png"}}]
        user = read_jsonl(daemon.layout.response_file(first["response_id"]))[0]
        assert user["content"] == "what is this?"
        assert user["parts"][1]["image"]["sha256"] == hashlib.sha256(image).hexdigest()
        assert user["parts"][2]["image"] == {"url": "https://example.org/cat.png"}
        assert b"base64" not in daemon.layout.response_file(first["response_id"]).read_bytes()
        # the same bytes by path: stored once; a later turn sends the first image again from storage
        await complete(client, conversation_id="pic",
                       input=asking({"type": "input_image", "path": str(root / "square.png")}))
        history_user = stub.messages()[0]["content"]
        assert history_user[1] == {"type": "image_url", "image_url": {"url": data_url(image, "image/png")}}
        assert [p.name for p in blob_files(daemon.layout.root)] == [hashlib.sha256(image).hexdigest()]


@pytest.mark.parametrize("model, part, code, field", [
    ("openai/stub-text", {"type": "input_image", "image_url": "https://example.org/cat.png"},
     ErrorCode.UNSUPPORTED_PARAMETER, "input.0.content.1"),
    ("openai/stub-vision", {"type": "input_image", "path": "/etc/hostname"}, ErrorCode.PATH_NOT_ALLOWED, None),
    ("openai/stub-vision", {"type": "input_image", "image_url": "http://example.org/cat.png"},
     ErrorCode.VALIDATION_ERROR, None),
    ("openai/stub-vision", {"type": "input_image", "image_url": "data:image/png;base64," + "A" * 8000},
     ErrorCode.IMAGE_TOO_LARGE, None),
    ("openai/stub-vision", {"type": "input_file", "file_data": "abc"}, ErrorCode.UNSUPPORTED_PARAMETER, None),
    ("openai/stub-vision", {"type": "input_file", "file_data": "data:application/pdf;base64,@@@@"},
     ErrorCode.VALIDATION_ERROR, "input.0.content.1.file_data"),
    ("openai/stub-vision", {"type": "input_file", "file_data": "data:application/pdf;base64,aGVsbG8="},
     ErrorCode.VALIDATION_ERROR, "input.0.content.1.file_data"),  # "hello": not a PDF
    ("openai/stub-vision", {"type": "input_file", "file_data": "data:application/pdf;base64," + "A" * 8000},
     ErrorCode.IMAGE_TOO_LARGE, "input.0.content.1.file_data"),
])
async def test_refused_image_parts_write_nothing(short_tmp: Path, stub: Any, model: str, part: dict[str, Any],
                                                 code: str, field: str | None) -> None:
    async with running_daemon(short_tmp, max_image_bytes=4000, **stub_settings(stub, **vision_models(stub))) \
            as daemon, connected(daemon) as client:
        await complete(client, model="openai/stub-vision", conversation_id="kept", create=True, prompt="hello")
        before = await stored_snapshot(daemon.settings)
        calls = len(stub.requests)
        with pytest.raises(KsiError) as refused:
            await client.request("completion:async", {"model": model, "conversation_id": "kept",
                                                      "input": asking(part)})
        assert refused.value.code == code
        if field is not None:
            assert field in refused.value.details["fields"]
        assert await stored_snapshot(daemon.settings) == before
        assert len(stub.requests) == calls and not blob_files(daemon.layout.root)
