"""A request carrying a client-held history is refused for its files and images before anything is
written for the history (the imported conversation, a fork and the turns appended to it), on both
backends."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ksi_common.errors import ErrorCode, KsiError
from tests.conftest import complete, connected, running_daemon, stub_settings
from tests.stored import stored_snapshot
from tests.test_image_files import vision_models

pytestmark = pytest.mark.backends


def asking(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "and this?"}, *parts]}]


async def test_a_history_with_a_refused_file_or_image_writes_nothing(short_tmp: Path, stub: Any,
                                                                     backend: dict[str, Any]) -> None:
    root = short_tmp / "allowed"
    root.mkdir()
    (root / "fake.png").write_bytes(b"plain text, not an image")
    settings = stub_settings(stub, **vision_models(stub))
    async with running_daemon(short_tmp, allowed_file_roots=[root], max_image_bytes=4000, **settings, **backend) \
            as daemon, connected(daemon) as client:
        first = await complete(client, prompt="p1", model="openai/stub-vision")
        second = await complete(client, prompt="p2", conversation_id=first["conversation_id"])
        stored = [{"role": "user", "content": "p1"}, {"role": "assistant", "content": first["content"]},
                  {"role": "user", "content": "p2"}, {"role": "assistant", "content": second["content"]}]
        histories = {
            "matching nothing (an import)": [{"role": "user", "content": "elsewhere"},
                                             {"role": "assistant", "content": "a reply"}],
            "diverging at exchange 2 (a fork and an append)": [*stored[:3], {"role": "assistant", "content": "edited"}],
        }
        refusals: list[tuple[dict[str, Any], str]] = [
            ({"prompt": "read it", "files": ["/etc/hostname"]}, ErrorCode.PATH_NOT_ALLOWED),
            ({"input": asking({"type": "input_image", "path": "/etc/hostname"})}, ErrorCode.PATH_NOT_ALLOWED),
            ({"input": asking({"type": "input_image", "image_url": "data:image/png;base64," + "A" * 8000})},
             ErrorCode.IMAGE_TOO_LARGE),
            ({"input": asking({"type": "input_image", "path": str(root / "fake.png")})},
             ErrorCode.UNSUPPORTED_MEDIA_TYPE),
        ]
        before = await stored_snapshot(daemon.settings)
        for name, history in histories.items():
            for request, code in refusals:
                with pytest.raises(KsiError) as refused:
                    await client.request("completion:async", {**request, "model": "openai/stub-vision",
                                                              "history": history})
                assert refused.value.code == code, (name, request)
                assert await stored_snapshot(daemon.settings) == before, (name, request)
