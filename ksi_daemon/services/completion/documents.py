"""PDF parts of requests: checked at admission, stored by content hash as images are, and counted.

A client's `input_file` part carries its PDF as a base64 data URL (`file_data`), with an optional
`filename`. Other files go by path in a request's `files` (sent as text), so any other file part
is refused by name. The bytes are stored once in the blob store; every turn that sends the part
again reads them back from there (see images.Images, which sends both kinds).

A PDF's prompt tokens are estimated, as no provider's count is at hand before the call: Anthropic
puts a page at 1,500 to 3,000 tokens of text plus the page as an image, so each page counts as
`TOKENS_PER_PAGE` (the budget over-counts rather than under-counts). Pages are counted by the
page objects in the file (`/Type /Page`); a file whose pages cannot be found counts as one page
per `BYTES_PER_PAGE_GUESS` bytes.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Mapping
from typing import Any

from ksi_common.errors import ErrorCode, KsiError

PDF = "application/pdf"
DATA_PREFIX = f"data:{PDF};base64,"
PART_KEYS = frozenset({"type", "file_data", "filename"})
TOKENS_PER_PAGE = 3000
BYTES_PER_PAGE_GUESS = 50_000
_PAGE = re.compile(rb"/Type\s*/Page(?![a-zA-Z])")


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


def page_count(data: bytes) -> int:
    """The pages of a PDF as its page objects say, else guessed from its size; at least one."""
    found = len(_PAGE.findall(data))
    return max(1, found or len(data) // BYTES_PER_PAGE_GUESS)


def pdf_tokens(ref: Mapping[str, Any]) -> int:
    """The prompt tokens a stored PDF is counted as (see the module's docstring)."""
    pages = ref.get("pages")
    if not isinstance(pages, int) or pages < 1:
        size = ref.get("bytes")
        pages = max(1, size // BYTES_PER_PAGE_GUESS) if isinstance(size, int) else 1
    return pages * TOKENS_PER_PAGE


def _too_large(where: str, size: int | None, limit: int) -> KsiError:
    about = f" ({size} bytes)" if size is not None else ""
    return KsiError(ErrorCode.IMAGE_TOO_LARGE, f"{where} is over the limit of {limit} bytes{about} (the image "
                    "limit applies to a PDF too)", fields={where: "too large"}, limit=limit)
