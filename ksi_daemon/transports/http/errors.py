"""KSI errors as HTTP: the status for each code and OpenAI's error object, with KSI's code in it."""

from __future__ import annotations

import math
from typing import Any

from ksi_common.errors import ErrorCode, KsiError

_STATUS: dict[str, int] = {
    ErrorCode.INVALID_JSON: 400,
    ErrorCode.INVALID_REQUEST: 400,
    ErrorCode.VALIDATION_ERROR: 400,
    ErrorCode.UNSUPPORTED_PARAMETER: 400,
    ErrorCode.CONTEXT_WINDOW_EXCEEDED: 400,
    ErrorCode.PATH_NOT_ALLOWED: 400,
    ErrorCode.FORK_CYCLE: 400,
    ErrorCode.UNAUTHORIZED: 401,
    ErrorCode.CROSS_SITE_REQUEST: 403,
    ErrorCode.CONVERSATION_EXPIRED: 404,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.METHOD_NOT_ALLOWED: 405,
    ErrorCode.AGENT_EXISTS: 409,
    ErrorCode.AGENT_TERMINATED: 409,
    ErrorCode.CONVERSATION_FULL: 409,
    ErrorCode.CONVERSATION_ARCHIVED: 409,
    ErrorCode.HISTORY_MISMATCH: 409,
    ErrorCode.CANCELLED: 409,
    ErrorCode.RESPONSE_NOT_DELETABLE: 409,
    ErrorCode.RESPONSE_NOT_CANCELLABLE: 409,
    ErrorCode.PREVIOUS_RESPONSE_IN_PROGRESS: 409,
    ErrorCode.PAYLOAD_TOO_LARGE: 413,
    ErrorCode.IMAGE_TOO_LARGE: 413,
    ErrorCode.UNSUPPORTED_MEDIA_TYPE: 415,
    ErrorCode.OVERLOADED: 429,
    ErrorCode.RATE_LIMITED: 429,
    ErrorCode.TOO_MANY_LOGIN_ATTEMPTS: 429,
    ErrorCode.INTERNAL_ERROR: 500,
    ErrorCode.PROVIDER_ERROR: 502,
    ErrorCode.PROVIDER_UNAVAILABLE: 503,
    ErrorCode.SHUTTING_DOWN: 503,
    ErrorCode.DAEMON_RESTART: 503,
    ErrorCode.TIMEOUT: 504,
    # codes other doors and backends add; named here so the mapping is one table
    "conversation_exists": 409,
    "too_many_connections": 503,
    "storage_full": 503,
    "storage_error": 503,
    "storage_symlink": 503,  # the daemon's own var dir is wrong, not the request
    "storage_unavailable": 503,
    "api_key_missing": 503,  # the daemon's configuration, not the request, is at fault
}

# answers a retry cannot change: the daemon's configuration (a missing key, its var dir), or a
# state the request conflicts with for good. The openai SDK retries every 409 and 5xx twice by
# default (waiting seconds) unless the answer says `x-should-retry: false`.
NOT_RETRYABLE = frozenset({
    "api_key_missing", "storage_symlink",
    ErrorCode.AGENT_EXISTS, ErrorCode.AGENT_TERMINATED, ErrorCode.CONVERSATION_FULL,
    ErrorCode.CONVERSATION_ARCHIVED, ErrorCode.HISTORY_MISMATCH, ErrorCode.CANCELLED,
    ErrorCode.RESPONSE_NOT_DELETABLE, ErrorCode.RESPONSE_NOT_CANCELLABLE, "conversation_exists",
})

_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "invalid_request_error", 409: "invalid_request_error", 413: "invalid_request_error",
         415: "invalid_request_error", 429: "rate_limit_error"}


def status_for(code: str) -> int:
    """The HTTP status of a KSI error code; unknown `*_not_found` codes are 404, other unknown ones 400."""
    if code in _STATUS:
        return _STATUS[code]
    return 404 if code.endswith("_not_found") else 400


def status_of(error: KsiError) -> int:
    """The HTTP status of an error: a provider that refused the request itself (unknown model, bad
    parameter: its own 4xx other than 429) points at the client's input, so that is a 400."""
    upstream = error.details.get("status")
    if error.code == ErrorCode.PROVIDER_ERROR and isinstance(upstream, int) and 400 <= upstream < 500 \
            and upstream != 429:
        return 400
    return status_for(error.code)


def retry_after(error: KsiError) -> str | None:
    """Whole seconds for a `Retry-After` header, from the error's hint (at least 1)."""
    if status_of(error) != 429 and error.code not in ("provider_unavailable", "shutting_down",
                                                      "too_many_connections"):
        return None
    hint = error.details.get("retry_after")
    seconds = hint if isinstance(hint, int | float) and not isinstance(hint, bool) else 1
    return str(max(1, math.ceil(seconds)))


def retryable(error: KsiError) -> bool:
    """Whether the same request sent again may be answered otherwise: a busy or unavailable daemon
    or provider (408, 409, 429, 5xx), unless its code is one a retry cannot change."""
    status = status_of(error)
    return error.code not in NOT_RETRYABLE and (status in (408, 409, 429) or status >= 500)


def error_headers(error: KsiError) -> dict[str, str]:
    """The headers an error's answer carries: `Retry-After` with a hint, `x-should-retry: false`
    when a retry cannot help."""
    headers: dict[str, str] = {}
    if (seconds := retry_after(error)) is not None:
        headers["retry-after"] = seconds
    if error.code in NOT_RETRYABLE:
        headers["x-should-retry"] = "false"
    return headers


def error_body(error: KsiError) -> dict[str, Any]:
    """OpenAI's error object; `param` names the first invalid field when KSI knows it."""
    status = status_of(error)
    fields = error.details.get("fields")
    param = next(iter(fields), None) if isinstance(fields, dict) and fields else error.details.get("param")
    body: dict[str, Any] = {
        "message": error.message,
        "type": _TYPE.get(status, "server_error" if status >= 500 else "invalid_request_error"),
        "param": param if isinstance(param, str) else None,
        "code": error.code,
    }
    if error.details:
        body["details"] = error.details
    return {"error": body}
