"""The blob store on every backend: content stored once by its hash, kept across a restart,
never written or read through a symbolic link, a damaged blob refused, copied by a migration."""

from __future__ import annotations

import hashlib
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from ksi_common.errors import ErrorCode, KsiError
from ksi_daemon.storage.backends import build_storage
from ksi_daemon.storage.migrate import migrate
from ksi_daemon.storage.models import ConversationMeta
from ksi_daemon.storage.ports import BlobRef, Storage
from tests.conftest import make_settings
from tests.image_bytes import png

pytestmark = pytest.mark.backends


@asynccontextmanager
async def opened(root: Path, **backend: Any) -> AsyncIterator[Storage]:
    storage = build_storage(make_settings(root, **backend))
    await storage.open()
    try:
        yield storage
    finally:
        await storage.close()


async def test_the_same_content_is_stored_once_and_kept_across_a_restart(short_tmp: Path,
                                                                          backend: dict[str, Any]) -> None:
    image = png(3, 2)
    digest = hashlib.sha256(image).hexdigest()
    async with opened(short_tmp, **backend) as storage:
        assert await storage.blobs.ids() == [] and not await storage.blobs.has(digest)
        first = await storage.blobs.put(image, "image/png")
        again = await storage.blobs.put(image, "image/png")
        other = await storage.blobs.put(png(3, 2, shade=9), "image/png")
        assert first == again == BlobRef(digest, "image/png", len(image))
        assert first.to_record() == {"sha256": digest, "media_type": "image/png", "bytes": len(image)}
        assert await storage.blobs.ids() == sorted([digest, other.sha256])
        assert await storage.blobs.has(digest)
        if not backend:  # one file per content, under its hash
            files = [p for p in (short_tmp / "var" / "blobs").rglob("*") if p.is_file()]
            assert sorted(p.name for p in files) == sorted([digest, other.sha256])
            assert (short_tmp / "var" / "blobs" / "sha256" / digest[:2] / digest).read_bytes() == image
    async with opened(short_tmp, **backend) as storage:
        assert await storage.blobs.get(digest) == image
        assert await storage.blobs.get("0" * 64) is None
        assert await storage.blobs.get("../../state/http_token") is None  # not a hash: never a path
        assert not await storage.blobs.has("../" + digest)


async def test_damaged_bytes_are_refused_not_returned(short_tmp: Path, backend: dict[str, Any]) -> None:
    image = png(4, 4)
    async with opened(short_tmp, **backend) as storage:
        ref = await storage.blobs.put(image, "image/png")
        if backend:
            await storage.database.run(lambda c: c.execute(  # type: ignore[attr-defined]
                "UPDATE ksi_blobs SET data = $1 WHERE sha256 = $2", image[:-1] + b"!", ref.sha256))
        else:
            path = short_tmp / "var" / "blobs" / "sha256" / ref.sha256[:2] / ref.sha256
            path.write_bytes(image[:-1] + b"!")
        with pytest.raises(KsiError) as refused:
            await storage.blobs.get(ref.sha256)
        assert refused.value.code == ErrorCode.STORAGE_ERROR


async def test_a_link_at_a_blob_or_its_directory_is_never_followed(short_tmp: Path) -> None:
    image = png(2, 2)
    digest = hashlib.sha256(image).hexdigest()
    elsewhere = short_tmp / "elsewhere"
    elsewhere.mkdir()
    target = elsewhere / "victim"
    target.write_bytes(b"not yours")
    async with opened(short_tmp) as storage:
        fan_out = short_tmp / "var" / "blobs" / "sha256" / digest[:2]
        fan_out.mkdir(parents=True)
        (fan_out / digest).symlink_to(target)
        for attempt in (storage.blobs.put(image, "image/png"), storage.blobs.get(digest)):
            with pytest.raises(KsiError) as refused:
                await attempt
            assert refused.value.code == ErrorCode.STORAGE_SYMLINK
        assert target.read_bytes() == b"not yours"

        (fan_out / digest).unlink()
        fan_out.rmdir()
        fan_out.symlink_to(elsewhere)  # the directory itself
        with pytest.raises(KsiError) as refused:
            await storage.blobs.put(image, "image/png")
        assert refused.value.code == ErrorCode.STORAGE_SYMLINK
        assert sorted(os.listdir(elsewhere)) == ["victim"]  # nothing written through it
        assert await storage.blobs.ids() == []


async def test_a_migration_copies_the_blobs_once(short_tmp: Path, pg_url: str) -> None:
    images = [png(2, 2), png(5, 1)]
    async with opened(short_tmp / "a") as source, opened(short_tmp / "b", storage="postgres",
                                                         database_url=pg_url) as destination:
        refs = [await source.blobs.put(image, "image/png") for image in images]
        tally = await migrate(source, destination)
        assert tally.verified and tally.copied["blobs"] == 2
        assert tally.source["blobs"] == tally.destination["blobs"] == 2
        for ref, image in zip(refs, images, strict=True):
            assert await destination.blobs.get(ref.sha256) == image
        again = await migrate(source, destination)
        assert "blobs" not in again.copied


async def test_putting_the_same_content_again_repairs_a_damaged_blob(short_tmp: Path, backend: dict[str, Any]) -> None:
    image = png(4, 4, shade=8)
    damaged = image[:-1] + b"!"  # the same length: only the bytes tell
    async with opened(short_tmp, **backend) as storage:
        ref = await storage.blobs.put(image, "image/png")
        if backend:
            await storage.database.run(lambda c: c.execute(  # type: ignore[attr-defined]
                "UPDATE ksi_blobs SET data = $1 WHERE sha256 = $2", damaged, ref.sha256))
        else:
            (short_tmp / "var" / "blobs" / "sha256" / ref.sha256[:2] / ref.sha256).write_bytes(damaged)
        assert await storage.blobs.put(image, "image/png") == ref
        assert await storage.blobs.get(ref.sha256) == image
        if not backend:  # replaced whole: no file written aside is left
            assert [p.name for p in (short_tmp / "var" / "blobs" / "sha256" / ref.sha256[:2]).iterdir()] == [
                ref.sha256]


async def test_a_migration_copies_blobs_first_and_goes_on_past_a_damaged_one(short_tmp: Path, pg_url: str) -> None:
    good, bad = png(2, 3), png(3, 2)
    seen: list[str] = []
    async with opened(short_tmp / "a") as source, opened(short_tmp / "b", storage="postgres",
                                                         database_url=pg_url) as destination:
        kept = await source.blobs.put(good, "image/png")
        broken = await source.blobs.put(bad, "image/png")
        (short_tmp / "a" / "var" / "blobs" / "sha256" / broken.sha256[:2] / broken.sha256).write_bytes(b"cut")
        await source.conversations.create(ConversationMeta(conversation_id="talk"))
        tally = await migrate(source, destination, lambda kind, _n: seen.append(kind))
        assert sorted(seen[:2]) == ["blobs", "damaged_blobs"] and seen[2] == "conversations"  # blobs first
        assert tally.copied["damaged_blobs"] == 1 and tally.copied["conversations"] == 1  # went on after it
        assert tally.mismatches() == {"blobs": (2, 1)} and not tally.verified
        assert await destination.blobs.get(kept.sha256) == good
        assert not await destination.blobs.has(broken.sha256)
