"""What an image is and how big, read from the first bytes of its file: PNG, JPEG, GIF and WebP.

Nothing is decoded: the media type comes from the signature and the width and height from the
header (a JPEG's from its first frame header), which is all a token budget needs.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

MEDIA_TYPES = ("image/png", "image/jpeg", "image/gif", "image/webp")
SNIFF_BYTES = 16  # enough to tell the four formats apart
_PNG = b"\x89PNG\r\n\x1a\n"
# JPEG markers that start a frame (SOF0-15 but DHT, JPG and DAC): their header holds the size
_FRAME_MARKERS = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})
_STANDALONE_MARKERS = frozenset({0x01, *range(0xD0, 0xD9)})  # TEM, RSTn, SOI: no length follows


@dataclass(frozen=True, slots=True)
class ImageFacts:
    media_type: str
    width: int
    height: int


def media_type_of(head: bytes) -> str | None:
    """The media type the signature at the start of `head` names, or None for none of the four."""
    if head.startswith(_PNG):
        return "image/png"
    if head.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if head.startswith((b"GIF87a", b"GIF89a")):
        return "image/gif"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "image/webp"
    return None


def image_facts(data: bytes) -> ImageFacts | None:
    """The image's type and size, or None when `data` is not one of the four formats or its
    header is cut or malformed."""
    media_type = media_type_of(data)
    try:
        size = _SIZES[media_type](data) if media_type is not None else None
    except (struct.error, IndexError):
        size = None
    if media_type is None or size is None or size[0] <= 0 or size[1] <= 0:
        return None
    return ImageFacts(media_type, size[0], size[1])


def _png(data: bytes) -> tuple[int, int] | None:
    if data[12:16] != b"IHDR":
        return None
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def _gif(data: bytes) -> tuple[int, int]:
    width, height = struct.unpack("<HH", data[6:10])
    return width, height


def _jpeg(data: bytes) -> tuple[int, int] | None:
    position = 2
    while position + 4 <= len(data):
        if data[position] != 0xFF:
            return None
        marker = data[position + 1]
        if marker == 0xFF:  # fill byte before a marker
            position += 1
            continue
        if marker in _STANDALONE_MARKERS:
            position += 2
            continue
        (length,) = struct.unpack(">H", data[position + 2:position + 4])
        if marker in _FRAME_MARKERS:
            height, width = struct.unpack(">HH", data[position + 5:position + 9])
            return width, height
        if marker == 0xDA or length < 2:  # image data before any frame header: malformed
            return None
        position += 2 + length
    return None


def _webp(data: bytes) -> tuple[int, int] | None:
    chunk = data[12:16]
    if chunk == b"VP8 ":  # lossy: a key frame's start code, then 14-bit sizes
        if data[23:26] != b"\x9d\x01\x2a":
            return None
        width, height = struct.unpack("<HH", data[26:30])
        return width & 0x3FFF, height & 0x3FFF
    if chunk == b"VP8L":  # lossless: a signature byte, then 14-bit sizes less one
        if data[20] != 0x2F:
            return None
        (bits,) = struct.unpack("<I", data[21:25])
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if chunk == b"VP8X" and len(data) >= 30:  # extended: 24-bit canvas sizes less one
        width = int.from_bytes(data[24:27], "little") + 1
        height = int.from_bytes(data[27:30], "little") + 1
        return width, height
    return None


_SIZES = {"image/png": _png, "image/jpeg": _jpeg, "image/gif": _gif, "image/webp": _webp}
