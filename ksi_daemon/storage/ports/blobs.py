"""The blob store's port: content-addressed bytes (images), each stored once by its sha256."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from ksi_common.errors import ErrorCode, KsiError


@dataclass(frozen=True, slots=True)
class BlobRef:
    """Bytes a blob store holds: their sha256 (the key), their length, and the media type the
    caller stored them as (a reference carries it; the store keeps only the bytes)."""

    sha256: str
    media_type: str
    size: int

    def to_record(self) -> dict[str, Any]:
        """The reference as a stored part names it (see ksi_common.items)."""
        return {"sha256": self.sha256, "media_type": self.media_type, "bytes": self.size}


def damaged_blob(sha256: str, where: str) -> KsiError:
    """The error of a blob whose bytes no longer have their hash (never sent to a model as they are)."""
    return KsiError(ErrorCode.STORAGE_ERROR, f"the stored bytes sha256:{sha256} are damaged (they no longer "
                    "have that hash)", sha256=sha256, stored_in=where)


class BlobStore(Protocol):
    """Content-addressed bytes (images of requests): each content stored once, by its sha256.

    A blob is never changed or removed by the daemon: conversations sharing an image share its
    blob, so deleting one conversation leaves it (`ksi doctor` lists blobs no record names)."""

    async def put(self, data: bytes, media_type: str) -> BlobRef:
        """Store `data` unless the same content is stored already; durable before it returns."""
        ...

    async def get(self, sha256: str) -> bytes | None:
        """The stored bytes, or None when no blob has this hash."""
        ...

    async def has(self, sha256: str) -> bool: ...

    async def ids(self) -> list[str]:
        """Every stored hash, sorted."""
        ...
