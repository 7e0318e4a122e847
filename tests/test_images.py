"""Image parts: taken in from an https URL, a data URL or a path inside the allowed roots,
stored once by hash on every backend, refused with exact codes before anything is written,
rebuilt from storage after a restart, and counted by each provider's rule."""

from __future__ import annotations

import base64
import hashlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from ksi_common.errors import ErrorCode, KsiError
from ksi_common.items import message
from ksi_daemon.providers.abilities import refuse_unable
from ksi_daemon.providers.base import ModelAbilities
from ksi_daemon.providers.cli_provider import CLISessionProvider
from ksi_daemon.providers.litellm_provider import LiteLLMProvider
from ksi_daemon.services.completion.file_roots import FileRoots
from ksi_daemon.services.completion.image_headers import ImageFacts, image_facts
from ksi_daemon.services.completion.images import DataUrlCache, Images
from ksi_daemon.services.conversations.memory import Exchange
from ksi_daemon.storage.backends import build_storage
from ksi_daemon.storage.ports import Storage
from tests.conftest import make_settings
from tests.image_bytes import gif, jpeg, png, webp_extended, webp_lossless, webp_lossy

pytestmark = pytest.mark.backends


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


@pytest.fixture
def roots(short_tmp: Path) -> Path:
    root = short_tmp / "allowed"
    root.mkdir()
    return root


@asynccontextmanager
async def images_on(short_tmp: Path, roots: Path, backend: dict[str, Any],
                    max_bytes: int = 20 * 1024 * 1024) -> AsyncIterator[tuple[Images, Storage]]:
    storage = build_storage(make_settings(short_tmp, **backend))
    await storage.open()
    try:
        yield Images(storage.blobs, FileRoots([roots]), max_bytes), storage
    finally:
        await storage.close()


async def refused(images: Images, part: dict[str, Any]) -> KsiError:
    with pytest.raises(KsiError) as caught:
        await images.admit(part)
    return caught.value


async def test_the_same_image_is_stored_once_whichever_way_it_came(short_tmp: Path, roots: Path,
                                                                    backend: dict[str, Any]) -> None:
    image = png(40, 30)
    digest = hashlib.sha256(image).hexdigest()
    (roots / "cat.png").write_bytes(image)
    async with images_on(short_tmp, roots, backend) as (images, storage):
        by_data = await images.admit({"type": "input_image", "image_url": data_url(image), "detail": "high"})
        by_path = await images.admit({"type": "input_image", "path": str(roots / "cat.png")})
        by_file_path = await images.admit({"type": "input_image", "file_path": str(roots / "cat.png")})
        assert by_data == {"type": "input_image", "image": {
            "sha256": digest, "media_type": "image/png", "bytes": len(image), "width": 40, "height": 30,
            "detail": "high"}}
        assert by_path["image"] == {"sha256": digest, "media_type": "image/png", "bytes": len(image),
                                    "width": 40, "height": 30, "name": "cat.png"}
        assert by_file_path == by_path
        assert await storage.blobs.ids() == [digest]


async def test_an_https_image_is_kept_as_its_url_and_never_fetched(short_tmp: Path, roots: Path,
                                                                   backend: dict[str, Any]) -> None:
    url = "https://images.invalid/cat.png"  # .invalid never resolves: a fetch would fail the test
    async with images_on(short_tmp, roots, backend) as (images, storage):
        stored = await images.admit({"type": "input_image", "image_url": url, "detail": "low"})
        assert stored == {"type": "input_image", "image": {"url": url, "detail": "low"}}
        assert await images.chat_part(stored) == {"type": "image_url", "image_url": {"url": url, "detail": "low"}}
        assert await storage.blobs.ids() == []
        for bad in ("http://images.invalid/cat.png", "ftp://x/y.png", "https://x/a b.png", "https:///y.png",
                    "https://[::1/y.png"):
            error = await refused(images, {"type": "input_image", "image_url": bad})
            assert error.code == ErrorCode.VALIDATION_ERROR and "image.image_url" in error.details["fields"]


async def test_refused_images_leave_nothing_stored(short_tmp: Path, roots: Path, backend: dict[str, Any]) -> None:
    outside = short_tmp / "outside"
    outside.mkdir()
    (outside / "secret.png").write_bytes(png(8, 8))
    (roots / "link-out.png").symlink_to(outside / "secret.png")
    (roots / "notes.png").write_text("a text file named like an image")
    (roots / "big.png").write_bytes(png(400, 400, shade=3) + b"\0" * 2000)
    (roots / "dir.png").mkdir()
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"type": "input_image", "path": str(outside / "secret.png")}, ErrorCode.PATH_NOT_ALLOWED, ""),
        ({"type": "input_image", "path": str(roots / "link-out.png")}, ErrorCode.PATH_NOT_ALLOWED, ""),
        ({"type": "input_image", "path": "cat.png"}, ErrorCode.VALIDATION_ERROR, "image.path"),
        ({"type": "input_image", "path": str(roots / "missing.png")}, ErrorCode.VALIDATION_ERROR, "image.path"),
        ({"type": "input_image", "path": str(roots / "dir.png")}, ErrorCode.VALIDATION_ERROR, "image.path"),
        ({"type": "input_image", "path": str(roots / "notes.png")}, ErrorCode.UNSUPPORTED_MEDIA_TYPE, "image.path"),
        ({"type": "input_image", "path": str(roots / "big.png")}, ErrorCode.IMAGE_TOO_LARGE, "image.path"),
        ({"type": "input_image", "image_url": data_url(png(400, 400, shade=3) + b"\0" * 2000)},
         ErrorCode.IMAGE_TOO_LARGE, "image.image_url"),
        ({"type": "input_image", "image_url": data_url(b"plain words, no image")},
         ErrorCode.UNSUPPORTED_MEDIA_TYPE, "image.image_url"),
        ({"type": "input_image", "image_url": data_url(png(2, 2), "image/svg+xml")},
         ErrorCode.UNSUPPORTED_MEDIA_TYPE, "image.image_url"),
        ({"type": "input_image", "image_url": "data:image/png;base64,not*base64"},
         ErrorCode.VALIDATION_ERROR, "image.image_url"),
        ({"type": "input_image", "image_url": "data:image/png," + "x" * 10}, ErrorCode.VALIDATION_ERROR,
         "image.image_url"),
        ({"type": "input_image", "image_url": data_url(png(2, 2)), "detail": "huge"}, ErrorCode.VALIDATION_ERROR,
         "image.detail"),
        ({"type": "input_image", "image_url": data_url(png(2, 2)), "path": str(roots / "x.png")},
         ErrorCode.VALIDATION_ERROR, "image.image_url"),
        ({"type": "input_image", "file_id": "file-abc"}, ErrorCode.UNSUPPORTED_PARAMETER, "image.file_id"),
        ({"type": "input_text", "text": "hi"}, ErrorCode.VALIDATION_ERROR, "image.type"),
    ]
    async with images_on(short_tmp, roots, backend, max_bytes=2000) as (images, storage):
        for part, code, field in cases:
            error = await refused(images, part)
            assert error.code == code, (part, error)
            if field:
                assert field in error.details["fields"], (part, error.details)
        assert await storage.blobs.ids() == []
    assert [p for p in (short_tmp / "var").rglob("*") if "blobs" in p.parts and p.is_file()] == []


async def test_a_link_inside_the_roots_to_an_image_inside_them_is_read(short_tmp: Path, roots: Path,
                                                                      backend: dict[str, Any]) -> None:
    (roots / "real.gif").write_bytes(gif(7, 9))
    (roots / "alias.gif").symlink_to(roots / "real.gif")
    async with images_on(short_tmp, roots, backend) as (images, _storage):
        stored = await images.admit({"type": "input_image", "path": str(roots / "alias.gif")})
        assert stored["image"]["media_type"] == "image/gif" and stored["image"]["name"] == "alias.gif"


async def test_a_stored_image_comes_back_after_a_restart_though_the_clients_file_is_gone(
        short_tmp: Path, roots: Path, backend: dict[str, Any]) -> None:
    image = png(16, 16, shade=77)
    (roots / "shot.png").write_bytes(image)
    async with images_on(short_tmp, roots, backend) as (images, _storage):
        stored = await images.admit({"type": "input_image", "path": str(roots / "shot.png"), "detail": "auto"})
    (roots / "shot.png").unlink()
    async with images_on(short_tmp, roots, backend) as (images, _storage):
        part = await images.chat_part(stored)
    assert part == {"type": "image_url", "image_url": {"url": data_url(image), "detail": "auto"}}


async def test_an_image_missing_from_storage_is_sent_as_the_note_a_model_without_vision_gets(
        short_tmp: Path, roots: Path, backend: dict[str, Any]) -> None:
    async with images_on(short_tmp, roots, backend) as (images, storage):
        part = await images.chat_part({"type": "input_image", "image": {
            "sha256": "ab" * 32, "media_type": "image/png", "name": "lost.png"}})
        assert part == {"type": "text", "text": "[image lost.png] (its stored bytes are missing)"}
        assert await storage.blobs.ids() == []


def test_sizes_are_read_from_the_headers_of_every_format() -> None:
    assert image_facts(png(1024, 768)) == ImageFacts("image/png", 1024, 768)
    assert image_facts(jpeg(640, 480)) == ImageFacts("image/jpeg", 640, 480)
    assert image_facts(gif(300, 200)) == ImageFacts("image/gif", 300, 200)
    assert image_facts(webp_lossy(800, 600)) == ImageFacts("image/webp", 800, 600)
    assert image_facts(webp_lossless(5000, 3)) == ImageFacts("image/webp", 5000, 3)
    assert image_facts(webp_extended(16000, 9000)) == ImageFacts("image/webp", 16000, 9000)
    assert image_facts(png(10, 10)[:20]) is None  # a header cut short
    assert image_facts(b"\xff\xd8\xff\xda\x00\x02") is None  # scan data before any frame header
    assert image_facts(b"GIF89a") is None


def test_token_costs_follow_each_providers_rule() -> None:
    cost = Images.tokens
    # OpenAI's published examples: 1024x1024 is 4 tiles; 2048x4096 becomes 768x1536, 6 tiles
    assert cost({"width": 1024, "height": 1024}, "gpt-4o") == 765
    assert cost({"width": 2048, "height": 4096}, "openai/gpt-4o") == 1105
    assert cost({"width": 2048, "height": 4096, "detail": "low"}, "gpt-4o") == 85
    assert cost({"width": 100, "height": 100}, "ollama/llava") == 255  # small: one tile, never enlarged
    assert cost({"url": "https://x/y.png"}, "gpt-4o") == 1445  # size unknown: the rule's most
    # Anthropic: width x height / 750, the long edge at most 1568, at most 1600
    assert cost({"width": 1092, "height": 1092}, "anthropic/claude-sonnet-4-5") == 1590
    assert cost({"width": 200, "height": 200}, "claude-3-haiku-20240307") == 54
    assert cost({"width": 4000, "height": 4000}, "bedrock/anthropic.claude-3-5-sonnet") == 1600
    assert cost({"url": "https://x/y.png"}, "anthropic/claude-opus-4") == 1600


async def test_what_a_model_sees_comes_from_its_settings_then_litellm(short_tmp: Path) -> None:
    provider = LiteLLMProvider(make_settings(short_tmp, models={
        "openai/local-*": {"supports_vision": True}, "openai/gpt-4o": {"supports_vision": False}}))
    assert (await provider.abilities("openai/local-llava")).vision is True  # litellm does not know it
    assert (await provider.abilities("openai/gpt-4o")).vision is False  # declared over litellm's list
    assert (await provider.abilities("gpt-4o-mini")).vision is True  # litellm's model list
    assert (await provider.abilities("echo/demo")).vision is None


def test_a_model_known_not_to_see_images_is_refused_naming_the_fields() -> None:
    refuse_unable("openai/gpt-4o", ModelAbilities(vision=True), {}, False, ["files.0"])
    refuse_unable("ollama/new", ModelAbilities(), {}, False, ["files.0"])  # nobody knows: passed on
    refuse_unable("openai/gpt-3.5-turbo", ModelAbilities(vision=False), {}, False, [])  # no image: nothing to refuse
    with pytest.raises(KsiError) as caught:
        refuse_unable("openai/gpt-3.5-turbo", ModelAbilities(vision=False), {}, False, ["files.0", "files.2"])
    assert caught.value.code == ErrorCode.UNSUPPORTED_PARAMETER
    assert sorted(caught.value.details["fields"]) == ["files.0", "files.2"]


async def test_a_damaged_image_is_sent_as_a_note_and_a_later_turn_replays_without_failing(
        short_tmp: Path, roots: Path, backend: dict[str, Any]) -> None:
    image = png(12, 12, shade=5)
    async with images_on(short_tmp, roots, backend) as (images, storage):
        stored = await images.admit({"type": "input_image", "image_url": data_url(image)})
        digest = stored["image"]["sha256"]
        await damage(storage, short_tmp, digest)
    async with images_on(short_tmp, roots, backend) as (images, storage):
        history = [Exchange(input=[message("user", [{"type": "input_text", "text": "look"}, stored])],
                            output=[message("assistant", "a square")])]
        replayed = await images.replay(history, frozenset({"input_image"}))
        assert replayed[0].chat_messages()[0]["content"] == [
            {"type": "text", "text": "look"},
            {"type": "text", "text": f"[image sha256:{digest[:12]}] (its stored bytes are missing)"}]


async def damage(storage: Storage, short_tmp: Path, digest: str) -> None:
    """The stored bytes of `digest` changed behind the store's back (a disk fault, a hand edit)."""
    files = [p for p in (short_tmp / "var").rglob(digest) if p.is_file()]
    if files:
        files[0].write_bytes(b"not the image any more")
        return
    database = storage.blobs.database  # type: ignore[attr-defined]
    await database.run(lambda c: c.execute("UPDATE ksi_blobs SET data = $1 WHERE sha256 = $2",
                                           b"not the image any more", digest))


async def test_a_stored_image_is_sent_from_the_cache_once_encoded(short_tmp: Path, roots: Path,
                                                                  backend: dict[str, Any]) -> None:
    image = png(10, 10, shade=9)
    async with images_on(short_tmp, roots, backend) as (images, storage):
        stored = await images.admit({"type": "input_image", "image_url": data_url(image)})
        first = await images.chat_part(stored)
        await damage(storage, short_tmp, stored["image"]["sha256"])  # the store is not read again
        assert await images.chat_part(stored) == first == {"type": "image_url", "image_url": {"url": data_url(image)}}


def test_the_data_url_cache_drops_the_least_recently_used_past_its_size() -> None:
    cache = DataUrlCache(limit=10)
    cache.put("a", "1234")
    cache.put("b", "5678")
    assert cache.get("a") == "1234"  # a is now the most recently used
    cache.put("c", "90ab")
    assert (cache.get("a"), cache.get("b"), cache.get("c")) == ("1234", None, "90ab")
    assert cache.size == 8
    cache.put("huge", "x" * 11)  # larger than the whole cache: never kept
    assert cache.get("huge") is None and cache.size == 8


async def test_only_the_file_name_of_a_path_is_kept(short_tmp: Path, roots: Path, backend: dict[str, Any]) -> None:
    (roots / "deep" / "er").mkdir(parents=True)
    (roots / "deep" / "er" / "holiday.jpg").write_bytes(jpeg(5, 4))
    async with images_on(short_tmp, roots, backend) as (images, _storage):
        stored = await images.admit({"type": "input_image", "path": str(roots / "deep" / "er" / "holiday.jpg")})
        assert stored["image"]["name"] == "holiday.jpg"
        history = [Exchange(input=[message("user", [{"type": "input_text", "text": "see"}, stored])],
                            output=[message("assistant", "ok")])]
        note = (await images.replay(history, frozenset()))[0].chat_messages()[0]["content"]
        assert note == "see [image holiday.jpg]" and str(roots) not in note


class SwappingRoots(FileRoots):
    """Roots whose check is followed, before the file is opened, by a directory inside them being
    swapped for a link to a directory outside (the race a check-then-open leaves open)."""

    def __init__(self, roots: list[Path], inside: Path, outside: Path) -> None:
        super().__init__(roots)
        self.inside, self.outside = inside, outside

    def resolve(self, raw: str, field_name: str) -> Path:
        resolved = super().resolve(raw, field_name)
        self.inside.rename(self.inside.with_name("moved-away"))
        self.inside.symlink_to(self.outside, target_is_directory=True)
        return resolved


async def test_a_directory_swapped_for_a_link_after_the_check_does_not_let_a_file_outside_be_read(
        short_tmp: Path, roots: Path, backend: dict[str, Any]) -> None:
    outside = short_tmp / "outside"
    outside.mkdir()
    (outside / "secret.png").write_bytes(png(6, 6, shade=200))
    (roots / "album").mkdir()
    (roots / "album" / "secret.png").write_bytes(png(6, 6, shade=1))
    storage = build_storage(make_settings(short_tmp, **backend))
    await storage.open()
    try:
        images = Images(storage.blobs, SwappingRoots([roots], roots / "album", outside), 20 * 1024 * 1024)
        error = await refused(images, {"type": "input_image", "path": str(roots / "album" / "secret.png")})
        assert error.code == ErrorCode.PATH_NOT_ALLOWED
        assert await storage.blobs.ids() == []
    finally:
        await storage.close()


async def test_a_cli_is_refused_images_naming_the_fields(short_tmp: Path) -> None:
    abilities = await CLISessionProvider("claude", LiteLLMProvider(make_settings(short_tmp))).abilities("claude-cli/sonnet")
    assert abilities.vision is False  # a CLI session is sent text alone
    with pytest.raises(KsiError) as caught:
        refuse_unable("claude-cli/sonnet", abilities, {}, False, ["files.0", "files.2"])
    assert caught.value.code == ErrorCode.UNSUPPORTED_PARAMETER
    assert set(caught.value.details["fields"]) == {"files.0", "files.2"}
    assert "runs the claude CLI" in caught.value.message  # what it is, not a setting to change
    refuse_unable("claude-cli/sonnet", abilities, {}, False, [])  # no images: nothing to refuse
