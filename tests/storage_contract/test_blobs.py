"""The contract of `BlobStore`, on every backend: content stored once by its hash, read back
after a restart, an unknown or malformed hash answered with nothing."""

from __future__ import annotations

import hashlib

from ksi_daemon.storage.ports import BlobRef, Storage
from tests.storage_contract.conftest import Opener


async def test_content_is_stored_once_by_its_hash(storage: Storage, open_storage: Opener) -> None:
    data = b"\x89PNG not really an image"
    digest = hashlib.sha256(data).hexdigest()
    assert await storage.blobs.ids() == [] and not await storage.blobs.has(digest)
    first = await storage.blobs.put(data, "image/png")
    assert first == await storage.blobs.put(data, "image/png") == BlobRef(digest, "image/png", len(data))
    assert await storage.blobs.ids() == [digest]
    async with open_storage() as again:
        assert await again.blobs.get(digest) == data and await again.blobs.has(digest)
        assert await again.blobs.get("0" * 64) is None
        assert await again.blobs.get("../" + digest) is None and not await again.blobs.has("../" + digest)
