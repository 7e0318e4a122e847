"""What a PDF costs in a model's prompt, estimated before any provider counts it.

Anthropic puts a page at 1,500 to 3,000 tokens of text plus the page as an image, so each page
counts as `TOKENS_PER_PAGE` (a budget over-counts rather than under-counts). Pages are counted by
the page objects in the file (`/Type /Page`); a file whose pages cannot be found counts as one
page per `BYTES_PER_PAGE_GUESS` bytes. The daemon's turn budget and the Messages door's
count_tokens both count this way.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

TOKENS_PER_PAGE = 3000
BYTES_PER_PAGE_GUESS = 50_000
_PAGE = re.compile(rb"/Type\s*/Page(?![a-zA-Z])")


def page_count(data: bytes) -> int:
    """The pages of a PDF as its page objects say, else guessed from its size; at least one."""
    found = len(_PAGE.findall(data))
    return max(1, found or len(data) // BYTES_PER_PAGE_GUESS)


def pdf_tokens(ref: Mapping[str, Any]) -> int:
    """The prompt tokens of a stored PDF's reference: its pages, else its size."""
    pages = ref.get("pages")
    if not isinstance(pages, int) or pages < 1:
        size = ref.get("bytes")
        pages = max(1, size // BYTES_PER_PAGE_GUESS) if isinstance(size, int) else 1
    return pages * TOKENS_PER_PAGE
