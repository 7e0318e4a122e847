"""An image among a request's `files` goes to a vision model as an image part (through the socket,
real litellm, the stub as the provider): read once, stored by its hash, named by reference in the
record, counted by the provider's rule, never read from the client's path again; refused before
anything is written when the model does not see images or the image is too large."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import threading
from pathlib import Path
from typing import Any

import orjson
import pytest

from ksi_common.doctor import check
from ksi_common.errors import ErrorCode, KsiError
from ksi_daemon.services.completion.attachments import HEADER
from ksi_daemon.services.completion.file_roots import FileRoots
from tests.conftest import complete, connected, running_daemon, stub_settings
from tests.image_bytes import jpeg, png


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]


def data_url(data: bytes, media_type: str) -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def vision_models(stub: Any) -> dict[str, Any]:
    return {"models": {"openai/stub-vision": {"api_base": stub.api_base, "supports_vision": True},
                       "openai/stub-text": {"api_base": stub.api_base, "supports_vision": False}}}


def blob_files(var: Path) -> list[Path]:
    return sorted(p for p in (var / "blobs").rglob("*") if p.is_file()) if (var / "blobs").exists() else []


@pytest.fixture
def files_root(short_tmp: Path) -> Path:
    root = short_tmp / "allowed"
    root.mkdir()
    return root


async def test_an_image_file_reaches_a_vision_model_as_an_image_part_stored_once(
        short_tmp: Path, files_root: Path, stub: Any) -> None:
    stub.answer = lambda _messages: "a chart"  # the default answer would echo the image back
    image = png(1024, 1024)
    digest = hashlib.sha256(image).hexdigest()
    chart, notes = files_root / "chart.png", files_root / "notes.txt"
    chart.write_bytes(image)
    notes.write_text("the notes say hello")
    async with running_daemon(short_tmp, allowed_file_roots=[files_root],
                              **stub_settings(stub, **vision_models(stub))) as daemon, connected(daemon) as client:
        first = await complete(client, prompt="what is in it?", files=[str(chart), str(notes)],
                               model="openai/stub-vision", conversation_id="pic", create=True)
        sent = stub.messages()[-1]
        assert sent["role"] == "user"
        text, picture = sent["content"]
        assert text["type"] == "text" and text["text"].startswith(HEADER)
        assert "the notes say hello" in text["text"] and text["text"].endswith("what is in it?")
        assert str(chart) not in text["text"]  # the image is no text file
        assert picture == {"type": "image_url", "image_url": {"url": data_url(image, "image/png")}}

        # the record names the image by reference and the text file by path; no bytes in it
        record_path = daemon.layout.response_file(first["response_id"])
        user = read_jsonl(record_path)[0]
        assert user["content"] == "what is in it?"
        assert user["parts"] == [
            {"type": "input_text", "text": "what is in it?"},
            {"type": "input_image", "image": {"sha256": digest, "media_type": "image/png", "bytes": len(image),
                                              "width": 1024, "height": 1024, "name": "chart.png"}}]
        assert [f["path"] for f in user["files"]] == [str(notes)]
        assert base64.b64encode(image)[:200] not in record_path.read_bytes()
        assert [p.name for p in blob_files(daemon.layout.root)] == [digest]
        assert blob_files(daemon.layout.root)[0].read_bytes() == image

        # the image counts as OpenAI's rule says: 765 tokens for 1024x1024, beside the same text alone
        await complete(client, prompt="what is in it?", model="openai/stub-vision", conversation_id="plain",
                       create=True)
        with_image = read_jsonl(daemon.layout.index_file("pic"))[0]["tokens_in"]
        without = read_jsonl(daemon.layout.index_file("plain"))[0]["tokens_in"]
        assert with_image - without == 765

    # a later turn, after a restart, sends the image again from storage: the client's file is gone
    chart.unlink()
    async with running_daemon(short_tmp, allowed_file_roots=[files_root],
                              **stub_settings(stub, **vision_models(stub))) as daemon, connected(daemon) as client:
        await complete(client, prompt="and now?", conversation_id="pic")
        history, reply, new = stub.messages()
        assert history["content"] == [{"type": "text", "text": "what is in it?"},
                                      {"type": "image_url", "image_url": {"url": data_url(image, "image/png")}}]
        assert reply == {"role": "assistant", "content": "a chart"}
        assert "the notes say hello" in new["content"] and "missing" not in new["content"]

        # a model known not to see images is sent a note naming the image instead
        await complete(client, prompt="in words?", conversation_id="pic", model="openai/stub-text")
        assert stub.messages()[0]["content"] == "what is in it? [image chart.png]"  # never the client's path

        # the same image again, from another file in another conversation: still one blob
        copy = files_root / "copy.png"
        copy.write_bytes(image)
        await complete(client, prompt="same picture", files=[str(copy)], model="openai/stub-vision")
        assert stub.messages()[-1]["content"][1]["image_url"]["url"] == data_url(image, "image/png")
        assert [p.name for p in blob_files(daemon.layout.root)] == [digest]

        # a JPEG goes as a JPEG
        photo = files_root / "photo.jpg"
        photo.write_bytes(jpeg(640, 480))
        await complete(client, prompt="a photo", files=[str(photo)], model="openai/stub-vision")
        assert stub.messages()[-1]["content"][1]["image_url"]["url"] == data_url(jpeg(640, 480), "image/jpeg")


async def test_images_refused_before_anything_is_written(short_tmp: Path, files_root: Path, stub: Any) -> None:
    small, big = files_root / "small.png", files_root / "big.png"
    small.write_bytes(png(8, 8))
    (files_root / "notes.txt").write_text("plain notes")
    big.write_bytes(png(500, 500, shade=1) + b"\0" * 5000)
    async with running_daemon(short_tmp, allowed_file_roots=[files_root], max_image_bytes=4000,
                              **stub_settings(stub, **vision_models(stub))) as daemon, connected(daemon) as client:
        await client.request("consortium:save", {"name": "pair", "members": ["openai/stub-vision:2"],
                                                 "arbiter": "openai/stub-vision"})
        consortium_files = sorted(p for p in daemon.layout.root.rglob("*") if p.is_file())
        cases = [
            ({"model": "openai/stub-text", "files": [str(small)]}, ErrorCode.UNSUPPORTED_PARAMETER, "files.0"),
            # a consortium's members are not checked for vision, and its traces hold text only
            ({"model": "consortium/pair", "files": [str(small)]}, ErrorCode.UNSUPPORTED_PARAMETER, "files.0"),
            ({"consortium": {"members": ["openai/stub-vision:2"], "arbiter": "openai/stub-vision"},
              "files": [str(files_root / "notes.txt"), str(small)]}, ErrorCode.UNSUPPORTED_PARAMETER, "files.1"),
            ({"model": "openai/stub-vision", "files": [str(small), str(big)]}, ErrorCode.IMAGE_TOO_LARGE, "files.1"),
            ({"model": "openai/stub-vision", "files": [str(small), str(files_root / "gone.txt")]},
             ErrorCode.VALIDATION_ERROR, "files.1"),  # its place in the list the client sent
        ]
        for request, code, field in cases:
            with pytest.raises(KsiError) as refused:
                await client.request("completion:async", {"prompt": "look", **request})
            assert refused.value.code == code, refused.value
            assert field in refused.value.details["fields"]
        assert sorted(p for p in daemon.layout.root.rglob("*") if p.is_file()) == consortium_files
        assert stub.requests == []
        # a conversation that exists is not touched either
        await complete(client, prompt="hello", model="openai/stub-text", conversation_id="kept", create=True)
        before = daemon.layout.index_file("kept").read_bytes()
        with pytest.raises(KsiError) as refused:
            await client.request("completion:async", {"prompt": "look", "files": [str(small)],
                                                      "conversation_id": "kept"})
        assert refused.value.code == ErrorCode.UNSUPPORTED_PARAMETER
        listed = await client.request("conversation:list", {})
        assert [c["conversation_id"] for c in listed["conversations"]] == ["kept"]
        assert daemon.layout.index_file("kept").read_bytes() == before
        assert blob_files(daemon.layout.root) == []
        assert len(stub.requests) == 1


async def test_a_deleted_conversations_image_stays_and_doctor_names_it(short_tmp: Path, files_root: Path,
                                                                       stub: Any) -> None:
    image = png(20, 10)
    (files_root / "a.png").write_bytes(image)
    async with running_daemon(short_tmp, allowed_file_roots=[files_root],
                              **stub_settings(stub, **vision_models(stub))) as daemon, connected(daemon) as client:
        await complete(client, prompt="one", files=[str(files_root / "a.png")], model="openai/stub-vision",
                       conversation_id="one", create=True)
        await complete(client, prompt="two", files=[str(files_root / "a.png")], model="openai/stub-vision",
                       conversation_id="two", create=True)
        var = daemon.layout.root
        assert [o for o in check(var).orphans if o.kind == "unreferenced_blob"] == []
        await client.request("conversation:delete", {"conversation_id": "one"})
        assert [o for o in check(var).orphans if o.kind == "unreferenced_blob"] == []  # "two" still names it
        await client.request("conversation:delete", {"conversation_id": "two"})
    report = check(var)
    assert [(o.kind, o.extra) for o in report.orphans] == [
        ("unreferenced_blob", {"sha256": hashlib.sha256(image).hexdigest()})]
    assert report.ok and report.counts["blobs"] == 1


@pytest.mark.backends
async def test_a_later_turn_sends_the_stored_image_again_on_every_backend(short_tmp: Path, files_root: Path,
                                                                          stub: Any, backend: dict[str, Any]) -> None:
    stub.answer = lambda _messages: "seen"
    image = png(64, 48, shade=5)
    shot = files_root / "shot.png"
    shot.write_bytes(image)
    settings = {"allowed_file_roots": [files_root], **stub_settings(stub, **vision_models(stub)), **backend}
    async with running_daemon(short_tmp, **settings) as daemon, connected(daemon) as client:
        await complete(client, prompt="look", files=[str(shot)], model="openai/stub-vision",
                       conversation_id="shots", create=True)
    shot.unlink()
    async with running_daemon(short_tmp, **settings) as daemon, connected(daemon) as client:
        await complete(client, prompt="again", conversation_id="shots")
    first, _reply, _new = stub.messages()
    assert first["content"][1] == {"type": "image_url", "image_url": {"url": data_url(image, "image/png")}}


class GatedRoots(FileRoots):
    """Roots whose first check waits for the test (in the worker thread that reads the image):
    what the daemon does meanwhile can be arranged before the admission goes on."""

    def __init__(self, roots: list[Path]) -> None:
        super().__init__(roots)
        self.reached, self.go = threading.Event(), threading.Event()

    def resolve(self, raw: str, field_name: str) -> Path:
        self.reached.set()
        self.go.wait(30)
        return super().resolve(raw, field_name)


async def test_a_request_refused_as_overloaded_after_its_image_was_read_stores_nothing(
        short_tmp: Path, files_root: Path, stub: Any) -> None:
    (files_root / "late.png").write_bytes(png(9, 9, shade=4))
    stub.model_gate["stub-text"] = held = asyncio.Event()
    settings = stub_settings(stub, max_queued=2, max_concurrency=1, allowed_file_roots=[files_root],
                             **vision_models(stub))
    async with running_daemon(short_tmp, **settings) as daemon, connected(daemon) as client, \
            connected(daemon) as other:
        gated = daemon.completion.images.roots = GatedRoots([files_root])
        late = asyncio.create_task(other.send_frame("completion:async", {
            "prompt": "look", "files": [str(files_root / "late.png")], "model": "openai/stub-vision"}))
        assert await asyncio.to_thread(gated.reached.wait, 30)
        accepted = []
        for n in range(4):  # requests the stub holds, until the queue is full
            full = await client.send_frame("completion:async", {"prompt": f"p{n}", "model": "openai/stub-text",
                                                                "conversation_id": f"c{n}", "create": True})
            if "error" in full:
                break
            accepted.append(full["data"]["request_id"])
        assert full["error"]["code"] == ErrorCode.OVERLOADED
        gated.go.set()
        frame = await late
        held.set()
        for request_id in accepted:  # each held one finishes: none is cut off by the daemon's stop
            await client.request("completion:wait", {"request_id": request_id, "timeout": 30})
    assert frame["error"]["code"] == ErrorCode.OVERLOADED
    assert blob_files(short_tmp / "var") == []


async def test_a_lost_blob_is_named_by_doctor_and_later_turns_go_on_with_a_note(short_tmp: Path, files_root: Path,
                                                                                stub: Any) -> None:
    stub.answer = lambda _messages: "seen"
    image = png(30, 20, shade=6)
    digest = hashlib.sha256(image).hexdigest()
    (files_root / "lost.png").write_bytes(image)
    settings = {"allowed_file_roots": [files_root], **stub_settings(stub, **vision_models(stub))}
    async with running_daemon(short_tmp, **settings) as daemon, connected(daemon) as client:
        first = await complete(client, prompt="look", files=[str(files_root / "lost.png")],
                               model="openai/stub-vision", conversation_id="lost", create=True)
        var, record = daemon.layout.root, daemon.layout.response_file(first["response_id"])
    assert [p.kind for p in check(var).problems] == []
    (blob,) = blob_files(var)
    blob.unlink()  # the records copied to another machine without the blob store, say
    report = check(var)
    assert [(p.kind, p.path, p.extra["sha256"]) for p in report.problems] == [("missing_blob", str(record), digest)]
    assert not report.ok
    async with running_daemon(short_tmp, **settings) as daemon, connected(daemon) as client:
        again = await complete(client, prompt="and now?", conversation_id="lost")
    assert again["content"] == "seen"
    assert stub.messages()[0]["content"] == [
        {"type": "text", "text": "look"}, {"type": "text", "text": "[image lost.png] (its stored bytes are missing)"}]
