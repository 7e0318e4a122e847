"""Content-addressed bytes in PostgreSQL, one row per content; the `BlobStore` port."""

from __future__ import annotations

import asyncio
import hashlib

from ksi_common.blob_files import SHA256
from ksi_daemon.storage.ports import BlobRef, damaged_blob
from ksi_daemon.storage.postgres.database import Database


class PostgresBlobs:
    def __init__(self, database: Database) -> None:
        self.database = database

    async def put(self, data: bytes, media_type: str) -> BlobRef:
        digest = await asyncio.to_thread(_sha256, data)  # megabytes of hashing, off the event loop
        # safe to repeat: a retry, or another daemon storing the same content, keeps the first row;
        # a row whose bytes no longer have their hash (damaged) is written again whole
        await self.database.run(lambda c: c.execute(
            "INSERT INTO ksi_blobs (sha256, size, data) VALUES ($1, $2, $3) ON CONFLICT (sha256) DO UPDATE "
            "SET size = EXCLUDED.size, data = EXCLUDED.data "
            "WHERE encode(sha256(ksi_blobs.data), 'hex') <> ksi_blobs.sha256",
            digest, len(data), data))
        return BlobRef(digest, media_type, len(data))

    async def get(self, sha256: str) -> bytes | None:
        if not SHA256.match(sha256):
            return None
        data = await self.database.run(lambda c: c.fetchval("SELECT data FROM ksi_blobs WHERE sha256 = $1", sha256))
        if data is None:
            return None
        if await asyncio.to_thread(_sha256, data) != sha256:
            raise damaged_blob(sha256, "ksi_blobs")
        return bytes(data)

    async def has(self, sha256: str) -> bool:
        if not SHA256.match(sha256):
            return False
        found = await self.database.run(lambda c: c.fetchval("SELECT 1 FROM ksi_blobs WHERE sha256 = $1", sha256))
        return found is not None

    async def ids(self) -> list[str]:
        rows = await self.database.run(lambda c: c.fetch("SELECT sha256 FROM ksi_blobs ORDER BY 1"))
        return [r[0] for r in rows]


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
