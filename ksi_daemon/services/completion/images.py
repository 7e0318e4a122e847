"""Image parts of requests: taken in once, stored by content hash, sent to vision models; PDF parts
(see documents.py) take the same path: stored by hash, rebuilt from the blob store for every turn.

A client's part names its image by an https URL (kept as the URL: the provider fetches it, the
daemon never does), a `data:` URL (decoded and stored) or a path inside `KSI_ALLOWED_FILE_ROOTS`
(read once and stored; later turns never read the client's path again). A stored part names the
bytes by reference (see ksi_common.items); every later turn rebuilds the image from the blob store.

Every check runs before anything is written: a refused image leaves no blob behind.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import errno
import os
import stat
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import structlog

from ksi_common.errors import ErrorCode, KsiError
from ksi_common.items import MEDIA_PART_TYPES, file_name, media_parts, part_text
from ksi_common.pdf_pages import page_count, pdf_tokens
from ksi_daemon.services.completion import documents
from ksi_daemon.services.completion.file_roots import FileRoots
from ksi_daemon.services.completion.image_headers import (
    MEDIA_TYPES,
    SNIFF_BYTES,
    ImageFacts,
    image_facts,
    media_type_of,
)
from ksi_daemon.services.conversations.image_tokens import image_tokens
from ksi_daemon.services.conversations.memory import Exchange
from ksi_daemon.storage.ports import BlobStore

log = structlog.get_logger("ksi.images")

DETAILS = ("auto", "low", "high")
MAX_URL_CHARS = 8192
DECLARED_ALIASES = {"image/jpg": "image/jpeg"}
READ_CHUNK = 1024 * 1024
PART_KEYS = frozenset({"type", "image_url", "path", "file_path", "detail"})
DATA_URL_CACHE_BYTES = 64 * 1024 * 1024  # data URLs kept for the next turns of the same conversations
ENCODE_STEP = 3 * 64 * 1024  # bytes base64-encoded at a time (a multiple of 3: the pieces join as one)


@dataclass(frozen=True, slots=True)
class CheckedImage:
    """An image that passed every check, not yet stored: its bytes (None for a URL kept as is)."""

    field: str
    detail: str | None
    url: str | None = None
    data: bytes | None = None
    facts: ImageFacts | None = None
    name: str | None = None  # the file's name (never its directories), for people reading the record
    kind: str = "input_image"  # or input_file: a PDF, whose facts are its pages
    pages: int | None = None


class Images:
    """Takes image parts in (`admit`), and gives them back as chat parts for any later turn."""

    def __init__(self, blobs: BlobStore, roots: FileRoots, max_bytes: int,
                 cache_bytes: int = DATA_URL_CACHE_BYTES) -> None:
        self.blobs = blobs
        self.roots = roots
        self.max_bytes = max_bytes
        self.data_urls = DataUrlCache(cache_bytes)

    # -- taking parts in ------------------------------------------------------
    async def admit(self, part: Mapping[str, Any], field: str = "image") -> dict[str, Any]:
        """The stored part for a client's `input_image` part (its bytes stored once by hash)."""
        return await self.store(await self.check(part, field))

    async def check(self, part: Mapping[str, Any], field: str = "image") -> CheckedImage:
        """Every check of a client's part, its bytes read (a path's in a worker thread); nothing written."""
        if part.get("type") == "input_file":
            if not documents.is_pdf_part(part):
                raise KsiError(ErrorCode.UNSUPPORTED_PARAMETER, f"{field}: a file part other than a PDF as a base64 "
                               "data URL in file_data; give other files' paths in files",
                               fields={field: "only a PDF in file_data"})
            data = documents.pdf_bytes(part, field, self.max_bytes)
            name = file_name(part.get("filename"))
            return CheckedImage(field, None, data=data, name=name, kind="input_file", pages=page_count(data))
        if part.get("type") != "input_image":
            raise _invalid(field, "type", "an image part has type input_image")
        if "file_id" in part:
            raise KsiError(ErrorCode.UNSUPPORTED_PARAMETER,
                           "file_id names a file in a provider's file store; give an https URL, a data URL or a path",
                           fields={f"{field}.file_id": "not supported"})
        unknown = sorted(set(part) - PART_KEYS)
        if unknown:
            raise _invalid(field, unknown[0], "not a field of an image part")
        detail = part.get("detail")
        if detail is not None and detail not in DETAILS:
            raise _invalid(field, "detail", f"one of {', '.join(DETAILS)}")
        sources = [key for key in ("image_url", "path", "file_path") if part.get(key) is not None]
        if len(sources) != 1:
            raise _invalid(field, "image_url", "give exactly one of image_url, path or file_path")
        source = sources[0]
        value = part[source]
        if not isinstance(value, str) or not value:
            raise _invalid(field, source, "must be a non-empty string")
        where = f"{field}.{source}"
        if source != "image_url":
            return await self._from_path(value, field, where, detail)
        if value.startswith("data:"):
            return self._checked_bytes(self._decode_data_url(value, where), field, where, detail)
        if not value.startswith("https://") or not _host(value) or len(value) > MAX_URL_CHARS:
            raise _invalid(field, "image_url", f"an https:// URL (at most {MAX_URL_CHARS} characters) or a data: URL")
        return CheckedImage(field, detail, url=value)

    async def store(self, checked: CheckedImage) -> dict[str, Any]:
        """The stored part of a checked image or PDF: its bytes put in the blob store (once per content)."""
        if checked.kind == "input_file" and checked.data is not None:
            stored = await self.blobs.put(checked.data, documents.PDF)
            ref = {**stored.to_record(), "pages": checked.pages}
            if checked.name is not None:
                ref["name"] = checked.name
            return {"type": "input_file", "file": ref}
        if checked.data is None or checked.facts is None:
            ref: dict[str, Any] = {"url": checked.url}
        else:
            stored = await self.blobs.put(checked.data, checked.facts.media_type)
            ref = {**stored.to_record(), "width": checked.facts.width, "height": checked.facts.height}
            if checked.name is not None:
                ref["name"] = checked.name
        if checked.detail is not None:
            ref["detail"] = checked.detail
        return {"type": "input_image", "image": ref}

    async def split_files(self, paths: Sequence[str]) -> tuple[list[str], list[CheckedImage]]:
        """A request's `files` parted into those sent as text (left to the attachments) and the
        images among them (PNG, JPEG, GIF, WebP by their first bytes), checked and read. Every
        path is checked here, so an error names its place in the request's list."""
        rest: list[str] = []
        images: list[CheckedImage] = []
        for position, raw in enumerate(paths):
            field = f"files.{position}"
            if await asyncio.to_thread(self._is_image_file, raw, field):
                images.append(await self._from_path(raw, field, field, None))
            else:
                rest.append(raw)
        return rest, images

    def _is_image_file(self, raw: str, field: str) -> bool:
        return _looks_like_image(self.roots.regular_file(raw, field))

    async def _from_path(self, raw: str, field: str, where: str, detail: str | None) -> CheckedImage:
        data = await asyncio.to_thread(self._read_file, raw, where)
        # only the file's name: the client's directories are its machine's, not the record's readers'
        return self._checked_bytes(data, field, where, detail, name=os.path.basename(raw.rstrip("/")) or None)

    def _checked_bytes(self, data: bytes, field: str, where: str, detail: str | None,
                       name: str | None = None) -> CheckedImage:
        facts = image_facts(data)
        if facts is None:
            raise KsiError(ErrorCode.UNSUPPORTED_MEDIA_TYPE,
                           f"{where} is not a PNG, JPEG, GIF or WebP image",
                           fields={where: "not an image of a supported type"},
                           supported=list(MEDIA_TYPES))
        return CheckedImage(field, detail, data=data, facts=facts, name=name)

    def _too_large(self, where: str, size: int | None) -> KsiError:
        about = f" ({size} bytes)" if size is not None else ""
        return KsiError(ErrorCode.IMAGE_TOO_LARGE, f"{where} is over the image limit of {self.max_bytes} bytes{about}",
                        fields={where: "too large"}, limit=self.max_bytes)

    def _decode_data_url(self, url: str, where: str) -> bytes:
        header, comma, payload = url.partition(",")
        params = header[len("data:"):].lower().split(";")
        if not comma or "base64" not in params[1:]:
            raise KsiError(ErrorCode.VALIDATION_ERROR, f"{where} must be a base64 data URL",
                           fields={where: "data:<media type>;base64,<data>"})
        declared = DECLARED_ALIASES.get(params[0], params[0])
        if declared not in MEDIA_TYPES:
            raise KsiError(ErrorCode.UNSUPPORTED_MEDIA_TYPE, f"{where} declares {params[0] or 'no media type'}",
                           fields={where: f"one of {', '.join(MEDIA_TYPES)}"}, supported=list(MEDIA_TYPES))
        if len(payload) // 4 * 3 > self.max_bytes + 2:  # known too large before anything is decoded
            raise self._too_large(where, None)
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise KsiError(ErrorCode.VALIDATION_ERROR, f"{where} is not valid base64",
                           fields={where: "not valid base64"}) from None
        if len(data) > self.max_bytes:
            raise self._too_large(where, len(data))
        return data

    def _read_file(self, raw: str, where: str) -> bytes:
        """The file's bytes, read once through one descriptor: only inside the roots, never
        through a link put there since it was resolved, never a device or pipe, never more than
        the limit."""
        resolved = self.roots.resolve(raw, where)
        try:
            fd = os.open(resolved, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            raise KsiError(ErrorCode.VALIDATION_ERROR, f"{raw} does not exist", fields={where: "no such file"}) from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # replaced by a link after it was resolved
                raise KsiError(ErrorCode.PATH_NOT_ALLOWED, f"{raw} is a symbolic link made after it was checked",
                               path=raw) from None
            raise KsiError(ErrorCode.VALIDATION_ERROR, f"{raw} could not be read: {exc.strerror or exc}",
                           fields={where: "unreadable"}) from None
        try:
            self._check_opened(fd, raw)
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise KsiError(ErrorCode.VALIDATION_ERROR, f"{raw} is not a regular file",
                               fields={where: "not a regular file"})
            if info.st_size > self.max_bytes:
                raise self._too_large(where, info.st_size)
            chunks: list[bytes] = []
            left = self.max_bytes + 1
            while left > 0 and (chunk := os.read(fd, min(left, READ_CHUNK))):
                chunks.append(chunk)
                left -= len(chunk)
        except OSError as exc:
            raise KsiError(ErrorCode.VALIDATION_ERROR, f"{raw} could not be read: {exc.strerror or exc}",
                           fields={where: "unreadable"}) from None
        finally:
            os.close(fd)
        data = b"".join(chunks)
        if len(data) > self.max_bytes:  # it grew since fstat
            raise self._too_large(where, None)
        return data

    def _check_opened(self, fd: int, raw: str) -> None:
        """The opened file is inside the roots: a directory swapped for a link between `resolve`
        and `open` would otherwise let a file outside them be read."""
        try:
            real = Path(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # no /proc: the path is refused rather than read unchecked
            raise KsiError(ErrorCode.PATH_NOT_ALLOWED, f"{raw} could not be checked once opened", path=raw) from None
        if not self.roots.allowed(real):
            raise KsiError(ErrorCode.PATH_NOT_ALLOWED, f"{raw} led outside the allowed roots when it was opened",
                           path=raw)

    # -- giving parts back ----------------------------------------------------
    async def chat_part(self, part: Mapping[str, Any]) -> dict[str, Any]:
        """A stored part as a chat message's `image_url` part: its URL, or its bytes as a data URL;
        an image whose bytes are missing or damaged becomes the note a model without vision gets
        (a text part), so one lost blob does not fail every later turn of its conversation. A PDF
        becomes litellm's `file` part (which it sends to Anthropic as a document block)."""
        if part.get("type") == "input_file":
            return await self._file_part(part)
        ref = part.get("image") or {}
        image: dict[str, Any]
        if ref.get("url"):
            image = {"url": str(ref["url"])}
        else:
            sha256 = str(ref.get("sha256") or "")
            url = self.data_urls.get(sha256)
            if url is None:
                url = await self._data_url(sha256, str(ref.get("media_type") or "application/octet-stream"))
                if url is None:
                    return {"type": "text", "text": f"{part_text([dict(part)])} (its stored bytes are missing)"}
                self.data_urls.put(sha256, url)
            image = {"url": url}
        if ref.get("detail"):
            image["detail"] = str(ref["detail"])
        return {"type": "image_url", "image_url": image}

    async def _file_part(self, part: Mapping[str, Any]) -> dict[str, Any]:
        ref = part.get("file") or {}
        sha256 = str(ref.get("sha256") or "")
        url = self.data_urls.get(sha256)
        if url is None:
            url = await self._data_url(sha256, documents.PDF)
            if url is None:
                return {"type": "text", "text": f"{part_text([dict(part)])} (its stored bytes are missing)"}
            self.data_urls.put(sha256, url)
        file: dict[str, Any] = {"file_data": url}
        if ref.get("name"):
            file["filename"] = str(ref["name"])
        return {"type": "file", "file": file}

    async def _data_url(self, sha256: str, claimed: str) -> str | None:
        """The blob as a data URL; None when missing or damaged. The store checks the bytes against
        their hash off the event loop, and they are encoded in a worker thread: megabytes of hashing
        and base64 would hold the loop."""
        try:
            data = await self.blobs.get(sha256)
        except KsiError as exc:  # damaged: logged by the store; never sent as it is
            log.warning("image_not_sent", sha256=sha256, code=exc.code)
            return None
        if data is None:
            log.warning("image_not_sent", sha256=sha256, code="missing")
            return None
        return await asyncio.to_thread(_encoded, data, claimed)

    async def with_images(self, items: Sequence[Mapping[str, Any]], messages: list[dict[str, Any]],
                          kinds: frozenset[str] = frozenset(MEDIA_PART_TYPES)) -> list[dict[str, Any]]:
        """Chat messages of `items` (one exchange's input) with its stored images and PDFs of `kinds`
        sent as parts: the last user message becomes its text parts then those, rebuilt from storage
        (a part of another kind stays its label in the text)."""
        parts = [part for part in media_parts(items) if part.get("type") in kinds]
        if not parts:
            return messages
        out = list(messages)
        for position in range(len(out) - 1, -1, -1):
            if out[position].get("role") == "user":
                chat = [await self.chat_part(part) for part in parts]
                text = _without_labels(str(out[position].get("content") or ""), parts)
                out[position] = {**out[position], "content": [{"type": "text", "text": text}, *chat]}
                break
        return out

    async def replay(self, exchanges: Sequence[Exchange], kinds: frozenset[str]) -> list[Exchange]:
        """History as a turn sends it: each exchange's stored images and PDFs of `kinds` (those the
        model takes) rebuilt from storage. Others stay the text, which names each (`[image NAME]`)."""
        if not kinds:
            return list(exchanges)
        out: list[Exchange] = []
        for exchange in exchanges:
            if not any(part.get("type") in kinds for part in media_parts(exchange.input)):
                out.append(exchange)
                continue
            out.append(exchange.sent_as(await self.with_images(exchange.input, exchange.chat_messages(), kinds)))
        return out

    @classmethod
    def part_tokens(cls, part: Mapping[str, Any], model: str) -> int:
        """The prompt tokens of a stored image or PDF part for `model`."""
        if part.get("type") == "input_file":
            return pdf_tokens(part.get("file") or {})
        return cls.tokens(part.get("image") or {}, model)

    @staticmethod
    def tokens(ref: Mapping[str, Any], model: str) -> int:
        """The prompt tokens of a stored image for `model`, by its provider's rule."""
        width, height = ref.get("width"), ref.get("height")
        return image_tokens(model, width if isinstance(width, int) else None,
                            height if isinstance(height, int) else None, ref.get("detail"))


class DataUrlCache:
    """Data URLs by sha256, least recently used dropped first, at most `limit` characters in all:
    a conversation's images are sent again every turn, and encoding them each time is wasted work."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.size = 0
        self._urls: OrderedDict[str, str] = OrderedDict()

    def get(self, sha256: str) -> str | None:
        url = self._urls.get(sha256)
        if url is not None:
            self._urls.move_to_end(sha256)
        return url

    def put(self, sha256: str, url: str) -> None:
        if len(url) > self.limit or sha256 in self._urls:
            return
        self._urls[sha256] = url
        self.size += len(url)
        while self.size > self.limit:
            _, dropped = self._urls.popitem(last=False)
            self.size -= len(dropped)


def _encoded(data: bytes, claimed: str) -> str:
    # the type its bytes show, not the one a record (perhaps imported) claims
    media_type = media_type_of(data[:SNIFF_BYTES]) or claimed
    # in pieces: base64 holds the interpreter lock while it runs, so one call over megabytes would
    # stall the event loop even from a worker thread; the one join is the only copy of the whole
    view = memoryview(data)
    return "".join([f"data:{media_type};base64,", *(base64.b64encode(view[start:start + ENCODE_STEP]).decode("ascii")
                                                    for start in range(0, len(data), ENCODE_STEP))])


def _invalid(field: str, key: str, why: str) -> KsiError:
    return KsiError(ErrorCode.VALIDATION_ERROR, f"{field}.{key}: {why}", fields={f"{field}.{key}": why})


def _host(url: str) -> str | None:
    if any(c.isspace() for c in url):
        return None
    try:
        return urlsplit(url).hostname
    except ValueError:  # a malformed address ("https://[::1")
        return None


def _looks_like_image(path: Path) -> bool:
    """Whether a file starts like one of the four image formats (a missing or odd file does not:
    the attachments report it)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        return media_type_of(os.read(fd, SNIFF_BYTES)) is not None
    except OSError:
        return False
    finally:
        os.close(fd)


def _without_labels(text: str, parts: Sequence[Mapping[str, Any]]) -> str:
    """A message's chat text without the `[image NAME]` labels its text form gives each image
    (sent as image parts instead); attached files and the user's own text stay."""
    for part in parts:
        label = part_text([dict(part)])
        text = text.replace(f" {label}", "", 1) if f" {label}" in text else text.replace(label, "", 1)
    return text
