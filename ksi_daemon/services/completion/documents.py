"""PDF parts of requests: checked at admission, stored by content hash as images are, and counted.

A client's `input_file` part carries its PDF as a base64 data URL (`file_data`), with an optional
`filename`. Other files go by path in a request's `files` (sent as text), so any other file part
is refused by name. The bytes are stored once in the blob store; every turn that sends the part
again reads them back from there (see images.Images, which sends both kinds). Its prompt tokens
are estimated by its pages (ksi_common.pdf_pages).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from typing import Any

from ksi_common.errors import ErrorCode, KsiError

PDF = "application/pdf"
DATA_PREFIX = f"data:{PDF};base64,"
PART_KEYS = frozenset({"type", "file_data", "filename"})


def is_pdf_part(part: Mapping[str, Any]) -> bool:
    """Whether a client's file part carries a PDF as a data URL (the only file part taken)."""
    data = part.get("file_data")
    return part.get("type") == "input_file" and isinstance(data, str) and data.startswith(DATA_PREFIX) \
        and not (set(part) - PART_KEYS)


def pdf_bytes(part: Mapping[str, Any], field: str, max_bytes: int) -> bytes:
    """The decoded bytes of a PDF part, checked: valid base64, a PDF by its first bytes, within
    `max_bytes` (the image limit); nothing is written here."""
    where = f"{field}.file_data"
    payload = str(part["file_data"])[len(DATA_PREFIX):]
    if len(payload) // 4 * 3 > max_bytes + 2:  # known too large before anything is decoded
        raise _too_large(where, None, max_bytes)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise KsiError(ErrorCode.VALIDATION_ERROR, f"{where} is not valid base64",
                       fields={where: "not valid base64"}) from None
    if len(data) > max_bytes:
        raise _too_large(where, len(data), max_bytes)
    if not data.startswith(b"%PDF-"):
        raise KsiError(ErrorCode.VALIDATION_ERROR, f"{where} is not a PDF (it does not start with %PDF-)",
                       fields={where: "not a PDF"})
    filename = part.get("filename")
    if filename is not None and not isinstance(filename, str):
        raise KsiError(ErrorCode.VALIDATION_ERROR, f"{field}.filename must be text",
                       fields={f"{field}.filename": "must be text"})
    return data


def _too_large(where: str, size: int | None, limit: int) -> KsiError:
    about = f" ({size} bytes)" if size is not None else ""
    return KsiError(ErrorCode.IMAGE_TOO_LARGE, f"{where} is over the limit of {limit} bytes{about} (the image "
                    "limit applies to a PDF too)", fields={where: "too large"}, limit=limit)
