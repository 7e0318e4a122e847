"""KSI errors in Anthropic's shape: `{"type": "error", "error": {"type", "message"}}` with KSI's
stable code and details inside the error object, at the status the Anthropic SDKs act on."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import JSONResponse, Response

from ksi_common.errors import ErrorCode, KsiError
from ksi_daemon.transports.http.errors import retry_after, retryable, status_of

_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "not_found_error", 409: "invalid_request_error", 413: "request_too_large",
         415: "invalid_request_error", 429: "rate_limit_error", 503: "overloaded_error",
         529: "overloaded_error"}


def status(error: KsiError) -> int:
    """KSI's status for the error, except a full queue: 529, the status Anthropic clients wait out."""
    return 529 if error.code == ErrorCode.OVERLOADED else status_of(error)


def error_object(error: KsiError) -> dict[str, Any]:
    code = status(error)
    inner: dict[str, Any] = {"type": _TYPE.get(code, "api_error" if code >= 500 else "invalid_request_error"),
                             "message": error.message, "code": error.code}
    if error.details:
        inner["details"] = error.details
    return {"type": "error", "error": inner}


def error_response(error: KsiError) -> Response:
    # the Anthropic SDKs retry 408, 409, 429 and 5xx unless told: every answer says which it is
    headers = {"x-should-retry": "true" if retryable(error) else "false"}
    if (seconds := retry_after(error)) is not None or status(error) == 529:
        headers["retry-after"] = seconds or "1"
    return JSONResponse(error_object(error), status_code=status(error), headers=headers)


def sse_error(error: KsiError) -> bytes:
    """An error after the stream began: Anthropic's `error` event."""
    return b"event: error\ndata: " + orjson.dumps(error_object(error)) + b"\n\n"
