"""Request bodies sent compressed (`Content-Encoding: zstd` or `gzip`, as Codex sends them with its
request compression on): decompressed no further than the body limit, so a small body cannot
expand past what an uncompressed one may be."""

from __future__ import annotations

import io
import zlib

import zstandard

from ksi_common.errors import ErrorCode, KsiError

ENCODINGS = ("identity", "zstd", "gzip")


def _too_large(limit: int, encoding: str) -> KsiError:
    return KsiError(ErrorCode.PAYLOAD_TOO_LARGE, f"the body exceeds the limit of {limit} bytes once decompressed "
                                                 f"({encoding})", limit=limit, content_encoding=encoding)


def _malformed(encoding: str, why: str) -> KsiError:
    return KsiError(ErrorCode.INVALID_REQUEST, f"the body is not valid {encoding} data: {why}",
                    content_encoding=encoding)


def decoded(body: bytes, content_encoding: str | None, limit: int) -> bytes:
    """`body` as sent before its `Content-Encoding`: `payload_too_large` past `limit` bytes,
    `invalid_request` when it is not what the header says, `unsupported_media_type` for an encoding
    KSI does not read (or several stacked)."""
    encoding = (content_encoding or "identity").strip().lower()
    if encoding == "identity":
        return body
    if encoding == "zstd":
        return _zstd(body, limit)
    if encoding in ("gzip", "x-gzip"):
        return _gzip(body, limit)
    raise KsiError(ErrorCode.UNSUPPORTED_MEDIA_TYPE,
                   f"the body's Content-Encoding {encoding!r} is not read: send it as zstd, gzip or uncompressed",
                   content_encoding=encoding, expected=list(ENCODINGS))


def _zstd(body: bytes, limit: int) -> bytes:
    try:
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(body), read_across_frames=True) as reader:
            plain = reader.read(limit + 1)
    except zstandard.ZstdError as exc:
        raise _malformed("zstd", str(exc)) from None
    if len(plain) > limit:
        raise _too_large(limit, "zstd")
    return plain


def _gzip(body: bytes, limit: int) -> bytes:
    inflater = zlib.decompressobj(wbits=zlib.MAX_WBITS | 16)
    try:
        plain = inflater.decompress(body, limit + 1)
    except zlib.error as exc:
        raise _malformed("gzip", str(exc)) from None
    if len(plain) > limit or inflater.unconsumed_tail:
        raise _too_large(limit, "gzip")
    if not inflater.eof:
        raise _malformed("gzip", "the stream ends before its end")
    return plain
