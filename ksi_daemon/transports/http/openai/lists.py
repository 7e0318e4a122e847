"""OpenAI's cursor lists (`limit`, `order`, `after`) over items the door already holds."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from ksi_common.errors import ErrorCode, KsiError


def list_page(items: list[dict[str, Any]], request: Request, default_order: str = "desc") -> dict[str, Any]:
    """One page of `items` (given oldest first) as a list object; bad parameters name themselves."""
    query = request.query_params
    order = query.get("order", default_order)
    if order not in ("asc", "desc"):
        raise KsiError(ErrorCode.VALIDATION_ERROR, "order must be asc or desc", fields={"order": "asc or desc"})
    raw_limit = query.get("limit", "20")
    if not raw_limit.isdigit() or not 1 <= int(raw_limit) <= 100:
        raise KsiError(ErrorCode.VALIDATION_ERROR, "limit must be an integer from 1 to 100",
                       fields={"limit": "an integer from 1 to 100"})
    ordered = items if order == "asc" else list(reversed(items))
    after = query.get("after")
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise KsiError(ErrorCode.VALIDATION_ERROR, f"no item {after} in this list", fields={"after": "unknown id"})
        ordered = ordered[ids.index(after) + 1:]
    page = ordered[:int(raw_limit)]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(ordered) > len(page)}
