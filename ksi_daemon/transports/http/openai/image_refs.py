"""Images (and PDFs) a client resends in its own history, named as the stored exchange names them.

A chat client sends the whole conversation every turn, its images included (as data URLs or https
URLs). The stored exchange holds an image by reference (see ksi_common.items): the sha256 of its
bytes, or the https URL it was given as. Named the same way here, a resent image is the same
history, so the conversation is found again; its bytes are never stored twice nor sent through
the event.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from typing import Any

from ksi_common.items import Item


def image_ref(url: str) -> dict[str, Any]:
    """The reference of a client's image URL: a data URL by its bytes' sha256, any other URL as it is."""
    if url.startswith("data:"):
        _header, _comma, payload = url.partition(",")
        try:
            return {"sha256": hashlib.sha256(base64.b64decode(payload, validate=True)).hexdigest()}
        except (binascii.Error, ValueError):
            pass  # not an image KSI could have stored: it matches nothing
    return {"url": url}


def as_history(item: Item) -> Item:
    """An item of the new-input form as a history item: its image parts as references."""
    content = item.get("content")
    if item.get("type") != "message" or not isinstance(content, list):
        return item
    parts = []
    for part in content:
        if part.get("type") == "input_image":
            ref = image_ref(str(part.get("image_url") or ""))
            if part.get("detail") is not None:
                ref["detail"] = part["detail"]
            parts.append({"type": "input_image", "image": ref})
        elif part.get("type") == "input_file":  # a PDF: stored by its bytes' sha256, as an image
            parts.append({"type": "input_file", "file": image_ref(str(part.get("file_data") or ""))})
        else:
            parts.append(part)
    return {**item, "content": parts}
